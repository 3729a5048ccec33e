"""TransformerEngine delayed-scaling state in checkpoints (``mpcore.train_state``, keys
``fp8/rank<R>/<layer>/<entry>``), on the CPU: TE runs only on the GPU (there
``tests/gpu/test_te_gpu.py`` resumes a real te_delayed run), so the layers here carry a
stand-in for TE's module with TE's ``fp8_meta`` layout (``scaling_fwd`` / ``scaling_bwd`` with
``scale`` and ``amax_history``)."""

from __future__ import annotations

import contextlib
import logging
from types import SimpleNamespace

import pytest
import torch

from mpcore.build import build, resolve_device, setup
from mpcore.checkpoint import save_checkpoint
from mpcore.parallel.te import FP8_STATE_KEYS, TEGemm, fp8_state_layers, merge_fp8_states
from tests.unit.test_checkpoint_safety import data_dir, tiny  # noqa: F401 (fixture)


class _FakeTEModule:
    """TE's module as far as the scaling state goes: ``fp8_meta`` filled by
    ``init_fp8_metadata`` (TE's first FP8 forward), 1024 x 3 forward and 1024 x 2 backward
    amax histories."""

    def __init__(self):
        self.fp8_meta = {}

    def init_fp8_metadata(self, num_gemms: int = 1) -> None:
        for way, n in (("fwd", 3 * num_gemms), ("bwd", 2 * num_gemms)):
            self.fp8_meta[f"scaling_{way}"] = SimpleNamespace(
                scale=torch.ones(n), amax_history=torch.zeros(1024, n))


def _fake_gemm() -> TEGemm:
    gemm = object.__new__(TEGemm)
    gemm.fp8, gemm.recipe, gemm.module = "te_delayed", None, _FakeTEModule()
    gemm.te = SimpleNamespace(autocast=lambda **kw: contextlib.nullcontext())
    return gemm


def _run(tmp_path, data_dir, name):  # noqa: F811
    cfg = tiny(tmp_path / name, data_dir, "checkpoint.every=0")
    run = build(cfg, setup(cfg), resolve_device(cfg))
    linears = [m for n, m in run.model.named_modules() if hasattr(m, "gemm")][:3]
    for m in linears:
        m.gemm = _fake_gemm()
    run.train_state.fp8_layers = fp8_state_layers(run.model)
    return cfg, run


def _fill(gemm, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    gemm.module.init_fp8_metadata()
    for way in ("fwd", "bwd"):
        meta = gemm.module.fp8_meta[f"scaling_{way}"]
        meta.scale.copy_(torch.rand(meta.scale.shape, generator=gen) * 100)
        meta.amax_history.copy_(torch.rand(meta.amax_history.shape, generator=gen))


def _state(gemm) -> dict[str, torch.Tensor]:
    meta = gemm.module.fp8_meta
    return {f"{k}_{w}": getattr(meta[f"scaling_{w}"], k).clone()
            for w in ("fwd", "bwd") for k in ("scale", "amax_history")}


def test_fp8_state_round_trips_and_merges_when_the_layout_changes(tmp_path, data_dir,  # noqa: F811
                                                                  caplog):
    cfg, saver = _run(tmp_path, data_dir, "a")
    layers = saver.train_state.fp8_layers
    assert len(layers) == 3
    for i, gemm in enumerate(layers.values()):
        _fill(gemm, i)
    tensors = saver.train_state.collect()
    assert {k for k in tensors if k.startswith("fp8/")} == {
        f"fp8/rank0/{layer}/{key}" for layer in layers for key in FP8_STATE_KEYS}
    # A second "rank" of an earlier, wider layout: another state for every layer.
    other = {}
    for i, layer in enumerate(layers):
        gemm = _fake_gemm()
        _fill(gemm, 100 + i)
        other[layer] = _state(gemm)
        tensors.update({f"fp8/rank1/{layer}/{k}": v for k, v in other[layer].items()})
    folder = save_checkpoint(cfg.checkpoint_dir, 1, tensors, {"step": 1}, keep_last=2, rank=0)

    _, same = _run(tmp_path, data_dir, "b")  # not yet run: the state is allocated on load
    assert all(not g.module.fp8_meta for g in same.train_state.fp8_layers.values())
    with caplog.at_level(logging.INFO, logger="mpcore.train_state"):
        same.train_state.restore(folder, same_layout=True)
    assert "restored FP8 scaling state of 3 layers, as saved" in caplog.text
    for layer, gemm in same.train_state.fp8_layers.items():
        for key, value in _state(gemm).items():
            assert torch.equal(value, _state(layers[layer])[key]), (layer, key)

    _, moved = _run(tmp_path, data_dir, "c")
    moved.train_state.restore(folder, same_layout=False)
    for layer, gemm in moved.train_state.fp8_layers.items():
        mine, theirs, got = _state(layers[layer]), other[layer], _state(gemm)
        for key in FP8_STATE_KEYS:
            pick = torch.minimum if key.startswith("scale") else torch.maximum
            assert torch.equal(got[key], pick(mine[key], theirs[key])), (layer, key)
        assert not torch.equal(got["amax_history_fwd"], mine["amax_history_fwd"])


def test_a_checkpoint_without_fp8_state_is_noted_and_a_mismatched_history_refused(
        tmp_path, data_dir, caplog):  # noqa: F811
    cfg, plain = _run(tmp_path, data_dir, "plain")
    plain.train_state.fp8_layers = {}  # a bf16 run: no fp8/ keys
    folder = save_checkpoint(cfg.checkpoint_dir, 1, plain.train_state.collect(), {"step": 1},
                             keep_last=2, rank=0)
    _, fp8 = _run(tmp_path, data_dir, "fp8")
    with caplog.at_level(logging.INFO, logger="mpcore.train_state"):
        fp8.train_state.restore(folder, same_layout=True)
    assert "the checkpoint has no FP8 scaling state" in caplog.text
    assert all(not g.module.fp8_meta for g in fp8.train_state.fp8_layers.values())

    for gemm in fp8.train_state.fp8_layers.values():
        _fill(gemm, 7)
    with_fp8 = save_checkpoint(cfg.checkpoint_dir, 2, fp8.train_state.collect(), {"step": 2},
                               keep_last=2, rank=0)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mpcore.train_state"):
        plain.train_state.restore(with_fp8, same_layout=True)  # back to bf16
    assert "holds TransformerEngine FP8 (te_delayed) scaling state; this run does not use it" in (
        caplog.text)

    states = [{k: torch.rand(4, 3) for k in FP8_STATE_KEYS} for _ in range(2)]
    merged = merge_fp8_states(states)
    assert torch.equal(merged["amax_history_fwd"],
                       torch.maximum(states[0]["amax_history_fwd"], states[1]["amax_history_fwd"]))
    gemm = _fake_gemm()
    from mpcore.parallel.te import load_fp8_state

    with pytest.raises(ValueError, match=r"FP8 state scale_fwd: the checkpoint holds \(4, 3\), "
                                         r"this run's recipe \(3,\)"):
        load_fp8_state(gemm, merged)
