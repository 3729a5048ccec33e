"""Per-token log-probs and entropy of sequences under any tp x cp x pp (x dp) layout.

    torchrun --nproc-per-node N launch/score.py --hf-checkpoint DIR --tp T --cp C [--ep E] [--pp P] \\
        [--cp-mode ring|ulysses] [--dtype float32|bfloat16] [--mtp] --input IN.jsonl --output OUT.jsonl

Input: one JSON object per line, ``{"input_ids": [...]}`` with an optional ``"loss_mask"``
(same length; 0 marks tokens that are not targets). On a vision-language checkpoint (Qwen2-VL,
Qwen3-VL, GLM-4V) a line may add images, as ``"pixel_values"`` + ``"image_grid_thw"``
(placeholder runs expanded in ``input_ids``) or as ``"images"`` (file paths, one placeholder id
each, processed as the family's transformers processor does), and videos, as
``"pixel_values_videos"`` + ``"video_grid_thw"`` (laid out in ``input_ids`` as the family's
processor lays them out); see launch/score_io.py, which checks every line before the model
loads. Output, same order, one line each:
``{"logprobs": [...], "entropy": [...]}`` of length ``len(input_ids) - 1``, where
``logprobs[t] = log p(input_ids[t+1] | input_ids[:t+1])`` (0 where ``loss_mask[t+1]`` is 0 or
``input_ids[t+1]`` is an image placeholder) and ``entropy[t]`` is the entropy of that same
next-token distribution (at every position). Lines in the ``images`` form also get
``"input_ids"``: the expanded ids that the outputs align with. ``--mtp`` (a checkpoint with
multi-token-prediction layers, ``mtp.*``) scores the MTP head instead, for checking speculative
acceptance: same length, ``logprobs[t] = log p_mtp(input_ids[t+2] | input_ids[:t+2])`` (0 at
t = len - 2 and where ``loss_mask[t+2]`` is 0), ``entropy[t]`` that distribution's entropy.

How: dp = world / (tp * cp * pp) replicas take the sequences round-robin; each replica packs its
sequences into ONE stream, shifts labels on it (``LabelShifter``, before any split; for VL also
the M-RoPE positions and vision rows), splits it over its cp ranks (zigzag when cp > 1), runs the
model (tp-sharded; every cp rank gets the replica's whole pixel_values; at pp > 1 through the
replica's pipeline stages, ``mpcore.pipelined.PipelinedScorer``), gathers the per-token
outputs back to stream order over cp, and rank 0 collects every replica's results and writes
them in input order. CUDA when available (nccl), else CPU (gloo).

The output (launch/score_output.py) is never the input file, under any name or link; one
score.py at a time writes it (a lock beside it, ``.<name>.lock``, names the holder); and it is
replaced whole at the end, so a killed run leaves the previous file. A blank input line is an
error: output line i belongs to input line i. Errors are printed once, not once per rank
(``mpcore.processes.report_user_error``, as launch/pretrain.py does).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mpcore.checkpoint import from_rank0
from mpcore.launch.score_io import InputSpec, ScoreItem, read_input, vl_spec
from mpcore.launch.score_output import check_paths, lock_output, write_output
from mpcore.models import Family, describe_kernels, family_of, family_of_hf, read_hf_config
from mpcore.models.common.hybrid.mtp import MTP_KEYS, MtpOutput
from mpcore.parallel.state import ParallelState
from mpcore.pipelined import load_for_scoring
from mpcore.processes import (
    EXIT_USER_ERROR,
    exit_with_parent,
    init_distributed,
    report_user_error,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# How long the ranks wait for each other to form the process group (pretrain.py's default
# parallel.init_timeout_s): past it each exits with a message instead of hanging.
INIT_TIMEOUT_S = 300.0
EPILOG = """exit codes: 0 scored and written; 2 an input or usage error, or an output that
cannot be written (the message names the file, the line or the option, and the fix; printed
once under torchrun; --output is left as it was); 4 the process group did not form"""


def score_stream(model, state: ParallelState, input_ids: torch.Tensor,
                 cu_seqlens: torch.Tensor, loss_mask: torch.Tensor | None = None,
                 temperature: float = 1.0, pixel_values: torch.Tensor | None = None,
                 image_grid_thw: torch.Tensor | None = None,
                 pixel_values_videos: torch.Tensor | None = None,
                 video_grid_thw: torch.Tensor | None = None,
                 second_per_grid: torch.Tensor | None = None,
                 mtp: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [T], entropy [T])`` fp32 of one packed stream, in stream order, on every rank
    of this replica's tp x cp group (collective over ``state.tp_group`` and ``state.cp_group``).
    Position t scores ``input_ids[t+1]`` (0 at each document's last token). A vision-language
    model also takes the stream's ``pixel_values [N, patch_dim]`` and ``image_grid_thw [I, 3]``
    (every image of the stream, in placeholder order; may be None) and likewise its videos'
    ``pixel_values_videos`` / ``video_grid_thw`` (and ``second_per_grid [V]`` float64, seconds
    per temporal patch of each video; None: 1 each). The model's family
    (``mpcore.models.family_of(model.cfg)``) makes this rank's inputs. ``mtp``: the outputs of
    the model's multi-token-prediction head instead (position t scores ``input_ids[t+2]``; the
    model must have been loaded with its MTP block, ``mtp_loss_weight > 0``)."""
    family = family_of(model.cfg)
    videos = {} if video_grid_thw is None else {"pixel_values_videos": pixel_values_videos,
                                                "video_grid_thw": video_grid_thw,
                                                "second_per_grid": second_per_grid}
    plan, inputs = family.local_inputs(state, input_ids, cu_seqlens, model.cfg,
                                       loss_mask=loss_mask,
                                       sequence_parallel=model.sequence_parallel,
                                       pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                                       **videos)
    if mtp and "mtp_input_ids" not in inputs:
        raise ValueError("--mtp: this model has no MTP block; load a checkpoint with mtp.* "
                         "weights (config.json mtp_num_hidden_layers >= 1) with its MTP block")
    if not mtp:  # the main head only: no MTP compute
        inputs = {k: v for k, v in inputs.items() if k not in MTP_KEYS}
    with torch.no_grad():
        out = model(**inputs, output="logprobs", temperature=temperature)
    logprobs, entropy = out.mtp if isinstance(out, MtpOutput) else out
    return plan.gather(logprobs, state.cp_group), plan.gather(entropy, state.cp_group)


