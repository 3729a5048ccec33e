"""launch/score.py on a vision-language checkpoint, under torchrun with 4 processes (gloo, CPU).

The checkpoint is a tiny random ``Qwen2VLForConditionalGeneration`` (tests/dist/hf_vl_tiny.py,
``save_pretrained``) with a ``preprocessor_config.json`` that keeps images small (patch 2,
at most 24x24 pixels). The input file mixes the three line forms: text only (one of a single
token), ``pixel_values`` + ``image_grid_thw`` (two images: one shipped photo, one random), and
``images`` paths (relative and absolute, one line with a loss mask, a grey-level PNG). Layouts:
tp=2 x cp=2 ring under torchrun (the command a user types); cp=4 ring, cp=4 ulysses (4 query
heads, 2 kv heads replicated up to cp) and cp=2 ulysses through the same ``main`` on 4 gloo
ranks of one harness launch (a torchrun launch per layout cost ~9 s of process start-up each).
Reference: transformers in float32, one sequence at a time, with pixel values from ITS processor
(``Qwen2VLImageProcessorPil``), so our processor, expansion, packing, M-RoPE positions, cp split
and gathers are all checked: log-probs (0 where the target is a placeholder or masked) and
entropy within 1e-4 (DESIGN.md's mpcore vs transformers bound), expanded ids exactly.
Single-process tests: the clear errors for images on a text-only checkpoint and for the wrong
loader.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.dist.harness import run_distributed
from tests.dist.hf_tiny import save_hf_model
from tests.dist.hf_vl_tiny import END, IMAGE, PATCH_DIM, START, save_hf_vl_model

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "launch" / "data" / "images"
PROCESSOR = dict(min_pixels=8 * 8, max_pixels=24 * 24, patch_size=2, temporal_patch_size=2,
                 merge_size=2)
TORCHRUN = ("2", "2", "ring")
IN_PROCESS = [("1", "4", "ring"), ("1", "4", "ulysses"), ("1", "2", "ulysses")]


def text(gen, n: int) -> list[int]:
    return torch.randint(0, IMAGE, (n,), generator=gen).tolist()


def hf_pixels(paths):
    """transformers' processor output for image files: ``(pixel_values, grid [I, 3])``."""
    from PIL import Image
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    processor = Qwen2VLImageProcessorPil(**PROCESSOR)
    images = [Image.open(p) for p in paths]
    out = processor(images=images, return_tensors="pt")
    return out["pixel_values"].float(), out["image_grid_thw"]


