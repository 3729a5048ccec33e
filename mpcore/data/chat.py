"""Chat SFT lines -> token ids and an assistant-only loss mask, with the release's chat template.

Input, one JSON object per line (``path:line`` in every error):
    {"messages": [{"role": "system"|"user"|"assistant"|"tool", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}      = one user turn, one assistant turn
    {"prompt": [messages], "completion": [messages]}   (both parts as message lists)
An assistant message may carry ``tool_calls`` (then its content may be empty); any other key
of a message is passed to the template as it is, and a line's ``"tools"`` (a list of function
schemas) goes to the template as ``apply_chat_template(..., tools=...)``. Every line needs an assistant turn.

Ids: ``apply_chat_template(messages)`` of transformers' ``AutoTokenizer`` on the folder (the
template's own text, then its tokens without added specials), i.e. exactly
``apply_chat_template(messages, tokenize=True)``.

The mask (1 = trained target), for each assistant turn ``i``: the text between
``render(messages[:i], add_generation_prompt=True)`` (everything up to and including the
turn's role header) and ``render(messages[:i + 1])`` (the turn's end), cut after the LAST
special token in it: the turn's content and its end-of-turn token (``<|im_end|>``, ``</s>``,
``<|eot_id|>``), not the role header, not the newline a template writes after the end token,
not any system, user or tool token. Refused, by line:
- a template that rewrites earlier turns once later ones follow (Qwen3 drops the ``<think>``
  blocks of earlier assistant turns, and renders the last turn with a ``<think>`` block that
  earlier ones lose): the prefix renderings are then not prefixes of the whole, so a turn's
  trained text is not the text the model sees. With ``split_rewritten`` (``prepare_data.py
  --chat-split-rewritten``) such a conversation becomes one document per assistant turn
  ``i``: ``messages[:i + 1]`` rendered whole, only turn ``i`` trained (earlier turns are
  context, as the template shows them when turn ``i`` is generated); conversations the
  template does not rewrite stay one document;
- a turn without a special token at its end (nothing marks where the turn stops);
- a conversation opening with an assistant turn (transformers renders no empty conversation,
  so what precedes the turn, e.g. a default system prompt, cannot be found);
- a token that straddles a turn's edge (the template glued the header to the content).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mpcore.data.hf_encode import HFTokenizer
from mpcore.data.indexed import IndexedWriter
from mpcore.data.jsonl import json_lines
from mpcore.progress import ProgressBar

ROLES = ("system", "user", "assistant", "tool")


class RewrittenTurn(ValueError):
    """The template renders an earlier turn differently once later turns follow."""


def _message(m, where: str, k: int) -> dict:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: message {k} is not an object with role and content")
    role, content = m.get("role"), m.get("content")
    if role not in ROLES:
        raise ValueError(f"{where}: message {k} has role {role!r}; use one of {', '.join(ROLES)}")
    if isinstance(content, list):
        raise ValueError(f"{where}: message {k} has a list as content (images or parts); text "
                         f"SFT takes a string; prepare image conversations for a VL family")
    if not isinstance(content, str) and not (role == "assistant" and m.get("tool_calls")):
        raise ValueError(f"{where}: message {k} ({role}) has no string content")
    if not (content or "").strip() and not (role == "assistant" and m.get("tool_calls")):
        raise ValueError(f"{where}: message {k} ({role}) has empty content; drop the message "
                         f"or the line")
    return m


def _as_messages(value, where: str, name: str, role: str) -> list:
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return value
    raise ValueError(f"{where}: {name} must be a string or a list of messages")


def messages_of(obj, where: str) -> list[dict]:
    """The checked messages of one JSONL object (module docstring); ``ValueError`` naming
    ``where`` (``path:line``) and the fix."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with messages, or prompt and "
                         f"completion")
    if "messages" in obj:
        messages = obj["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{where}: messages must be a non-empty list of "
                             f'{{"role": ..., "content": ...}} objects')
    elif "prompt" in obj and "completion" in obj:
        messages = (_as_messages(obj["prompt"], where, "prompt", "user")
                    + _as_messages(obj["completion"], where, "completion", "assistant"))
    else:
        raise ValueError(f"{where}: expected a messages list, or prompt and completion; found "
                         f"keys {sorted(obj)}")
    messages = [_message(m, where, k) for k, m in enumerate(messages)]
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError(f"{where}: no assistant turn, so nothing would train; add the "
                         f"assistant's answer or drop the line")
    return messages