def score_items(model, state: ParallelState, items: list[ScoreItem],
                device: torch.device | str = "cpu", temperature: float = 1.0,
                mtp: bool = False) -> list[dict]:
    """Score ``items`` packed into one stream; ``[{"logprobs", "entropy"}]`` per item (lists of
    ``len - 1`` floats; plus ``"input_ids"`` for items with ``echo_ids``). Collective over this
    replica's tp x cp group: every rank calls it, with the same items."""
    results = [{"logprobs": [], "entropy": []} for _ in items]
    keep = [i for i, s in enumerate(items) if len(s.input_ids) > 0]  # empty docs cannot pack
    if keep:
        lengths = torch.tensor([len(items[i].input_ids) for i in keep])
        cu = torch.zeros(len(keep) + 1, dtype=torch.int64)
        cu[1:] = lengths.cumsum(0)
        ids = torch.tensor([t for i in keep for t in items[i].input_ids], dtype=torch.long,
                           device=device)
        mask = None
        if any(items[i].loss_mask is not None for i in keep):
            mask = torch.tensor([bool(m) for i in keep for m in (
                items[i].loss_mask or [1] * len(items[i].input_ids))], device=device)
        vision = {}
        for pixels, grid, count in (("pixel_values", "image_grid_thw", "num_images"),
                                    ("pixel_values_videos", "video_grid_thw", "num_videos")):
            rows = [getattr(items[i], pixels) for i in keep if getattr(items[i], count)]
            grids = [g for i in keep for g in getattr(items[i], grid)]
            if grids:
                vision[pixels] = torch.cat(rows).to(device)
                vision[grid] = torch.tensor(grids, dtype=torch.int64).view(-1, 3)
        if "video_grid_thw" in vision:
            vision["second_per_grid"] = torch.tensor(
                [s for i in keep for s in (items[i].second_per_grid or [1.0] * items[i].num_videos)],
                dtype=torch.float64)
        logprobs, entropy = score_stream(model, state, ids, cu.to(device), mask, temperature,
                                         **vision, mtp=mtp)
        logprobs, entropy = logprobs.cpu(), entropy.cpu()
        for j, i in enumerate(keep):
            start, stop = int(cu[j]), int(cu[j + 1]) - 1  # the last token has no target
            results[i] = {"logprobs": logprobs[start:stop].tolist(),
                          "entropy": entropy[start:stop].tolist()}
    elif state.ep > 1:  # nothing to score here, but the ep group's all-to-alls need this rank
        score_stream(model, state, torch.zeros(1, dtype=torch.long, device=device),
                     torch.tensor([0, 1], device=device))
    for item, result in zip(items, results, strict=True):
        if item.echo_ids:
            result["input_ids"] = item.input_ids
    return results


