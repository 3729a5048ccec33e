"""Every registered family, driven by the registry: HF round trip, score.py vs transformers,
every layout vs one process, in float32 and bfloat16 (gloo, CPU).

Parametrised over ``mpcore.models.registry.FAMILIES``; each family's tiny transformers
checkpoint is declared in tests/families.py (``TINY``), and a registered family without one
fails here. Per family, on a checkpoint written once per module (fresh random weights):
  - round trip: transformers' checkpoint -> ``family.load_hf`` -> ``family.export_hf`` gives
    the same tensor names and values (cast to the load dtype: equal, not close), a config.json
    that reads back to the same config and family (and meta.json's form too), and transformers loads the export with no
    missing, unexpected or mismatched weight and the original's logits, bit for bit;
  - score.py: ``mpcore.launch.score.main`` (the function torchrun runs) on one packed input
    file of documents of odd lengths (one of a single token) and, for an image-text family,
    a line with an image: at one process and at tp x cp layouts, each document's log-probs
    and entropy vs transformers run on that document alone (float32);
  - the fast default runs one cheap layout (tp 1 x cp 2 ring, 2 ranks); the slow set runs
    tp 2 x cp 2 ring and Ulysses (4 ranks): tp and both cp modes at once, for CI's time
    (tp 2 alone and cp 2 Ulysses alone cost ~35 s more over the ten families; the per-family
    tests/dist/test_*_dist.py run the whole matrix, with gradients, in float32).
score.py's ``main`` runs in the harness's ranks, not under a torchrun subprocess (~10-20 s of
process start per launch on CI's 2 cores, x 10 families x 2 dtypes); the command itself under
torchrun is tests/dist/test_models_dist.py's and test_score_vl.py's.
Bounds: float32, layout vs one process <= 1e-5 and vs transformers <= 1e-4 (the numerics
policy). bfloat16 (weights and compute, ``--dtype bfloat16``) vs the float32 reference: max
<= 0.5 and mean <= 0.03 over every log-prob and entropy. bfloat16 keeps 8 significant bits
(2^-9 relative per rounding); through 2-4 layers of O(1) activations and logits of a few units
that moves log-probs by ~5e-3 on average and a few 1e-2 at worst (measured: mean 3e-3 to
1.1e-2, max 0.02-0.08 on the dense families). A MoE router whose top-k margin is below that
noise picks another expert at a token, a jump of up to ~0.4 there (transformers' own bfloat16
run of the tiny qwen3_5_vl_moe is 0.44 from its float32 run; ours 0.37, mean 0.019), hence
the max bound is loose and the mean bound tight. A dtype bug (a float32 row into a bfloat16
matmul, a scale lost) fails outright or moves the mean by O(1). bfloat16 layout vs bfloat16
one process: the same bounds (another reduction order rounds by the same steps); the
bfloat16 run must also differ from the float32 one (it ran in bfloat16 at all).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load_file

from mpcore.launch.score import main as score_main
from mpcore.models import read_hf_config
from mpcore.models.registry import FAMILIES, family_of_hf
from mpcore.parallel.state import ParallelState
from tests.dist.harness import run_distributed
from tests.families import PATCH_DIM, TINY

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
LENGTHS = [7, 13, 1, 10, 5]
FAST = [("1", "2", "ring")]  # (tp, cp, cp_mode) on 2 ranks
SLOW = [("2", "2", "ring"), ("2", "2", "ulysses")]  # on 4 ranks: tp and cp together
FP32_LAYOUT_TOL, FP32_HF_TOL, BF16_MAX, BF16_MEAN = 1e-5, 1e-4, 0.5, 0.03


def test_every_registered_family_declares_a_tiny_checkpoint():
    missing = sorted(set(FAMILIES) - set(TINY))
    assert not missing, (f"families {missing} are registered but have no tiny checkpoint: add "
                         "an entry to TINY in tests/families.py")
    assert not set(TINY) - set(FAMILIES), "tests/families.py declares an unregistered family"


def _lines(name: str, seed: int) -> list[dict]:
    tiny = TINY[name]
    gen = torch.Generator().manual_seed(seed)
    lines = [{"input_ids": torch.randint(0, tiny.text_ids, (n,), generator=gen).tolist()}
             for n in LENGTHS]
    if tiny.image is not None:
        start, image, end = tiny.image
        pixels = torch.randn(24, PATCH_DIM, generator=gen)  # grid 1 x 4 x 6: 6 placeholders
        lines.insert(1, {"input_ids": [5, 6, start] + [image] * 6 + [end, 9, 10, 11],
                         "pixel_values": pixels.tolist(), "image_grid_thw": [[1, 4, 6]]})
    return lines


def _hf_model(name: str, folder: Path, dtype: torch.dtype = torch.float32):
    import transformers

    tiny = TINY[name]
    return getattr(transformers, tiny.auto).from_pretrained(
        folder, dtype=dtype, **tiny.load_options).eval()


def _logits(name: str, model, line: dict) -> torch.Tensor:
    """transformers' logits ``[n, V]`` of one score.py input line (its image, if any)."""
    ids = torch.tensor(line["input_ids"])
    kwargs = {}
    if "pixel_values" in line:
        kwargs = dict(pixel_values=torch.tensor(line["pixel_values"], dtype=model.dtype),
                      image_grid_thw=torch.tensor(line["image_grid_thw"]))
        if "mm_token_type_ids" in inspect.signature(model.forward).parameters:
            kwargs["mm_token_type_ids"] = (ids == TINY[name].image[1]).long()[None]
    with torch.no_grad():
        return model(input_ids=ids[None], **kwargs).logits[0]


