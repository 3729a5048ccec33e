"""Per-token log-probs and entropy of sequences under any tp x cp (x dp) layout.

    torchrun --nproc-per-node N launch/score.py --hf-checkpoint DIR --tp T --cp C \\
        [--cp-mode ring|ulysses] [--dtype float32|bfloat16] --input IN.jsonl --output OUT.jsonl

Input: one JSON object per line, ``{"input_ids": [...]}`` with an optional ``"loss_mask"``
(same length; 0 marks tokens that are not targets). Output, same order, one line each:
``{"logprobs": [...], "entropy": [...]}`` of length ``len(input_ids) - 1``, where
``logprobs[t] = log p(input_ids[t+1] | input_ids[:t+1])`` (0 where ``loss_mask[t+1]`` is 0) and
``entropy[t]`` is the entropy of that same next-token distribution.

How: dp = world / (tp * cp) replicas take the sequences round-robin; each replica packs its
sequences into ONE stream, shifts labels on it (``LabelShifter``, before any split), splits it
over its cp ranks (zigzag when cp > 1), runs the model (tp-sharded), gathers the per-token
outputs back to stream order over cp, and rank 0 collects every replica's results and writes
them in input order. CUDA when available (nccl), else CPU (gloo).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from models.hf import load_hf_model
from models.transformer import Transformer
from parallel.context import ContextPlan, split_batch
from parallel.labels import LabelShifter, position_ids
from parallel.state import ParallelState

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def local_inputs(state: ParallelState, input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                 loss_mask: torch.Tensor | None = None, sequence_parallel: bool = False
                 ) -> tuple[ContextPlan, dict]:
    """The cp plan of one packed stream and this rank's model inputs (keyword arguments of
    ``Transformer.forward`` except ``output``): labels shifted on the GLOBAL stream, then every
    per-token tensor split together (zigzag when cp > 1; local length a multiple of tp under SP).

    ``input_ids [T]`` int, ``cu_seqlens [D+1]`` int (non-empty documents), ``loss_mask [T]``
    bool or None. Label t is ``input_ids[t+1]`` (ignored at each document's last token).
    """
    total = input_ids.numel()
    labels = LabelShifter()(input_ids, cu_seqlens, loss_mask)
    layout = "zigzag" if state.cp > 1 else "contiguous"
    plan = ContextPlan(cu_seqlens, total, state.cp, layout,
                       pad_multiple=state.tp if sequence_parallel else 1)
    batch = {"input_ids": input_ids, "labels": labels,
             "position_ids": position_ids(cu_seqlens, total).to(input_ids.device),
             "cu_seqlens": cu_seqlens}
    local = split_batch(batch, plan, state.cp_rank)
    rank_layout = plan.rank_layout(state.cp_rank)
    device = input_ids.device
    return plan, {"input_ids": local["input_ids"], "position_ids": local["position_ids"],
                  "doc_id": rank_layout.doc_id.to(device),
                  "positions_in_doc": rank_layout.positions_in_doc.to(device),
                  "cu_seqlens": local["cu_seqlens"], "labels": local["labels"]}


def score_stream(model: Transformer, state: ParallelState, input_ids: torch.Tensor,
                 cu_seqlens: torch.Tensor, loss_mask: torch.Tensor | None = None,
                 temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs [T], entropy [T])`` fp32 of one packed stream, in stream order, on every rank
    of this replica's tp x cp group (collective over ``state.tp_group`` and ``state.cp_group``).
    Position t scores ``input_ids[t+1]`` (0 at each document's last token)."""
    plan, inputs = local_inputs(state, input_ids, cu_seqlens, loss_mask,
                                model.sequence_parallel)
    with torch.no_grad():
        logprobs, entropy = model(**inputs, output="logprobs", temperature=temperature)
    return plan.gather(logprobs, state.cp_group), plan.gather(entropy, state.cp_group)


def score_sequences(model: Transformer, state: ParallelState, sequences: list[list[int]],
                    loss_masks: list | None = None, device: torch.device | str = "cpu",
                    temperature: float = 1.0) -> list[dict]:
    """Score ``sequences`` packed into one stream; ``[{"logprobs", "entropy"}]`` per sequence
    (lists of ``len - 1`` floats). Collective over this replica's tp x cp group."""
    results = [{"logprobs": [], "entropy": []} for _ in sequences]
    keep = [i for i, s in enumerate(sequences) if len(s) > 0]  # empty documents cannot pack
    if not keep:
        return results
    lengths = torch.tensor([len(sequences[i]) for i in keep])
    cu = torch.zeros(len(keep) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    ids = torch.tensor([t for i in keep for t in sequences[i]], dtype=torch.long, device=device)
    mask = None
    if loss_masks is not None and any(loss_masks[i] is not None for i in keep):
        mask = torch.tensor([bool(m) for i in keep
                             for m in (loss_masks[i] or [1] * len(sequences[i]))], device=device)
    logprobs, entropy = score_stream(model, state, ids, cu.to(device), mask, temperature)
    logprobs, entropy = logprobs.cpu(), entropy.cpu()
    for j, i in enumerate(keep):
        start, stop = int(cu[j]), int(cu[j + 1]) - 1  # the last token has no target
        results[i] = {"logprobs": logprobs[start:stop].tolist(),
                      "entropy": entropy[start:stop].tolist()}
    return results


def read_input(path: Path, vocab_size: int) -> tuple[list[list[int]], list]:
    """Sequences and loss masks of a JSONL file; ``ValueError`` naming the line on bad input."""
    sequences, masks = [], []
    for num, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        ids, mask = row.get("input_ids"), row.get("loss_mask")
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise ValueError(f"{path}:{num}: input_ids must be a list of ints")
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{path}:{num}: token id {bad[0]} is outside the model's vocab "
                             f"[0, {vocab_size}); check the tokenizer matches the checkpoint")
        if mask is not None and (not isinstance(mask, list) or len(mask) != len(ids)):
            raise ValueError(f"{path}:{num}: loss_mask must be a list as long as input_ids")
        sequences.append(ids)
        masks.append(mask)
    return sequences, masks


def gather_in_order(results: list[dict], mine: list[int], state: ParallelState,
                    total: int) -> list[dict] | None:
    """Rank 0 gets every replica's ``results`` (for input indices ``mine``) in input order."""
    if not dist.is_initialized():
        return results
    lead = state.tp_rank == 0 and state.cp_rank == 0  # one sender per replica
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
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-checkpoint", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--cp-mode", choices=("ring", "ulysses"), default="ring")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--input", type=Path, required=True)
    parser.add_argument("--output", type=Path, required=True)
    return parser.parse_args(argv)


def setup() -> torch.device:
    """Join torchrun's process group (if launched by it); CUDA + nccl when available."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else (
        torch.device("cpu"))
    if cuda:
        torch.cuda.set_device(device)
    if "WORLD_SIZE" in os.environ and not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    return device


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = setup()
    try:
        state = ParallelState.build(args.tp, args.cp)
        model, cfg = load_hf_model(args.hf_checkpoint, state, cp_mode=args.cp_mode,
                                   sequence_parallel=args.sequence_parallel, device=device,
                                   dtype=DTYPES[args.dtype])
        model.eval()
        sequences, masks = read_input(args.input, cfg.vocab_size)  # every rank: same checks
        mine = list(range(state.dp_rank, len(sequences), state.dp))
        results = score_sequences(model, state, [sequences[i] for i in mine],
                                  [masks[i] for i in mine], device, args.temperature)
        ordered = gather_in_order(results, mine, state, len(sequences))
        if ordered is not None:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            with args.output.open("w") as f:
                for row in ordered:
                    f.write(json.dumps(row) + "\n")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
