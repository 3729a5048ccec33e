"""Tiny released-format tokenizer folders, made offline with the ``tokenizers`` library.

``make_chatml(folder)``: byte-level BPE (Qwen2/Qwen3-style pre-tokenizer), specials
``<|endoftext|>`` (pad and document separator), ``<|im_start|>``, ``<|im_end|>`` (eos), a
ChatML chat template with system, user, assistant and tool turns (Qwen2.5's layout).
``make_llama(folder)``: a SentencePiece-style BPE (Metaspace-like normaliser, byte fallback)
with ``<s>`` (bos, added in front by the post-processor) and ``</s>`` (eos), and a Llama-2
style ``[INST]`` template. Both write ``tokenizer.json`` and ``tokenizer_config.json`` as a
release does; the vocabularies are trained on a few hundred lines, deterministically.
``make_release(folder)``: the ChatML folder that is also a tiny Qwen3 checkpoint (random
weights, transformers). ``CHAT`` / ``ROWS``: chat lines (system, user, assistant, tool;
multi-turn; prompt + completion); ``write_jsonl(path, rows)``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.trainers import BpeTrainer

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "def add(a, b):\n    return a + b\n",
    "Numbers 12345 and 67890, unicode: caf\u00e9, na\u00efve, \u4f60\u597d\u4e16\u754c.",
    "Tool calls return JSON like {\"temperature\": 21.5, \"unit\": \"C\"}.",
    "You are a helpful assistant. What is the weather in Paris today?",
] * 40

CHATML_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}"
    "{%- set system = '<<SYS>>\\n' + messages[0].content + '\\n<</SYS>>\\n\\n' %}"
    "{%- set messages = messages[1:] %}"
    "{%- else %}{%- set system = '' %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}"
    "{{- bos_token + '[INST] ' + (system if loop.first else '') + message.content + ' [/INST]' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- ' ' + message.content + ' ' + eos_token }}"
    "{%- else %}{{- raise_exception('unknown role ' + message.role) }}"
    "{%- endif %}"
    "{%- endfor %}"
)


def _added(content: str, i: int) -> dict:
    return {"content": content, "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False, "special": True}


def make_chatml(folder: str | Path, vocab_size: int = 400, template: str = CHATML_TEMPLATE,
                corpus: list[str] = CORPUS) -> Path:
    """A Qwen-style tokenizer folder trained on ``corpus``; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"
            r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    config = {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "add_prefix_space": False,
        "errors": "replace", "model_max_length": 32768, "split_special_tokens": False,
        "clean_up_tokenization_spaces": False, "chat_template": template,
        "added_tokens_decoder": {str(i): _added(s, i) for s, i in ids.items()},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


def make_llama(folder: str | Path, vocab_size: int = 400) -> Path:
    """A Llama-style (SentencePiece BPE as tokenizer.json) folder; returns it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                           normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    trainer = BpeTrainer(vocab_size=vocab_size, special_tokens=specials + byte_pieces,
                         show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    tok.save(str(folder / "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in specials}
    config = {
        "tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": None, "add_bos_token": True, "add_eos_token": False,
        "legacy": False, "model_max_length": 4096, "clean_up_tokenization_spaces": False,
        "chat_template": LLAMA_TEMPLATE,
        "added_tokens_decoder": {str(i): _added(s, i) for s, i in ids.items()},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


CHAT = [
    {"messages": [{"role": "system", "content": "You are a helpful assistant."},
                  {"role": "user", "content": "What is the weather in Paris?"},
                  {"role": "assistant", "content": "Let me check the weather."},
                  {"role": "tool", "content": "{\"temperature\": 21.5}"},
                  {"role": "assistant", "content": "It is 21.5 C in Paris today."},
                  {"role": "user", "content": "Thanks!"},
                  {"role": "assistant", "content": "You are welcome."}]},
    {"prompt": "def add(a, b):", "completion": "    return a + b"},
    {"messages": [{"role": "user", "content": "caf\u00e9 na\u00efve \u4f60\u597d"},
                  {"role": "assistant", "content": "\u4e16\u754c 12345"}]},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


ROWS = [CHAT[1], CHAT[2], CHAT[0], CHAT[1], CHAT[2], CHAT[2], CHAT[1], CHAT[0]]


def make_release(folder, vocab_size: int = 400, tie: bool = True):
    """A ChatML tokenizer folder that is also a tiny Qwen3 checkpoint (``tie``: its head tied
    to the embedding)."""
    import transformers  # here: the gloo ranks import this module and need not load it

    make_chatml(folder, vocab_size)
    config = transformers.Qwen3Config(
        vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=48, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, max_position_embeddings=256, initializer_range=0.3)
    torch.manual_seed(3)
    model = transformers.Qwen3ForCausalLM(config).eval()
    model.save_pretrained(folder)
    return folder