class ChatRenderer:
    """Renders and masks conversations with ``tok``'s chat template (module docstring).
    ``ValueError`` when the folder has no chat template."""

    def __init__(self, tok: HFTokenizer, split_rewritten: bool = False):
        if not tok.info.chat_template:
            raise ValueError(f"{tok.folder} has no chat template (tokenizer_config.json "
                             f"chat_template or chat_template.jinja); use the instruct "
                             f"release's tokenizer folder, or prepare plain text instead")
        self.tok, self.hf, self.split_rewritten = tok, tok.hf, split_rewritten
        self.template: str | None = None  # None: the tokenizer's own (a subclass may name one)
        added = tok.backend.get_added_tokens_decoder()
        self.special = {i for i, t in added.items() if t.special}

    def _render(self, messages: list[dict], where: str, prompt: bool = False,
                tools: list | None = None) -> str:
        try:
            return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                               add_generation_prompt=prompt,
                                               chat_template=self.template)
        except Exception as e:  # jinja2 errors, raise_exception() of the template itself
            raise ValueError(f"{where}: the chat template of {self.tok.folder} refuses this "
                             f"conversation ({type(e).__name__}: {e})") from None

    def _head(self, before: list[dict], where: str, tools: list | None) -> str:
        """What precedes an assistant turn: ``before`` with the generation prompt (also when
        empty: a template may open with a default system prompt)."""
        try:
            return self._render(before, where, True, tools)
        except ValueError:
            if before:
                raise
            raise ValueError(f"{where}: the conversation opens with an assistant turn, which "
                             f"the chat template of {self.tok.folder} cannot render alone; "
                             f"start it with a user (or system) turn") from None

    def spans(self, messages: list[dict], where: str, tools: list | None = None
              ) -> tuple[str, list[tuple[int, int]]]:
        """``(text, [(start, end) character span of each assistant turn])``."""
        text = self._render(messages, where, tools=tools)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._head(messages[:i], where, tools)
            upto = self._render(messages[: i + 1], where, tools=tools)
            if not (text.startswith(upto) and upto.startswith(head)):
                raise RewrittenTurn(
                    f"{where}: the chat template of {self.tok.folder} renders assistant turn "
                    f"{i} differently once later turns follow (Qwen3 drops earlier <think> "
                    f"blocks), so its trained tokens cannot be marked; pass "
                    f"--chat-split-rewritten (one document per assistant turn), put one "
                    f"assistant turn per line, or drop the earlier reasoning")
            spans.append((len(head), len(upto)))
        return text, spans

    def documents(self, messages: list[dict], where: str, tools: list | None = None
                  ) -> list[tuple[np.ndarray, np.ndarray]]:
        """The ``(ids, mask)`` documents of one conversation: one, or with ``split_rewritten``
        one per assistant turn when the template rewrites earlier turns (module docstring)."""
        try:
            return [self.encode(messages, where, tools=tools)]
        except RewrittenTurn:
            if not self.split_rewritten:
                raise
        out = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                ids, mask = self.encode(messages[: i + 1], where, True, tools)
                out.append((ids, mask))
        return out

    def encode(self, messages: list[dict], where: str, last_only: bool = False,
               tools: list | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(ids int64 [n], mask uint8 [n])`` of one conversation (module docstring);
        ``last_only``: only the last assistant turn is trained (its span alone is checked)."""
        if last_only:
            text = self._render(messages, where, tools=tools)
            head = self._head(messages[:-1], where, tools)
            if not text.startswith(head):
                raise ValueError(f"{where}: the chat template of {self.tok.folder} does not "
                                 f"render the last assistant turn after its generation prompt; "
                                 f"this template cannot be masked")
            spans = [(len(head), len(text))]
        else:
            text, spans = self.spans(messages, where, tools)
        enc = self.tok.backend.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        starts = np.asarray([s for s, _ in enc.offsets], dtype=np.int64)
        ends = np.asarray([e for _, e in enc.offsets], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for turn, (lo, hi) in enumerate(spans):
            inside = (starts >= lo) & (ends <= hi) & (ends > starts)
            cross = ((starts < lo) & (ends > lo)) | ((starts < hi) & (ends > hi))
            if cross.any():
                raise ValueError(f"{where}: a token straddles the edge of assistant turn "
                                 f"{turn} (the template glues its header or end to the "
                                 f"content), so the turn cannot be masked exactly")
            where_special = np.flatnonzero(inside & np.isin(ids, list(self.special)))
            if not len(where_special):
                raise ValueError(f"{where}: assistant turn {turn} ends without a special "
                                 f"token, so nothing marks where it stops; this template "
                                 f"cannot be masked")
            first = int(np.flatnonzero(inside)[0])
            mask[first : where_special[-1] + 1] = 1
        return ids, mask


def tools_of(line) -> list | None:
    """A line's ``tools`` (function schemas the template renders), or None."""
    tools = line.value.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"{line.where}: tools must be a list of function schemas")
    return tools


