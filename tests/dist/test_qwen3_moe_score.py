"""launch/score.py --ep 2 on a Qwen3-MoE checkpoint under torchrun (2 processes: dp = 2, ep = 2).

dp ranks score different sequences while their ep group splits the experts: three sequences
(rank 0 scores two, rank 1 one: different token counts in the all-to-alls) and then one
sequence (rank 1 has nothing to score and still joins every all-to-all, or rank 0 would hang)
match transformers per document within 1e-4. Bad degrees (ep not dividing dp x cp, or the experts) stop before any compute with the
fix named.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.dist.hf_moe_tiny import packed_docs, reference, save_hf_model

REPO = Path(__file__).resolve().parents[2]


def _score(folder, tmp_path, seqs, *extra) -> tuple[int, str]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": s}) + "\n"
                                               for s in seqs))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--standalone", str(REPO / "launch" / "score.py"), "--hf-checkpoint", str(folder),
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"),
           *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        proc.communicate()
        raise
    return proc.returncode, stderr


@pytest.mark.slow
def test_score_ep2_matches_transformers_also_with_an_idle_rank(tmp_path):
    folder = tmp_path / "hf"
    save_hf_model(0, folder)
    ids, cu = packed_docs([9, 14, 6], 4)
    ref = reference(folder, ids, cu, grads=False)["logprobs"]
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    for chosen in ([0, 1, 2], [1]):
        rc, stderr = _score(folder, tmp_path, [ids[a:b].tolist() for a, b in
                                               (bounds[i] for i in chosen)], "--ep", "2")
        assert rc == 0, stderr[-4000:]
        out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
        assert len(out) == len(chosen)
        for row, i in zip(out, chosen, strict=True):
            a, b = bounds[i]
            got = torch.tensor(row["logprobs"]).double()
            assert float((got - ref[a:b - 1]).abs().max()) <= 1e-4, i


@pytest.mark.slow
def test_score_bad_ep_exits_2_naming_the_fix(tmp_path):
    folder = tmp_path / "hf"
    save_hf_model(0, folder)
    rc, stderr = _score(folder, tmp_path, [[1, 2, 3]], "--ep", "3")
    # score.py exits 2; torchrun reports a failed child as 1. One rank prints the error (the
    # one elected first, named when it is not rank 0), once.
    once = re.findall(r"error(?: \(rank \d+\))?: ep = 3 must be a positive integer dividing "
                      r"dp\*cp", stderr)
    assert rc != 0 and len(once) == 1, stderr[-3000:]
    save_hf_model(0, tmp_path / "hf3", num_experts=3)
    rc, stderr = _score(tmp_path / "hf3", tmp_path, [[1, 2, 3]], "--ep", "2")
    assert rc != 0 and len(re.findall(r"error(?: \(rank \d+\))?: --ep 2 does not fit",
                                      stderr)) == 1, stderr[-3000:]
    assert "num_experts 3 is not divisible by ep 2" in stderr, stderr[-3000:]
    assert not (tmp_path / "out.jsonl").exists()
