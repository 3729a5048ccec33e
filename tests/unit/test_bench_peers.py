"""tests/perf/bench_peers.py on the CPU: its pieces, and (slow) a smoke run of its rows.

The pieces need no peer installed: the shape check's parameter count against transformers'
LlamaForCausalLM of the same shape, the shared token data (bench_train's draws, shifted labels,
the checksum), argument errors, the table's ratios. The smoke run needs the peers' wheels on
the path (megatron-core, torchtitan, torchao; see tests/perf/NOTES.md) and is skipped without
them: tiny config, seq 64 x 2, 2 timed steps after 1 warmup, CUDA hidden. There torchtitan and
our bf16 row train, Megatron builds its model and reports itself skipped (CUDA only), and our
TE row fails for lack of TE (recorded, the run goes on).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpcore.config import load_config
from tests.perf import bench_peers
from tests.perf.bench_train import RandomTokens

REPO = Path(__file__).resolve().parents[2]

CONFIG = REPO / "launch" / "configs" / "tiny.yaml"


@pytest.mark.parametrize("tied", [True, False])
def test_expected_params_matches_transformers(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    m = dataclasses.replace(load_config(CONFIG).model, tie_embeddings=tied)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size, tie_word_embeddings=tied))
    assert bench_peers.expected_params(m) == hf.num_parameters()


def test_expected_params_llama32_1b():
    # Llama-3.2-1B's published size: 1.24B parameters (tied embeddings).
    m = load_config(bench_peers.CONFIG).model
    assert round(bench_peers.expected_params(m) / 1e9, 2) == 1.24


def test_batches_are_bench_train_draws_shifted():
    vocab, seq, micro_batch = 100, 16, 3
    data = bench_peers.Batches(vocab, seq, micro_batch, torch.device("cpu"))
    reference = RandomTokens(vocab, seq, micro_batch, 1, seed=0)
    for _ in range(2):
        ids, labels, mask = data.next()
        expected = reference.tokens()
        assert torch.equal(ids, expected)
        assert torch.equal(labels[:, :-1], expected[:, 1:])  # next token, within each sample
        assert torch.equal(mask[:, :-1], torch.ones(micro_batch, seq - 1))
        assert torch.equal(mask[:, -1], torch.zeros(micro_batch))  # no target after the last
        assert int(labels.min()) >= 0  # a valid id where masked, for peers that index with it
    again = bench_peers.Batches(vocab, seq, micro_batch, torch.device("cpu"))
    again.next()
    again.next()
    assert again.crc == data.crc
    other = bench_peers.Batches(vocab + 1, seq, micro_batch, torch.device("cpu"))
    other.next()
    other.next()
    assert other.crc != data.crc


@pytest.mark.parametrize("argv, message", [
    (["--rows", "megatron_bf16,nemo"], "--rows: unknown ['nemo']"),
    (["--shapes", "4096"], "--shapes"),
    (["--shapes", "4096x4,abc"], "--shapes"),
    (["--shapes", "0x4"], "--shapes"),
])
def test_bad_arguments_name_the_fix(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_peers.parse_args(argv)
    assert message in capsys.readouterr().err


def test_parse_args_defaults():
    args = bench_peers.parse_args([])
    assert args.shape_list == [(4096, 4), (16384, 1)]
    assert args.row_list == list(bench_peers.ROWS)
    assert (args.steps, args.warmup) == (20, 5)


def _row(name, tokens_per_s, **extra):
    return {"row": name, "seq": 8, "micro_batch": 2, "step_ms": 16e3 / tokens_per_s,
            "tokens_per_s_per_gpu": tokens_per_s, "peak_gib": None, "first_loss": 2.0,
            "last_loss": 1.5, **extra}


def test_table_ratios_and_failed_rows():
    rows = [_row("megatron_bf16", 1000.0), _row("torchtitan_bf16", 500.0),
            {"row": "megatron_fp8", "seq": 8, "micro_batch": 2, "error": "exit 1: boom\nmore"},
            _row("mpcore_bf16", 1500.0)]
    text = bench_peers.table(rows)
    assert "mpcore_bf16 vs: megatron_bf16 1.50x, torchtitan_bf16 3.00x" in text
    assert "megatron_fp8       failed: exit 1: boom" in text
    rows[0]["peak_gib"], rows[3]["peak_gib"] = 40.0, 30.0  # the CUDA case: a peak per row
    assert "mpcore_bf16 vs: megatron_bf16 1.50x (memory 0.75x), torchtitan_bf16 3.00x\n" in \
        bench_peers.table(rows) + "\n"


def _peers_installed() -> bool:
    return all(importlib.util.find_spec(name) is not None
               for name in ("megatron", "torchtitan", "torchao"))


needs_torchtitan = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None or importlib.util.find_spec("torchao") is None,
    reason="needs the torchtitan and torchao wheels on the path (tests/perf/NOTES.md)")


@needs_torchtitan
def test_torchtitan_shims_apply_where_torch_lacks_the_name(monkeypatch):
    import torch.distributed.fsdp as fsdp
    import torch.nn.attention.flex_attention as flex

    bench_peers.torchtitan_shims()  # whatever this torch needs, so torchtitan imports
    import torchtitan.models.common.decoder as decoder

    seen = {}

    def old_create_block_mask(mask_mod, B, H, Q_LEN, KV_LEN, device="cpu", BLOCK_SIZE=128):
        """torch 2.11's signature: no separate_full_blocks."""

    def make_mask(*args, **kwargs):
        seen.update(kwargs)
        return "mask"

    if hasattr(fsdp, "DataParallelMeshDims"):
        monkeypatch.delattr(fsdp, "DataParallelMeshDims")
    monkeypatch.setattr(flex, "create_block_mask", old_create_block_mask)
    monkeypatch.setattr(decoder, "create_attention_mask", make_mask)
    monkeypatch.delitem(sys.modules, "datasets", raising=False)
    monkeypatch.delitem(sys.modules, "datasets.distributed", raising=False)
    applied = bench_peers.torchtitan_shims()
    assert "torch.distributed.fsdp.DataParallelMeshDims placeholder" in applied
    assert fsdp.DataParallelMeshDims(shard=("fsdp",)).shard == ("fsdp",)
    assert "create_attention_mask without separate_full_blocks=" in applied
    assert decoder.create_attention_mask(1, separate_full_blocks=True, BLOCK_SIZE=128) == "mask"
    assert seen == {"BLOCK_SIZE": 128}  # the flag dropped, the rest passed on
    import datasets.distributed  # noqa: F401  (the stand-in, or the real one where installed)