def chat_meta(tok: HFTokenizer, paths: list[Path]) -> dict:
    """The ``.meta.json`` of a chat dataset (``doc_sources`` filled while writing)."""
    return {"kind": "chat", "masked": True, "sources": [str(p) for p in paths],
            "tokenizer": {"folder": str(tok.folder), **tok.info.fingerprint},
            "doc_sources": []}


def prepare_chat(tok: HFTokenizer, paths: list[Path], prefix: Path, seq_len: int | None = None,
                 progress: bool = True, split_rewritten: bool = False) -> int:
    """Every line of the JSONL ``paths`` as one masked document in ``<prefix>.bin/.idx/.mask/
    .meta.json`` (``doc_sources``: ``[file index, line]`` per document); returns the number
    of documents. ``seq_len``: refuse a conversation longer than it here, by line. Any bad
    line stops with ``path:line`` and leaves nothing at ``prefix``."""
    renderer = ChatRenderer(tok, split_rewritten)
    meta = chat_meta(tok, paths)
    size = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    bar = ProgressBar(f"rendering chats -> {prefix}", size, "MB") if progress else None
    done = 0
    with IndexedWriter(prefix, tok.vocab_size, progress=False, masked=True, meta=meta) as writer:
        for file_index, path in enumerate(paths):
            if not Path(path).is_file():
                raise ValueError(f"input file {path} does not exist")
            for line in json_lines(path):
                if line.problem:
                    raise ValueError(f"{line.where}: {line.problem}")
                messages = messages_of(line.value, line.where)
                for ids, mask in renderer.documents(messages, line.where, tools_of(line)):
                    if seq_len is not None and len(ids) > seq_len:
                        raise ValueError(f"{line.where}: the conversation has {len(ids)} "
                                         f"tokens, more than --seq-len {seq_len}; shorten or "
                                         f"drop it")
                    writer.add(ids, mask)
                    meta["doc_sources"].append([file_index, line.number])
                # About the line's bytes (the bar is over the files' sizes).
                done += sum(len(m.get("content") or "") + 32 for m in messages)
                if bar is not None:
                    bar.update(done)
        if not writer.num_docs:  # inside the writer: an empty dataset is never committed
            raise ValueError(f"no conversations in {', '.join(map(str, paths))}: the files "
                             f"are empty; nothing was written. Check the input paths")
    if bar is not None:
        bar.close()
    return writer.num_docs