def expand(ids: list[int], grid) -> list[int]:
    """Each single IMAGE id -> its image's run (grid rows in order)."""
    runs = iter(int(g.prod()) // 4 for g in grid)
    return [t for i in ids for t in ([IMAGE] * next(runs) if i == IMAGE else [i])]


def make_case(folder: Path):
    """Write the checkpoint and the input file; return ``(rows, references)`` where each
    reference is ``(expanded ids, pixel_values, grid, loss_mask)`` for transformers."""
    save_hf_vl_model("qwen2_vl", 3, folder / "vl")
    (folder / "vl" / "preprocessor_config.json").write_text(json.dumps(PROCESSOR))
    (folder / "pics").mkdir()
    shutil.copy(IMAGES / "astronaut.jpg", folder / "pics" / "astronaut.jpg")
    gen = torch.Generator().manual_seed(7)
    rows, refs = [], []

    def add(row, ids, pixels=None, grid=None, mask=None):
        rows.append(row)
        refs.append((ids, pixels, grid, mask))

    one = [*text(gen, 3), START, IMAGE, END, *text(gen, 4)]
    px, grid = hf_pixels([IMAGES / "astronaut.jpg"])
    add({"input_ids": one, "images": ["pics/astronaut.jpg"]}, expand(one, grid), px, grid)
    seq = text(gen, 9)
    add({"input_ids": seq}, seq)
    photo, photo_grid = hf_pixels([IMAGES / "chelsea.jpg"])
    noise_grid = torch.tensor([[1, 4, 6]])
    px = torch.cat([photo, torch.randn(24, PATCH_DIM, generator=gen)])
    grid = torch.cat([photo_grid, noise_grid])
    two = [*text(gen, 2), START, IMAGE, END, *text(gen, 3), START, IMAGE, END, *text(gen, 2)]
    two = expand(two, grid)
    add({"input_ids": two, "pixel_values": px.tolist(), "image_grid_thw": grid.tolist()},
        two, px, grid)
    seq = text(gen, 1)
    add({"input_ids": seq}, seq)
    paths = [IMAGES / "camera.png", folder / "pics" / "astronaut.jpg"]
    px, grid = hf_pixels(paths)
    masked = [START, IMAGE, END, *text(gen, 5), START, IMAGE, END, *text(gen, 3)]
    mask = [1] * len(masked)
    mask[4] = 0  # the second text token after the first image
    full = expand(masked, grid)
    full_mask = [1] * len(full)
    full_mask[full.index(END) + 2] = 0  # the same text token as mask[4]
    add({"input_ids": masked, "loss_mask": mask, "images": [str(paths[0]), "pics/astronaut.jpg"]},
        full, px, grid, full_mask)
    seq = text(gen, 13)
    add({"input_ids": seq}, seq)
    (folder / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows, refs


def reference(folder: Path, refs):
    """transformers float32, per sequence: ``[(logprobs [n-1], entropy [n-1])]``."""
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(
        folder, dtype=torch.float32).eval()
    takes_types = "mm_token_type_ids" in inspect.signature(model.forward).parameters
    out = []
    with torch.no_grad():
        for ids, px, grid, mask in refs:
            ids = torch.tensor(ids)
            kwargs = {}
            if grid is not None:
                kwargs = dict(pixel_values=px, image_grid_thw=grid)
                if takes_types:
                    kwargs["mm_token_type_ids"] = (ids == IMAGE).long()[None]
            logp = F.log_softmax(model(input_ids=ids[None], **kwargs).logits[0].double(), -1)
            entropy = -(logp.exp() * logp).sum(-1)[:-1]
            target = logp[:-1].gather(1, ids[1:, None])[:, 0]
            keep = ids[1:] != IMAGE
            if mask is not None:
                keep &= torch.tensor(mask[1:], dtype=torch.bool)
            out.append((torch.where(keep, target, 0.0), entropy))
    return out


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    folder = tmp_path_factory.mktemp("score_vl")
    rows, refs = make_case(folder)
    return folder, rows, refs, reference(folder / "vl", refs)


def run_score(folder: Path, tp: str, cp: str, mode: str, out: Path) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--standalone", str(REPO / "launch" / "score.py"),
           *_score_args(folder, tp, cp, mode, out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the ranks it started
        proc.communicate()
        raise
    assert proc.returncode == 0, stderr[-4000:]
    return stdout


def _score_args(folder: Path, tp: str, cp: str, mode: str, out: Path) -> list[str]:
    return ["--hf-checkpoint", str(folder / "vl"), "--tp", tp, "--cp", cp, "--cp-mode", mode,
            "--input", str(folder / "in.jsonl"), "--output", str(out)]


def _main_per_layout(rank, world, folder, out_dir):
    """``mpcore.launch.score.main`` at each layout of IN_PROCESS; rank 0's stdout per layout. main
    destroys the process group when it ends (as under torchrun), so each later layout joins
    a fresh one."""
    from mpcore.launch.score import main

    printed = []
    for i, layout in enumerate(IN_PROCESS):
        if not dist.is_initialized():
            store = dist.FileStore(f"{out_dir}/store-{i}", world)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            code = main(_score_args(folder, *layout, out_dir / f"out-{i}.jsonl"))
        assert code == 0, (layout, code)
        printed.append(buffer.getvalue())
    return printed


def check_output(stdout: str, out: Path, tp: str, cp: str, mode: str, rows, refs, want):
    assert (f"scored {len(rows)} sequences" in stdout and "5 images" in stdout
            and f"tp={tp} cp={cp} ({mode})" in stdout), stdout
    got_rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(got_rows) == len(rows)
    for row, (ids, _, _, _), (lp, ent), got in zip(rows, refs, want, got_rows, strict=True):
        assert ("input_ids" in got) == ("images" in row)
        if "images" in row:
            assert got["input_ids"] == ids  # the expansion matches transformers' grids
        assert len(got["logprobs"]) == len(ids) - 1 == len(got["entropy"])
        if len(ids) < 2:
            continue
        got_lp = torch.tensor(got["logprobs"]).double()
        assert bool((got_lp[lp == 0] == 0).all())  # placeholders and masked targets
        assert float((got_lp - lp).abs().max()) <= 1e-4
        assert float((torch.tensor(got["entropy"]).double() - ent).abs().max()) <= 1e-4


@pytest.mark.slow
def test_score_vl_under_torchrun(case, tmp_path):
    folder, rows, refs, want = case
    stdout = run_score(folder, *TORCHRUN, tmp_path / "out.jsonl")
    check_output(stdout, tmp_path / "out.jsonl", *TORCHRUN, rows, refs, want)


def test_score_vl_main_at_other_layouts(case, tmp_path):
    folder, rows, refs, want = case
    printed = run_distributed(_main_per_layout, 4, folder, tmp_path, timeout=300)[0]
    for i, layout in enumerate(IN_PROCESS):
        check_output(printed[i], tmp_path / f"out-{i}.jsonl", *layout, rows, refs, want)


def test_images_on_a_text_only_checkpoint_fail_before_loading(tmp_path, capsys):
    from mpcore.launch.score import main

    save_hf_model("qwen3", 0, tmp_path / "q3")
    (tmp_path / "in.jsonl").write_text(json.dumps({"input_ids": [1, 2]}) + "\n" + json.dumps(
        {"input_ids": [1, 50], "images": ["x.png"]}) + "\n")
    code = main(["--hf-checkpoint", str(tmp_path / "q3"), "--input", str(tmp_path / "in.jsonl"),
                 "--output", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and "in.jsonl:2: the line has ['images'], but" in err
    assert "(Qwen3ForCausalLM) is a text-only decoder and cannot take images" in err
    assert not (tmp_path / "out.jsonl").exists()
    code = main(["--hf-checkpoint", str(tmp_path / "q3"), "--input", str(tmp_path / "no.jsonl"),
                 "--output", str(tmp_path / "out.jsonl")])
    assert code == 2 and "--input" in capsys.readouterr().err


def test_the_wrong_loader_says_which_to_use(case):
    from mpcore.models.llama.hf import load_hf_model
    from mpcore.models.qwen2_vl.hf import load_hf_vl_model
    from mpcore.parallel.state import ParallelState

    folder = case[0]
    state = ParallelState.build(1, 1)
    with pytest.raises(ValueError, match="Qwen2VLForConditionalGeneration"):
        load_hf_model(folder / "vl", state)
    save_hf_model("qwen2", 0, folder / "q2")
    with pytest.raises(ValueError, match="decoder-only checkpoints load with "
                                         "mpcore.models.load_hf_model"):
        load_hf_vl_model(folder / "q2", state)