def _reference(name: str, folder: Path, lines: list[dict]) -> list[tuple]:
    """transformers (float32), one line at a time: ``(logprobs, entropy)`` per line, float64,
    length len - 1 (0 log-prob where the target is an image placeholder)."""
    model, image = _hf_model(name, folder), TINY[name].image
    out = []
    for line in lines:
        ids = torch.tensor(line["input_ids"])
        logp = F.log_softmax(_logits(name, model, line).double(), -1)
        lp = logp[:-1].gather(1, ids[1:, None])[:, 0]
        if image is not None:
            lp = torch.where(ids[1:] == image[1], 0.0, lp)
        out.append((lp, -(logp.exp() * logp).sum(-1)[:-1]))
    return out


@pytest.fixture(scope="module", params=list(FAMILIES))
def case(request, tmp_path_factory):
    """``(name, folder)``: the family's tiny checkpoint in ``folder/ckpt``, its score.py input
    ``folder/in.jsonl``, the transformers reference and the one-process outputs per dtype."""
    name = request.param
    if name not in TINY:
        pytest.fail(f"family {name!r} has no tiny checkpoint: add it to TINY in tests/families.py")
    folder = tmp_path_factory.mktemp(name)
    TINY[name].save(folder / "ckpt", 0)
    lines = _lines(name, 1)
    (folder / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    single = {}
    for dtype in DTYPES:
        with contextlib.redirect_stdout(io.StringIO()):
            assert score_main(_args(folder, "1", "1", "ring", dtype, folder / f"one-{dtype}.jsonl")) == 0
        single[dtype] = _read(folder / f"one-{dtype}.jsonl")
    return name, folder, lines, _reference(name, folder / "ckpt", lines), single


def _args(folder: Path, tp: str, cp: str, mode: str, dtype: str, out: Path) -> list[str]:
    return ["--hf-checkpoint", str(folder / "ckpt"), "--tp", tp, "--cp", cp, "--cp-mode", mode,
            "--dtype", dtype, "--input", str(folder / "in.jsonl"), "--output", str(out)]


def _read(path: Path) -> list[tuple]:
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    return [(torch.tensor(r["logprobs"], dtype=torch.float64),
             torch.tensor(r["entropy"], dtype=torch.float64)) for r in rows]


def _diffs(got: list[tuple], want: list[tuple]) -> tuple[float, float]:
    """``(max, mean)`` absolute difference over every log-prob and entropy of every line."""
    assert len(got) == len(want)
    parts = []
    for (lp, ent), (lp_want, ent_want) in zip(got, want, strict=True):
        assert lp.shape == lp_want.shape and ent.shape == ent_want.shape
        parts += [(lp - lp_want).abs(), (ent - ent_want).abs()]
    diff = torch.cat(parts)
    return float(diff.max()), float(diff.mean())


def _close(got: list[tuple], want: list[tuple], dtype: str) -> bool:
    worst, mean = _diffs(got, want)
    if dtype == "bfloat16":
        return worst <= BF16_MAX and mean <= BF16_MEAN
    return worst <= FP32_HF_TOL


def _check(case, got: dict, label: str) -> None:
    """Outputs ``got[dtype]`` of one layout against one process and transformers."""
    _, _, _, ref, single = case
    assert _close(single["float32"], ref, "float32"), _diffs(single["float32"], ref)
    assert _close(single["bfloat16"], ref, "bfloat16"), _diffs(single["bfloat16"], ref)
    assert _diffs(single["bfloat16"], single["float32"])[0] > 0, "bf16 ran in float32"
    if "float32" in got:
        assert _diffs(got["float32"], single["float32"])[0] <= FP32_LAYOUT_TOL, label
        assert _close(got["float32"], ref, "float32"), (label, _diffs(got["float32"], ref))
    if "bfloat16" in got:
        assert _close(got["bfloat16"], single["bfloat16"], "bfloat16"), (
            label, _diffs(got["bfloat16"], single["bfloat16"]))
        assert _close(got["bfloat16"], ref, "bfloat16"), (label, _diffs(got["bfloat16"], ref))


def _main_per_run(rank, world, folder, runs):
    """score.py's ``main`` for each ``(tp, cp, mode, dtype)`` of ``runs``; main destroys the
    process group when it ends (as under torchrun), so each later run joins a fresh one."""
    for i, (tp, cp, mode, dtype) in enumerate(runs):
        if not dist.is_initialized():
            store = dist.FileStore(f"{folder}/store-{world}-{i}", world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        out = Path(folder) / f"out-{world}-{tp}-{cp}-{mode}-{dtype}.jsonl"
        with contextlib.redirect_stdout(io.StringIO()):
            assert score_main(_args(Path(folder), tp, cp, mode, dtype, out)) == 0, runs[i]


def _run_layouts(case, layouts, world: int) -> None:
    folder = case[1]
    runs = [(*layout, dtype) for layout in layouts for dtype in DTYPES]
    run_distributed(_main_per_run, world, str(folder), runs, timeout=600)
    for tp, cp, mode in layouts:
        got = {dtype: _read(folder / f"out-{world}-{tp}-{cp}-{mode}-{dtype}.jsonl")
               for dtype in DTYPES}
        _check(case, got, f"tp={tp} cp={cp} {mode}")


def test_score_at_one_layout(case):
    _run_layouts(case, FAST, 2)


@pytest.mark.slow
def test_score_at_every_layout(case):
    _run_layouts(case, SLOW, 4)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(folder.glob("*.safetensors")):
        out.update(load_file(shard))
    return out


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_hf_round_trip(case, dtype, tmp_path):
    """transformers' checkpoint -> ours (at ``dtype``) -> export: the same tensors, the same
    config read back, the same family; transformers loads the export with every weight and
    computes what it computes from the original (bit for bit, on the image line if any)."""
    import transformers

    name, folder, lines = case[0], case[1], case[2]
    family, tiny, state, out = FAMILIES[name], TINY[name], ParallelState(), tmp_path / "out"
    model, cfg = family.load_hf(folder / "ckpt", state, device="cpu", dtype=DTYPES[dtype])
    family.export_hf(model, state, out)
    src, got = _tensors(folder / "ckpt"), _tensors(out)
    assert sorted(got) == sorted(src)
    for key, value in src.items():
        assert got[key].dtype == DTYPES[dtype], (key, got[key].dtype)
        assert torch.equal(got[key], value.to(DTYPES[dtype])), key
    assert family_of_hf(out) is family and family.config_from_hf(read_hf_config(out)) == cfg
    assert family.config_from_dict(dataclasses.asdict(cfg)) == cfg  # a checkpoint's meta.json
    hf, info = getattr(transformers, tiny.auto).from_pretrained(
        out, dtype=DTYPES[dtype], output_loading_info=True, **tiny.load_options)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    line = lines[1] if tiny.image is not None else lines[0]
    want = _logits(name, _hf_model(name, folder / "ckpt", DTYPES[dtype]), line)
    assert torch.equal(_logits(name, hf.eval(), line), want)
