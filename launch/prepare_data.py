"""Tokenize text / JSONL files (or chat conversations) into an indexed binary dataset.

    python launch/prepare_data.py --input a.jsonl [b.txt ...] --output-prefix data/corpus \\
        (--tokenizer CKPT_FOLDER | --tokenizer existing.model |
         --train-tokenizer out.model --vocab-size N) [--text-key text]
    python launch/prepare_data.py --chat --input chats.jsonl --output-prefix data/sft \\
        --tokenizer CKPT_FOLDER [--seq-len 4096]
    python launch/prepare_data.py --show data/sft [--limit 5] [--text]

Tokenizers: a released checkpoint's folder (``tokenizer.json`` + ``tokenizer_config.json``;
the file ``tokenizer.json`` names its folder), encoded as transformers' ``AutoTokenizer``
encodes (``mpcore.data.hf_encode``), bos / eos / pad from the folder's own config; or a
SentencePiece ``.model``, or one trained here with ``--train-tokenizer`` (deterministic: same
files, same order, same settings -> same model).

Text inputs, one document each (in the order given):
    ``*.jsonl`` / ``*.json``   one JSON object per line, the text under ``--text-key``
    anything else            one document per blank-line-separated paragraph
``--chat``: each JSONL line is a conversation (``{"messages": [...]}`` or
``{"prompt", "completion"}``, see ``mpcore.data.chat``), rendered with the folder's chat
template; the loss mask marks the assistant turns. Writes ``<prefix>.bin`` / ``.idx``,
``.meta.json`` (which tokenizer, by content) and, for chat, ``.mask``; streaming, with a
progress bar on stderr; nothing is left half-written on an error.

``--show PREFIX``: the first ``--limit`` documents as JSON lines in score.py's input schema
(``{"input_ids": [...], "loss_mask": [...]}``); with ``--text`` instead
``{"text": ...}`` with the trained spans between ``[[`` and ``]]`` (decoded with the
tokenizer recorded in ``.meta.json``). ``PREFIX`` may be a prepared VL dataset folder
(launch/prepare_vl_data.py): its samples with their ``pixel_values`` / ``image_grid_thw`` and
``pixel_values_videos`` / ``video_grid_thw`` (``mpcore.data.vl_show``), lines score.py reads as
they are. Also runs as ``python -m mpcore.launch.prepare_data``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mpcore.data.chat import prepare_chat
from mpcore.data.corpus import tokenize_to_indexed
from mpcore.data.hf_encode import HFTokenizer, prepare_text
from mpcore.data.indexed import IndexedDataset
from mpcore.data.tokenizer import Tokenizer, iter_documents, train_tokenizer
from mpcore.data.vl_show import is_vl_folder, show_vl
from mpcore.io_errors import writing
from mpcore.progress import ProgressBar


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", type=Path, help="text/JSONL files")
    parser.add_argument("--output-prefix", type=Path, help="writes PREFIX.bin/.idx")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--tokenizer", type=Path,
                        help="a checkpoint folder with tokenizer.json, or a SentencePiece .model")
    source.add_argument("--train-tokenizer", type=Path, help="train a model and write it here")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of --train-tokenizer")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--seed", type=int, default=1234, help="tokenizer training seed")
    parser.add_argument("--chat", action="store_true",
                        help="inputs are conversations (messages, or prompt + completion)")
    parser.add_argument("--seq-len", type=int, help="--chat: refuse longer conversations here")
    parser.add_argument("--chat-split-rewritten", action="store_true",
                        help="--chat: a conversation whose template rewrites earlier turns "
                             "(Qwen3 <think>) becomes one document per assistant turn")
    parser.add_argument("--show", type=Path, metavar="PREFIX",
                        help="print prepared documents (a text prefix or a VL folder)")
    parser.add_argument("--limit", type=int, default=5, help="--show: how many documents")
    parser.add_argument("--text", action="store_true", help="--show: decoded, spans marked")
    args = parser.parse_args(argv)
    if args.show:
        if args.input or args.output_prefix:
            parser.error("--show reads a prepared dataset; drop --input / --output-prefix")
        return args
    if not args.input or not args.output_prefix:
        parser.error("--input and --output-prefix are required (or --show PREFIX)")
    if not args.tokenizer and not args.train_tokenizer:
        parser.error("one of --tokenizer or --train-tokenizer is required")
    if args.train_tokenizer and args.vocab_size is None:
        parser.error("--train-tokenizer needs --vocab-size N (for example 32000)")
    if args.tokenizer and args.vocab_size is not None:
        parser.error("--vocab-size only applies to --train-tokenizer; drop it")
    if args.chat and (args.train_tokenizer or is_sentencepiece(args.tokenizer)):
        parser.error("--chat needs a tokenizer folder with a chat template (--tokenizer "
                     "CKPT_FOLDER)")
    if args.seq_len is not None and not args.chat:
        parser.error("--seq-len applies to --chat (text documents are cut into samples)")
    return args


def is_sentencepiece(path: Path | None) -> bool:
    """A ``.model`` file is SentencePiece; anything else names a tokenizer folder."""
    return path is not None and path.suffix == ".model"


def show(prefix: Path, limit: int, text: bool, out=None) -> int:
    """Print the first ``limit`` documents of ``prefix`` (module docstring) to ``out`` (None:
    the current ``sys.stdout``); returns how many."""
    out = out or sys.stdout
    if is_vl_folder(prefix):
        return show_vl(prefix, limit, text, out)
    ds = IndexedDataset(prefix)
    tok = None
    if text:
        folder = (ds.meta or {}).get("tokenizer", {}).get("folder")
        if not folder:
            raise ValueError(f"{prefix}.meta.json does not name a tokenizer folder (a "
                             f"SentencePiece dataset); --show without --text prints its ids")
        tok = HFTokenizer(folder)
    count = min(limit, len(ds))
    for d in range(count):
        ids = [int(i) for i in ds[d]]
        mask = ds.mask(d)
        mask = [1] * len(ids) if mask is None else [int(m) for m in mask]
        if tok is None:
            out.write(json.dumps({"input_ids": ids, "loss_mask": mask}) + "\n")
            continue
        parts, k = [], 0
        while k < len(ids):  # runs of equal mask, trained runs between [[ and ]]
            j = k
            while j < len(ids) and mask[j] == mask[k]:
                j += 1
            piece = tok.decode(ids[k:j])
            parts.append(f"[[{piece}]]" if mask[k] else piece)
            k = j
        out.write(json.dumps({"text": "".join(parts)}, ensure_ascii=False) + "\n")
    return count


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.show:
            show(args.show, args.limit, args.text)
            return 0
        if args.train_tokenizer:
            size = sum(p.stat().st_size for p in args.input if p.is_file())
            bar = ProgressBar(f"reading text for {args.train_tokenizer}", size, "MB")
            docs = bar.wrap(iter_documents(args.input, args.text_key), lambda d: len(d.encode()) + 1)
            names = ", ".join(map(str, args.input))
            tok = train_tokenizer(docs, args.train_tokenizer, args.vocab_size, args.seed,
                                  source=f"the input {names}")
            print(f"trained tokenizer {args.train_tokenizer}", file=sys.stderr)
        elif is_sentencepiece(args.tokenizer):
            tok = Tokenizer(args.tokenizer)
        else:
            tok = HFTokenizer(args.tokenizer)
        with writing(args.output_prefix, "--output-prefix"):  # read-only, full: one line
            if args.chat:
                num_docs = prepare_chat(tok, args.input, args.output_prefix, args.seq_len,
                                        split_rewritten=args.chat_split_rewritten)
            elif isinstance(tok, HFTokenizer):
                num_docs = prepare_text(tok, args.input, args.output_prefix, args.text_key)
            else:
                num_docs = tokenize_to_indexed(tok, args.input, args.output_prefix,
                                               args.text_key)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output_prefix}.bin/.idx: {num_docs} documents, vocab {tok.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
