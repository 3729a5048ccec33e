"""Tokenize text / JSONL files into an indexed binary dataset, training a tokenizer if asked.

    python launch/prepare_data.py --input a.jsonl [b.txt ...] --output-prefix data/corpus \\
        (--tokenizer existing.model | --train-tokenizer out.model --vocab-size N) [--text-key text]

Inputs, one document each (in the order given):
    ``*.jsonl`` / ``*.json``   one JSON object per line, the text under ``--text-key``
    anything else            one document per blank-line-separated paragraph
Writes ``<prefix>.bin`` and ``<prefix>.idx`` (streaming, with a progress bar on stderr). With
``--train-tokenizer`` a SentencePiece model is first trained on the same inputs
(deterministic: same files, same order, same settings -> same model). Also runs as
``python -m mpcore.launch.prepare_data``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mpcore.data.corpus import tokenize_to_indexed
from mpcore.data.tokenizer import Tokenizer, iter_documents, train_tokenizer
from mpcore.io_errors import writing
from mpcore.progress import ProgressBar


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--input", nargs="+", type=Path, required=True, help="text/JSONL files")
    parser.add_argument("--output-prefix", type=Path, required=True, help="writes PREFIX.bin/.idx")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--tokenizer", type=Path, help="an existing SentencePiece .model")
    source.add_argument("--train-tokenizer", type=Path, help="train a model and write it here")
    parser.add_argument("--vocab-size", type=int, help="vocabulary of --train-tokenizer")
    parser.add_argument("--text-key", default="text", help="JSONL field holding the text")
    parser.add_argument("--seed", type=int, default=1234, help="tokenizer training seed")
    args = parser.parse_args(argv)
    if args.train_tokenizer and args.vocab_size is None:
        parser.error("--train-tokenizer needs --vocab-size N (for example 32000)")
    if args.tokenizer and args.vocab_size is not None:
        parser.error("--vocab-size only applies to --train-tokenizer; drop it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.train_tokenizer:
            size = sum(p.stat().st_size for p in args.input if p.is_file())
            bar = ProgressBar(f"reading text for {args.train_tokenizer}", size, "MB")
            docs = bar.wrap(iter_documents(args.input, args.text_key), lambda d: len(d.encode()) + 1)
            names = ", ".join(map(str, args.input))
            tok = train_tokenizer(docs, args.train_tokenizer, args.vocab_size, args.seed,
                                  source=f"the input {names}")
            print(f"trained tokenizer {args.train_tokenizer}", file=sys.stderr)
        else:
            tok = Tokenizer(args.tokenizer)
        with writing(args.output_prefix, "--output-prefix"):  # read-only, full: one line
            num_docs = tokenize_to_indexed(tok, args.input, args.output_prefix, args.text_key)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.output_prefix}.bin/.idx: {num_docs} documents, vocab {tok.vocab_size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
