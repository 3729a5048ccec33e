"""Tiny Qwen3.5 checkpoints of every family at the released DeltaNet head size (128), and
transformers' per-document scores of a packed stream on them, with or without fla.

Why a process of its own: transformers 5.x picks fla's ``chunk_gated_delta_rule`` at import
time whenever fla imports, for any device and dtype, so its float64 CPU reference and its
float32 PyTorch path exist only in a process where fla does not import. ``without_fla_env()``
is that process's environment (the folder fla imports from taken off PYTHONPATH); ``main``
runs a list of jobs there:
    python -m tests.gpu.qwen35_hf_scores JOBS.pt
each job ``dict(folder, kind, stream, device, dtype, out)`` writes ``(logprobs, entropy)``
float64 ``[T]`` to ``out`` (position t scores token t+1; 0 at each document's last token and
where the target is an image or video placeholder).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from mpcore.launch.score import score_stream
from mpcore.models import family_of_hf, read_hf_config
from mpcore.parallel.state import ParallelState
from tests.dist.hf_qwen3_vl_tiny import IMAGE, TOKENS, VIDEO, doc_inputs, stream
from tests.dist.hf_qwen35_vl_tiny import TEXT, TOWER
from tests.dist.qwen35_moe_tiny import CONFIG as MOE_TEXT
from tests.dist.qwen35_moe_tiny import MOE_KEYS, sharpen_router_
from tests.dist.qwen35_tiny import HF_CONFIG, VOCAB, packed_docs, randomize_
from tests.families import hf_classes

TEXT_LENGTHS = [1, 2, 3, 77, 1000, 2999]  # 1, 2, 3, odd, long: as the reported gap's stream
VISION = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw")
FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_5_vl", "qwen3_5_vl_moe")


def config_kwargs(family: str, head_dim: int = 128, max_positions: int = 4096) -> dict:
    """``family``'s tiny config with DeltaNet heads of ``head_dim`` (key and value) and
    ``max_positions``, as its transformers config class (``tests.families.hf_classes``) takes it; with
    ``architectures`` added, the config.json our family's ``config_from_hf`` reads."""
    heads = dict(linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
                 max_position_embeddings=max_positions)
    if family == "qwen3_5":
        return {**HF_CONFIG, **heads}
    if family == "qwen3_5_moe":
        return {**MOE_TEXT, **heads}
    text = {**TEXT, **heads}
    if family == "qwen3_5_vl_moe":
        text = {k: v for k, v in text.items() if k != "intermediate_size"} | {
            k: MOE_TEXT[k] for k in MOE_KEYS}
    return dict(text_config=text, vision_config=dict(TOWER), tie_word_embeddings=False, **TOKENS)


def make_checkpoint(family: str, folder: Path, seed: int = 0, head_dim: int = 128,
                    lengths: list[int] = TEXT_LENGTHS) -> tuple[str, dict]:
    """Save ``family``'s tiny transformers model with DeltaNet heads of ``head_dim`` (key and
    value) in ``folder``; returns ``(kind, stream)``: ``"text"`` with documents of ``lengths``,
    or ``"vl"`` with ``hf_qwen3_vl_tiny.stream``'s images, video and text-only documents."""
    config_cls, model_cls = hf_classes(family)
    # the shared tiny configs allow 512 positions; the documents here reach 2999 tokens
    config = config_cls(**config_kwargs(family, head_dim, max(4096, max(lengths))))
    model = randomize_(model_cls(config).eval(), seed)
    if "moe" in family:
        sharpen_router_(model)
    model.save_pretrained(folder)
    if family in ("qwen3_5", "qwen3_5_moe"):
        ids, cu = packed_docs(lengths, seed=seed + 1)
        return "text", dict(input_ids=ids, cu_seqlens=cu)
    return "vl", stream(seed + 1)


def hf_scores(folder, kind: str, s: dict, device: str, dtype: torch.dtype):
    """transformers' ``(logprobs [T], entropy [T])`` float64 of stream ``s``, one document at a
    time, in ``dtype`` on ``device`` (the MoE experts eager in float64: transformers' grouped
    GEMM takes no float64)."""
    import transformers

    moe = "num_experts" in (Path(folder) / "config.json").read_text()
    options = {"experts_implementation": "eager"} if moe and dtype == torch.float64 else {}
    auto = (transformers.AutoModelForCausalLM if kind == "text"
            else transformers.AutoModelForImageTextToText)
    model = auto.from_pretrained(folder, dtype=dtype, **options).to(device).eval()
    total = s["input_ids"].numel()
    logprobs = torch.zeros(total, dtype=torch.float64)
    entropy = torch.zeros(total, dtype=torch.float64)
    cu = s["cu_seqlens"].tolist()
    with torch.no_grad():
        for d in range(len(cu) - 1):
            if kind == "text":
                a, b = cu[d], cu[d + 1]
                kwargs = dict(input_ids=s["input_ids"][None, a:b])
            else:
                kwargs, a, b = doc_inputs(s, d, dtype)
            kwargs = {k: v.to(device) for k, v in kwargs.items()}
            doc = kwargs["input_ids"][0]
            logp = F.log_softmax(model(**kwargs).logits[0].double(), dim=-1)
            entropy[a:b] = (-(logp.exp() * logp).sum(-1)).cpu()
            target = logp[:-1].gather(1, doc[1:, None])[:, 0]
            placeholder = (doc[1:] == IMAGE) | (doc[1:] == VIDEO)
            logprobs[a:b - 1] = torch.where(placeholder, 0.0, target).cpu()
    return logprobs, entropy


def ours(folder, s: dict, dtype: torch.dtype, gdn_kernel: str = "auto", device: str = "cuda"):
    """score.py's ``(logprobs, entropy)`` float64 CPU of stream ``s``, model loaded as score.py
    loads it (``--dtype``), on one GPU."""
    state = ParallelState()
    family = family_of_hf(folder)
    options = {"gdn_kernel": gdn_kernel} if "gdn_kernel" in family.options else {}
    cfg = family.config_from_hf(read_hf_config(folder))
    model, _ = family.load(folder, state, cfg, device=device, dtype=dtype, **options)
    vision = {k: (s[k].to(device) if s.get(k) is not None else None) for k in VISION if k in s}
    lp, ent = score_stream(model.eval(), state, s["input_ids"].to(device),
                           s["cu_seqlens"].to(device), **vision)
    return lp.double().cpu(), ent.double().cpu()


def errors(got, want) -> tuple[float, float]:
    """Max |difference| of two ``(logprobs, entropy)`` pairs: ``(logprobs, entropy)``."""
    return (float((got[0] - want[0]).abs().max()), float((got[1] - want[1]).abs().max()))


def without_fla_env() -> dict | None:
    """This process's environment with the folder fla imports from taken off PYTHONPATH, or
    None when fla is not importable that way (installed in the interpreter's own site)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or spec.origin is None:
        return dict(os.environ)
    site = str(Path(spec.origin).parents[1])
    paths = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if site not in paths:
        return None
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p != site)}


def main(jobs_file: str) -> int:
    assert VOCAB and importlib.util.find_spec("fla") is None, "run with without_fla_env()"
    for job in torch.load(jobs_file, weights_only=False):
        dtype = getattr(torch, job["dtype"])
        torch.save(hf_scores(job["folder"], job["kind"], job["stream"], job["device"], dtype),
                   job["out"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
