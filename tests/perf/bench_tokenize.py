"""CPU benchmark: preparing text with a released tokenizer folder against the ``tokenizers``
library's own batch encoding of the same file.

    python -m tests.perf.bench_tokenize [OUT.json] [--mb 24] [--runs 3]

The file: the shipped default corpus (``launch/data/default_corpus.jsonl``) repeated to about
``--mb`` MB. The tokenizer: a byte-level BPE (Qwen-style pre-tokenizer, vocab 8192) trained on
the corpus with the ``tokenizers`` library and saved as a release folder
(``tests/unit/release_tokenizers.py``'s layout). Rows, each the median of ``--runs`` timed runs
(alternating, after one warm-up), MB/s over the file's bytes:
    library encode_batch_fast   the documents already in memory, batches of the same size
                                (``hf_encode.CHUNK_BYTES``) as ours; reading not timed; the
                                same Rust tokenizer object as ours (``AutoTokenizer``'s
                                ``backend_tokenizer``, which may add what its class adds, e.g.
                                Qwen2's NFC normaliser)
    library encode_batch        the same with offsets (what most callers use)
    ..., raw tokenizer.json     ``Tokenizer.from_file`` on the folder's file (for scale)
    mpcore prepare_text         end to end: read the JSONL, encode (transformers' Rust
                                tokenizer), write .bin/.idx/.meta.json
``ratio`` = ours / encode_batch_fast (target >= 0.8). Writes JSON (default
tests/perf/results/tokenize_cpu.json) with the machine's core count and load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tokenizers import Tokenizer

from mpcore.data import hf_encode
from mpcore.data.corpus import DEFAULT_CORPUS
from mpcore.data.tokenizer import iter_documents
from tests.unit.release_tokenizers import make_chatml

REPO = Path(__file__).resolve().parents[2]


def make_file(folder: Path, mb: float) -> Path:
    data = DEFAULT_CORPUS.read_bytes()
    path = folder / "corpus.jsonl"
    with open(path, "wb") as f:
        for _ in range(max(1, round(mb * 1e6 / len(data)))):
            f.write(data)
    return path


def library_rate(tok: Tokenizer, path: Path, fast: bool) -> float:
    batches = [b for b, _ in hf_encode._chunks(iter_documents([path]), hf_encode.CHUNK_BYTES)]
    encode = tok.encode_batch_fast if fast else tok.encode_batch
    start = time.perf_counter()
    for batch in batches:
        encode(batch)
    return path.stat().st_size / 1e6 / (time.perf_counter() - start)


def ours_rate(tok: hf_encode.HFTokenizer, path: Path, out: Path) -> float:
    start = time.perf_counter()
    hf_encode.prepare_text(tok, [path], out, progress=False)
    return path.stat().st_size / 1e6 / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", nargs="?", type=Path,
                        default=REPO / "tests" / "perf" / "results" / "tokenize_cpu.json")
    parser.add_argument("--mb", type=float, default=24.0)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = [json.loads(line)["text"] for line in DEFAULT_CORPUS.open()]
        folder = make_chatml(tmp / "release", vocab_size=8192, corpus=corpus)
        path = make_file(tmp, args.mb)
        tok = hf_encode.HFTokenizer(folder)
        ours_rate(tok, path, tmp / "warm")  # warm-up: page cache, thread pool
        raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
        rows = {"library encode_batch_fast": [], "library encode_batch": [],
                "library encode_batch_fast, raw tokenizer.json": [], "mpcore prepare_text": []}
        for _ in range(args.runs):
            rows["library encode_batch_fast"].append(library_rate(tok.backend, path, True))
            rows["mpcore prepare_text"].append(ours_rate(tok, path, tmp / "out"))
            rows["library encode_batch"].append(library_rate(tok.backend, path, False))
            rows["library encode_batch_fast, raw tokenizer.json"].append(
                library_rate(raw, path, True))
        medians = {k: statistics.median(v) for k, v in rows.items()}
        result = {
            "file_mb": path.stat().st_size / 1e6, "runs": args.runs, "cpu_count": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], "chunk_bytes": hf_encode.CHUNK_BYTES,
            "mb_per_s": medians, "all_runs_mb_per_s": rows,
            "ratio_vs_encode_batch_fast": medians["mpcore prepare_text"]
            / medians["library encode_batch_fast"],
            "ratio_vs_encode_batch": medians["mpcore prepare_text"]
            / medians["library encode_batch"],
        }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for name, rate in medians.items():
        print(f"{name:28s} {rate:8.2f} MB/s")
    print(f"ratio (ours / encode_batch_fast): {result['ratio_vs_encode_batch_fast']:.2f}; "
          f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