def score_sequences(model, state: ParallelState, sequences: list[list[int]],
                    loss_masks: list | None = None, device: torch.device | str = "cpu",
                    temperature: float = 1.0) -> list[dict]:
    """``score_items`` of text-only sequences (lists of ids) with optional loss masks."""
    masks = loss_masks or [None] * len(sequences)
    items = [ScoreItem(list(s), m) for s, m in zip(sequences, masks, strict=True)]
    return score_items(model, state, items, device, temperature)


def checkpoint_spec(folder: Path, ep: int = 1) -> InputSpec:
    """What the checkpoint at ``folder`` accepts, from its config.json alone (no weights):
    a vision-language family's checkpoint takes images, a decoder's text only. ``ValueError``
    for architectures no family supports, or experts that do not split over ``ep`` ranks (a
    dense model at ep > 1 included)."""
    hf = read_hf_config(folder)
    family = family_of_hf(hf)
    cfg = family.config_from_hf(hf)
    try:
        family.check_experts(cfg, ep)
    except ValueError as e:
        raise ValueError(f"--ep {ep} does not fit {folder}: {e}") from None
    if family.modality == "image-text":
        return vl_spec(cfg, folder, family.image_processing, stream_check(family, cfg))
    archs = hf.get("architectures") or ["?"]
    return InputSpec(vocab_size=cfg.vocab_size, checkpoint=f"{folder} ({archs[0]})")


def stream_check(family: Family, cfg):
    """``InputSpec.check_stream`` of a VL family: its own ``local_inputs`` on one line at one
    rank (its position rule checks every placeholder run against the grids, ``ValueError``
    naming the item), so a bad line fails before the model loads."""
    def check(ids: list[int], image_grid: list, video_grid: list) -> None:
        family.local_inputs(ParallelState(), torch.tensor(ids, dtype=torch.long),
                            torch.tensor([0, len(ids)]), cfg,
                            image_grid_thw=torch.tensor(image_grid).view(-1, 3) if image_grid
                            else None,
                            video_grid_thw=torch.tensor(video_grid).view(-1, 3) if video_grid
                            else None)
    return check


def gather_in_order(results: list[dict], mine: list[int], state: ParallelState,
                    total: int) -> list[dict] | None:
    """Rank 0 gets every replica's ``results`` (for input indices ``mine``) in input order."""
    if not dist.is_initialized():
        return results
    lead = state.tp_rank == 0 and state.cp_rank == 0 and state.pp_rank == 0  # one per replica
    payload = list(zip(mine, results, strict=True)) if lead else None
    gathered = [None] * dist.get_world_size() if state.rank == 0 else None
    dist.gather_object(payload, gathered, dst=0)
    if state.rank != 0:
        return None
    ordered = [None] * total
    for part in gathered:
        for index, result in part or []:
            ordered[index] = result
    assert all(r is not None for r in ordered)
    return ordered


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=EPILOG)
    parser.add_argument("--hf-checkpoint", type=Path, required=True, metavar="DIR",
                        help="Hugging Face checkpoint folder (config.json + *.safetensors): a "
                             "decoder (Llama 3, Qwen2/3, Qwen3-MoE, Qwen3.5) or a vision-"
                             "language model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V)")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel degree (default 1); tp * cp must divide the "
                             "number of processes, the rest are data-parallel replicas")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree (default 1): each packed stream is split "
                             "over cp ranks (zigzag when cp > 1)")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree of a MoE checkpoint (default 1): its "
                             "experts split over ep ranks of the dp x cp ranks; ep must divide "
                             "processes / tp")
    parser.add_argument("--pp", type=int, default=1,
                        help="pipeline-parallel degree (default 1): the decoder's layers cut "
                             "into pp stages on pp blocks of tp * cp * dp ranks (text "
                             "families; not with --mtp)")
    parser.add_argument("--cp-mode", choices=("ring", "ulysses"), default="ring",
                        help="context-parallel attention when cp > 1 (default ring; ulysses "
                             "needs heads divisible by cp)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="weights and compute dtype (default float32); outputs are float32. "
                             "Qwen3.5's Gated DeltaNet runs the PyTorch reference in float32 "
                             "(fla's chunk kernels take float32 dots in TF32) and fla-core's "
                             "kernels in bfloat16 on CUDA when installed; the choice is printed")
    parser.add_argument("--sequence-parallel", action="store_true",
                        help="Megatron sequence parallelism inside the tp group (same results)")
    parser.add_argument("--temperature", type=float, default=1.0,
                        help="divide the logits by this before log-softmax (default 1.0)")
    parser.add_argument("--mtp", action="store_true",
                        help="score the multi-token-prediction head (mtp.*) instead: position "
                             "t scores input_ids[t+2] (Qwen3.5 checkpoints with MTP layers)")
    parser.add_argument("--input", type=Path, required=True, metavar="IN.jsonl",
                        help='one JSON object per line, {"input_ids": [...]} with optional '
                             '"loss_mask" and images (see above); no blank lines: output line '
                             "i belongs to input line i")
    parser.add_argument("--output", type=Path, required=True, metavar="OUT.jsonl",
                        help='one {"logprobs": [...], "entropy": [...]} per input line, in '
                             "order; replaced whole when the run ends (never the input file; "
                             "one score.py per output at a time)")
    return parser.parse_args(argv)