@pytest.mark.slow
@needs_torchtitan
def test_torchtitan_flex_mask_is_causal_per_sample():
    """The flex BlockMask the torchtitan rows build from positions 0..S-1 per sample computes
    the same function as plain causal SDPA (torch's, same weights), so the peer is timed on
    the attention we run, no cheaper mask."""
    bench_peers.torchtitan_shims()
    m = load_config(CONFIG).model
    flex_config, _ = bench_peers._torchtitan_model_config(m, float8=False, cuda=True)
    sdpa_config, _ = bench_peers._torchtitan_model_config(m, float8=False, cuda=False)
    torch.manual_seed(0)
    flex, sdpa = flex_config.build(), sdpa_config.build()
    with torch.no_grad():
        flex.init_weights(buffer_device=None)
    sdpa.load_state_dict(flex.state_dict())
    ids = torch.randint(0, m.vocab_size, (2, 64))
    positions = torch.arange(64).expand(2, -1)
    with torch.no_grad():
        out = flex(ids, positions, flex.get_attention_masks(positions=positions))
        ref = sdpa(ids, positions, None)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@needs_torchtitan
def test_torchtitan_row_model_and_loss_match_transformers():
    """The torchtitan rows' model at the tiny shape (weights through torchtitan's own HF
    adapter) gives transformers' LlamaForCausalLM logits, and their loss on ``Batches`` gives
    transformers' loss with labels=ids (its own shift): same function, same targets."""
    from transformers import LlamaConfig, LlamaForCausalLM

    bench_peers.torchtitan_shims()
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.models.llama3 import Llama3StateDictAdapter

    m = load_config(CONFIG).model
    config, _ = bench_peers._torchtitan_model_config(m, float8=False, cuda=False)
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    hf = LlamaForCausalLM(LlamaConfig(
        vocab_size=m.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        intermediate_size=m.intermediate_size, tie_word_embeddings=True,
        rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps, attn_implementation="eager"))
    hf_state = Llama3StateDictAdapter(config, None).to_hf(model.state_dict())
    result = hf.load_state_dict(hf_state, strict=False)
    assert not result.unexpected_keys and result.missing_keys == ["lm_head.weight"]  # tied
    ids, labels, mask = bench_peers.Batches(m.vocab_size, 64, 2, torch.device("cpu")).next()
    positions = torch.arange(64).expand(2, -1)
    loss_fn = CrossEntropyLoss.Config(global_vocab_size=m.vocab_size).build(compile_config=None)
    with torch.no_grad():
        logits = model(ids, positions, None)
        ref = hf(input_ids=ids, labels=ids)
        loss = bench_peers.torchtitan_loss(loss_fn, logits, labels, mask)
    torch.testing.assert_close(logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref.loss, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
@pytest.mark.skipif(not _peers_installed(), reason="needs the megatron-core, torchtitan and "
                    "torchao wheels on the path (tests/perf/NOTES.md)")
def test_smoke_rows_on_cpu(tmp_path):
    rows = "megatron_bf16,torchtitan_bf16,torchtitan_float8,mpcore_bf16,mpcore_te_fp8"
    cmd = [sys.executable, "-m", "tests.perf.bench_peers", "--config", str(CONFIG), "--shapes",
           "64x2", "--steps", "2", "--warmup", "1", "--rows", rows, "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["row"] for r in summary] == rows.split(",")
    by_name = {r["row"]: r for r in summary}
    for name, r in by_name.items():
        assert r == json.loads((tmp_path / f"{name}_64x2.json").read_text())
        assert (r["device"], r["seq"], r["micro_batch"], r["steps"]) == ("cpu", 64, 2, 2)
        assert r["versions"]["torch"] == torch.__version__
        assert r["row_wall_s"] > 0 and r["matmul_bf16_tflops_before"] is None  # no GPU to check
    trained = [by_name[n] for n in ("torchtitan_bf16", "torchtitan_float8", "mpcore_bf16")]
    for r in trained:
        assert r["tokens_per_s_per_gpu"] == pytest.approx(64 * 2 / (r["step_ms"] / 1e3))
        assert r["peak_gib"] is None
        assert math.isfinite(r["first_loss"]) and math.isfinite(r["last_loss"])
    for r in trained[:2]:  # its tied init starts high (the input token's own logit): it falls
        assert r["last_loss"] < r["first_loss"] - 0.1
    assert len({r["tokens_crc32"] for r in trained}) == 1  # the same tokens for every row
    m = load_config(CONFIG).model
    assert by_name["torchtitan_bf16"]["settings"]["num_params"] == bench_peers.expected_params(m)
    megatron = by_name["megatron_bf16"]
    assert "skipped" in megatron and megatron["settings"]["num_params"] == \
        bench_peers.expected_params(m)
    assert "error" in by_name["mpcore_te_fp8"]  # no TE on the CPU: recorded, not fatal
    assert "mpcore_bf16 vs: torchtitan_bf16" in proc.stdout


def test_bench_train_variant_options():
    """Our rows' ``--variants`` items (bench_train): options combine with ``+``; a typo, a zero
    or a second chunk budget, or two optimizers in one item are refused, not ignored."""
    from tests.perf import bench_train

    (v,) = bench_train.parse_args(["--variants", "te:te_delayed:bf16_residual+adamw_triton"]
                                  ).variant_list
    assert (v.linear_backend, v.fp8, v.residual_dtype, v.optimizer_backend, v.chunk_mib) == (
        "te", "te_delayed", "autocast", "triton", None)
    (v,) = bench_train.parse_args(["--variants", "native:none:lce256+bf16_wgrad"]).variant_list
    assert (v.chunk_mib, v.bf16_wgrad, v.optimizer_backend) == (256, True, None)
    for bad in ("native:none:xyz12", "native:none:lce0", "native:none:lce00",
                "native:none:lce1+lce2", "native:none:adamw_torch+adamw_triton",
                "native:none:adamw_fused", "native:bf16:"):
        with pytest.raises(SystemExit):
            bench_train.parse_args(["--variants", bad])
