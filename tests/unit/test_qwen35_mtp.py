"""Qwen3.5 multi-token prediction in one process (fp32, CPU): the definition, the loss path,
the main loss left alone, the release's ``mtp.*`` read and written back, and bad input.

The checkpoint is a transformers tiny ``Qwen3_5ForCausalLM`` with the release's ``mtp.*``
tensors added (``tests.dist.qwen35_mtp_tiny``); the reference is the MTP definition in plain
float64 torch ops from the same tensors, one document at a time.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from mpcore.models.common.hf_io import gather_full
from mpcore.models.common.hybrid.config import Qwen35Config
from mpcore.models.common.hybrid.hf import export_hf, full_map, load_hf
from mpcore.models.common.hybrid.mtp import MtpOutput, local_inputs
from mpcore.parallel.state import ParallelState
from tests.dist.qwen35_mtp_tiny import make_checkpoint, reference
from tests.dist.qwen35_tiny import make_hf_model, packed_docs

LENGTHS = [5, 1, 30, 2, 3, 13]  # documents of 1 and 2 tokens have no MTP target
WEIGHT = 0.3


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mtp") / "ckpt"
    make_checkpoint(folder)
    ids, cu = packed_docs(LENGTHS, seed=4)
    return folder, ids, cu, reference(folder, ids, cu, WEIGHT)


def _run(model, state, ids, cu, output="loss", loss_mask=None):
    _, inputs = local_inputs(state, ids, cu, model.cfg, loss_mask=loss_mask)
    return inputs, model(**inputs, output=output)


def _rel(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


def test_one_process_equals_the_float64_definition(release):
    folder, ids, cu, ref = release
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    assert cfg.mtp_num_hidden_layers == 1 and model.mtp is not None
    inputs, out = _run(model, state, ids, cu)
    assert isinstance(out, MtpOutput)
    n, n_mtp = int((inputs["labels"] != -100).sum()), int((inputs["mtp_labels"] != -100).sum())
    assert (n, n_mtp) == (ref["count"], ref["mtp_count"])
    main, mtp = out.main.sum() / n, out.mtp.sum() / n_mtp
    assert abs(float(main.detach()) - ref["main"]) <= 1e-5
    assert abs(float(mtp.detach()) - ref["mtp"]) <= 1e-5
    (main + WEIGHT * mtp).backward()
    grads = gather_full({k: p.grad for k, p in model.named_parameters()},
                        [full_map(cfg, 1, 0)], None)
    assert set(grads) == set(ref["grads"])
    worst = {k: _rel(g, ref["grads"][k]) for k, g in grads.items()}
    assert max(worst.values()) <= 1e-4, sorted(worst.items(), key=lambda kv: -kv[1])[:3]
    assert all(float(ref["grads"][k].norm()) > 0 for k in grads if k.startswith("mtp."))
    with torch.no_grad():
        (lp, _), (mtp_lp, _) = _run(model, state, ids, cu, output="logprobs")[1]
    assert float((mtp_lp.double() - ref["mtp_logprobs"]).abs().max()) <= 1e-5
    with torch.no_grad():
        sums = _run(model, state, ids, cu, output="loss_sum")[1]
    assert torch.allclose(sums.mtp, out.mtp.sum(), rtol=1e-6)
    assert torch.allclose(sums.main, out.main.sum(), rtol=1e-6)


def test_main_loss_unchanged_by_the_mtp_weight(release):
    folder, ids, cu, _ = release
    state = ParallelState()
    plain, cfg = load_hf(folder, state, gdn_kernel="reference")
    assert plain.mtp is None and not cfg.uses_mtp  # weight 0: the block is not built
    inputs, base = _run(plain, state, ids, cu)
    assert "mtp_input_ids" not in inputs and isinstance(base, torch.Tensor)
    for weight in (0.1, 2.0):
        model, _ = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=weight)
        assert torch.equal(_run(model, state, ids, cu)[1].main, base)


def test_mtp_targets_follow_the_loss_mask(release):
    folder, ids, cu, _ = release
    state = ParallelState()
    model, _ = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    mask = torch.rand(ids.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    inputs, _ = _run(model, state, ids, cu, loss_mask=mask)
    keep = inputs["mtp_labels"] != -100
    where = torch.nonzero(keep)[:, 0]
    assert keep.any() and bool(mask[where + 2].all())  # target t+2 is a masked-in token
    assert torch.equal(inputs["mtp_input_ids"][where], ids[where + 1])


def test_release_round_trips_tensor_equal(release, tmp_path):
    folder = release[0]
    state = ParallelState()
    model, _ = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
    export_hf(model, state, tmp_path / "out")
    original = load_file(folder / "model.safetensors")
    exported = load_file(tmp_path / "out" / "model.safetensors")
    assert set(exported) == set(original) and any(k.startswith("mtp.") for k in exported)
    for name, t in original.items():
        assert torch.equal(exported[name], t), name
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["mtp_num_hidden_layers"] == 1


def test_without_mtp_weights_trains_as_today_and_bad_input_is_refused(tmp_path):
    folder = tmp_path / "plain"
    make_hf_model(seed=2).save_pretrained(folder)
    state = ParallelState()
    model, cfg = load_hf(folder, state, gdn_kernel="reference")
    assert model.mtp is None and cfg.mtp_num_hidden_layers == 0
    with pytest.raises(ValueError, match="needs an MTP layer but this model has none"):
        load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=0.5)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mtp_num_hidden_layers": 1}))
    with pytest.raises(ValueError, match="the weights hold no mtp.. tensors"):
        load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=0.5)
    base = dict(vocab_size=11, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=2,
                intermediate_size=8)
    with pytest.raises(ValueError, match="mtp_loss_weight must be a finite number >= 0"):
        Qwen35Config(**base, mtp_num_hidden_layers=1, mtp_loss_weight=-0.1)
    for bad in (float("nan"), float("inf"), -1e-9):
        with pytest.raises(ValueError, match="mtp_loss_weight must be a finite number >= 0"):
            Qwen35Config(**base, mtp_num_hidden_layers=1, mtp_loss_weight=bad)
    assert not Qwen35Config(**base, mtp_num_hidden_layers=2).uses_mtp  # loads at weight 0
    with pytest.raises(ValueError, match="trains one MTP layer .* mtp_num_hidden_layers=2"):
        Qwen35Config(**base, mtp_num_hidden_layers=2, mtp_loss_weight=0.5)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers must be an integer >= 0"):
        Qwen35Config(**base, mtp_num_hidden_layers=-1)
    ids, cu = packed_docs([4, 5], seed=1)
    _, inputs = local_inputs(state, ids, cu, cfg)
    inputs["mtp_input_ids"] = inputs["input_ids"]
    with pytest.raises(ValueError, match="has no MTP block"):
        model(**inputs, output="loss")


def test_score_mtp_gives_the_mtp_heads_logprobs(release, tmp_path):
    from mpcore.launch.score import main

    folder, ids, cu, ref = release
    lines = [ids[a:b].tolist() for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"input_ids": x}) + "\n"
                                               for x in lines))
    args = ["--hf-checkpoint", str(folder), "--input", str(tmp_path / "in.jsonl")]
    assert main([*args, "--mtp", "--output", str(tmp_path / "mtp.jsonl")]) == 0
    assert main([*args, "--output", str(tmp_path / "main.jsonl")]) == 0
    mtp = [json.loads(x) for x in (tmp_path / "mtp.jsonl").read_text().splitlines()]
    plain = [json.loads(x) for x in (tmp_path / "main.jsonl").read_text().splitlines()]
    bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True))
    for (a, b), got, other in zip(bounds, mtp, plain, strict=True):
        assert len(got["logprobs"]) == len(other["logprobs"]) == b - a - 1
        want = ref["mtp_logprobs"][a:b - 1].tolist()  # 0 at t = len - 2: no target there
        assert max((abs(x - y) for x, y in zip(got["logprobs"], want, strict=True)),
                   default=0.0) <= 1e-5
    assert mtp != plain
    plain_folder = tmp_path / "plain"
    make_hf_model(seed=2).save_pretrained(plain_folder)
    assert main(["--hf-checkpoint", str(plain_folder), "--input", str(tmp_path / "in.jsonl"),
                 "--mtp", "--output", str(tmp_path / "bad.jsonl")]) == 2


def test_families_without_mtp_refuse_the_weight_with_the_fix():
    from mpcore.build import resolve_model_config
    from mpcore.config import load_config

    for family in ("llama", "qwen3_vl", "qwen3_moe"):  # no such key in their sections
        with pytest.raises(ValueError, match="model.mtp_loss_weight is set but the"):
            load_config(None, [f"model.family={family}", "model.mtp_loss_weight=0.5"])
    with pytest.raises(ValueError, match="needs an MTP layer but this model has none"):
        resolve_model_config(load_config(None, ["model.family=qwen3_5_moe",
                                                "model.mtp_loss_weight=0.5"]))
    with pytest.raises(ValueError, match="needs an MTP layer but this model has none"):
        resolve_model_config(load_config(None, ["model.family=qwen3_5",
                                                "model.mtp_loss_weight=0.5"]))


def test_text_decoder_of_a_vl_release_reads_its_mtp(tmp_path):
    """The released checkpoints are Qwen3_5ForConditionalGeneration: mtp.* sits at the top
    level beside model.language_model.*; the text loader reads both (a library call)."""
    from safetensors.torch import save_file

    from tests.dist.qwen35_mtp_tiny import HEADS, mtp_shapes
    from tests.dist.qwen35_tiny import HF_CONFIG, conditional_generation

    folder = tmp_path / "vl"
    conditional_generation({**HF_CONFIG, **HEADS}, "Qwen3_5").save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["text_config"]["mtp_num_hidden_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config))
    tensors = load_file(folder / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    mtp = {k: torch.randn(s, generator=gen) for k, s in mtp_shapes({**HF_CONFIG, **HEADS}).items()}
    save_file({**tensors, **mtp}, folder / "model.safetensors", metadata={"format": "pt"})
    model, cfg = load_hf(folder, ParallelState(), gdn_kernel="reference", mtp_loss_weight=0.2)
    full = gather_full(dict(model.named_parameters()), [full_map(cfg, 1, 0)], None)
    assert {k for k in full if k.startswith("mtp.")} == set(mtp)
    for name, t in mtp.items():
        assert torch.equal(full[name], t), name


def test_training_path_loss_sum_gives_the_same_gradients(release):
    """``output="loss_sum"`` (the fused head's in-forward gradients, what training runs) and
    ``output="loss"`` give the same gradients of ``main / N + w * mtp / N_mtp``."""
    folder, ids, cu, _ = release
    state = ParallelState()
    grads = []
    for output in ("loss", "loss_sum"):
        model, _ = load_hf(folder, state, gdn_kernel="reference", mtp_loss_weight=WEIGHT)
        inputs, out = _run(model, state, ids, cu, output=output)
        n, n_mtp = int((inputs["labels"] != -100).sum()), int((inputs["mtp_labels"] != -100).sum())
        (out.main.sum() / n + WEIGHT * out.mtp.sum() / n_mtp).backward()
        grads.append({k: p.grad for k, p in model.named_parameters()})
    worst = max(_rel(grads[1][k], g) for k, g in grads[0].items())
    assert worst <= 1e-5, worst