def setup() -> tuple[torch.device, dist.Store | None]:
    """Join torchrun's process group (if launched by it; ``mpcore.processes.init_distributed``:
    CUDA + nccl when available, else gloo); returns the device and the rendezvous store (None
    for one process), through which one rank is chosen to print a user error."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else (
        torch.device("cpu"))
    if "LOCAL_RANK" in os.environ:  # launched by torchrun: do not outlive it
        exit_with_parent()
    store = init_distributed(INIT_TIMEOUT_S)
    return device, store


def load_model(args: argparse.Namespace, state: ParallelState, device: torch.device):
    """The checkpoint's model (its family's loader), tp-sharded, in eval mode."""
    hf = read_hf_config(args.hf_checkpoint)
    family = family_of_hf(hf)
    cfg = family.config_from_hf(hf)
    mtp = {}
    if args.mtp:  # the weight only makes the loader build and read the block
        if not getattr(cfg, "mtp_num_hidden_layers", 0):
            raise ValueError(f"--mtp: {args.hf_checkpoint} has no multi-token-prediction "
                             f"layers (config.json mtp_num_hidden_layers); drop --mtp")
        mtp = {"mtp_loss_weight": 1.0}
        try:
            cfg = cfg.with_mtp_weight(1.0)
        except ValueError as e:
            raise ValueError(f"--mtp: {args.hf_checkpoint}: {e}") from None
    options = dict(cp_mode=args.cp_mode, sequence_parallel=args.sequence_parallel,
                   device=device, dtype=DTYPES[args.dtype])
    if state.pp > 1:
        if args.mtp:
            raise ValueError("--mtp scores the MTP head, which reads the embedding and the "
                             "last hidden state: run it with --pp 1")
        return load_for_scoring(args.hf_checkpoint, family, cfg, state, **options)
    model, _ = family.load(args.hf_checkpoint, state, cfg, **options, **mtp)
    return model.eval()


def claim_output(args: argparse.Namespace, state: ParallelState):
    """Refuse an output that is the input (every rank), lock it (rank 0; ``mpcore.launch.score_output``):
    before the model loads. Returns the lock (rank 0) or None. Collective."""
    check_paths(args.input, args.output)
    lock, error = None, None
    if state.rank == 0:
        try:
            lock = lock_output(args.output)
        except ValueError as e:
            error = str(e)
    error = from_rank0(error)
    if error:
        raise ValueError(error)
    return lock


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, store = setup()
    lock = None
    try:
        state = ParallelState.build(args.tp, args.cp, ep=args.ep, pp=args.pp)
        lock = claim_output(args, state)
        spec = checkpoint_spec(args.hf_checkpoint, args.ep)
        items = read_input(args.input, spec)  # every rank: the same checks, before any compute
        model = load_model(args, state, device)
        if state.rank == 0:
            for line in describe_kernels(model, device, DTYPES[args.dtype]):
                print(f"score.py: {line}", flush=True)
        start = time.perf_counter()
        mine = list(range(state.dp_rank, len(items), state.dp))
        results = score_items(model, state, [items[i] for i in mine], device, args.temperature,
                              args.mtp)
        ordered = gather_in_order(results, mine, state, len(items))
        if ordered is not None:
            write_output(args.output, ordered)
            tokens = sum(len(i.input_ids) for i in items)
            images = sum(i.num_images for i in items)
            videos = sum(i.num_videos for i in items)
            print(f"score.py: scored {len(items)} sequences ({tokens} tokens, {images} images, "
                  f"{videos} videos) "
                  f"at tp={state.tp} cp={state.cp} ({args.cp_mode}) pp={state.pp} dp={state.dp} "
                  f"{args.dtype} in {time.perf_counter() - start:.2f} s -> {args.output}",
                  flush=True)
    except ValueError as e:  # the same error on every rank, or on some: printed once
        report_user_error(str(e), store)
        return EXIT_USER_ERROR
    finally:
        if lock is not None:
            lock.close()
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
