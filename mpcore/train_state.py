"""What a checkpoint holds, in a layout-independent form, and how it is put back.

Keys of the DCP state (every tensor on the CPU):

    model/<hf_name>                  a full logical tensor (``mpcore.logical``; HF names, padding
                                     stripped, fused projections split into their parts)
    optim/<hf_name>/<state>          an optimizer state shaped like its parameter (exp_avg, ...),
                                     in the same logical form
    optim_scalar/<name>/<state>      a per-parameter scalar state (AdamW's ``step``), by our name
    rng/rank<R>/{cpu,cuda,tracker/<stream>}   RNG states of global rank R

Saving gathers each parameter to its full logical form: FSDP2 shards are all-gathered over
dp x cp (``full_tensor``), then the tp shards of ONE replica (dp x cp rank ``i % (dp*cp)`` for
the i-th parameter) are gathered over its tp group and kept by one of its ranks, so the writes
spread over the world. Expert tensors of a MoE model split over ep ranks are first gathered
over the replica's ep group onto the replica (after FSDP2's gather over the expert-data-parallel
group; the other ep groups skip it and no other rank holds every expert), so the checkpoint
holds every expert of every layer: the same keys at any ep (``mpcore.logical``).
Memory: each rank holds the full tensors it owns (about 1/world of the model + optimizer, in
fp32, on the CPU) plus one parameter's full tensor at a time.

Loading reads the full logical tensors on EVERY rank, a batch of parameters at a time
(``LOAD_BATCH_BYTES``), and keeps this rank's shard of each: tp pieces, then the FSDP2 dim-0
chunk (expert tensors: this ep rank's experts first). Reads cost world x checkpoint size of
I/O; memory stays one batch at a time. A checkpoint from any (tp, cp, dp, ep, fsdp|ddp) layout
loads at any other. RNG states are restored only when the layout is the same (their meaning
depends on the rank).

    fp8/rank<R>/<layer>/<key>        TransformerEngine delayed-scaling state of each layer
                                     (``mpcore.parallel.te.FP8_STATE_KEYS``) on global rank R

FP8 scaling state (``model.fp8=te_delayed``) is restored exactly at the same layout; at another
layout each layer gets the merge of its saved ranks' states (``mpcore.parallel.te.merge_fp8_states``).
A checkpoint without it (a bf16 or ``tensorwise`` run) resumed with te_delayed starts the
histories empty, and a te_delayed checkpoint resumed without it ignores it; both are logged.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from mpcore.checkpoint import load_tensors, stored_tensors
from mpcore.logical import LogicalLayout
from mpcore.parallel.random import RNGTracker
from mpcore.parallel.state import ParallelState
from mpcore.parallel.te import fp8_state, fp8_state_layers, load_fp8_state, merge_fp8_states

log = logging.getLogger(__name__)

LOAD_BATCH_BYTES = 1 << 30


def _is_dtensor(t) -> bool:
    return hasattr(t, "full_tensor")


@torch.no_grad()
def _tp_local(t: torch.Tensor) -> torch.Tensor:
    """The whole tp-local tensor: an FSDP2 DTensor all-gathered over dp x cp, else ``t``."""
    return t.full_tensor() if _is_dtensor(t) else t.detach()


class _Keys:
    """The checkpoint key of an HF tensor under ``prefix`` (``model`` or ``optim/<state>``)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def __call__(self, hf_name: str) -> str:
        if self.prefix == "model":
            return f"model/{hf_name}"
        return f"optim/{hf_name}/{self.prefix.split('/', 1)[1]}"


@torch.no_grad()
def _place(like: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (the whole tp-local tensor) laid out like ``like`` (FSDP2 shard or plain)."""
    if _is_dtensor(like):
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(local.to(like.device, like.dtype), like.device_mesh,
                                 like.placements, src_data_rank=None)
    return local.to(like.device, like.dtype)


class TrainState:
    """Collects and restores model, optimizer and RNG state (module docstring).

    ``model``: the unwrapped module (FSDP2-sharded in place or plain; not the DDP wrapper).
    ``optimizer=None`` restores the model weights only (export, evaluation).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                 layout: LogicalLayout,
                 state: ParallelState, tracker: RNGTracker, device: torch.device):
        self.model, self.optimizer, self.layout = model, optimizer, layout
        self.state, self.tracker, self.device = state, tracker, device
        self.params = dict(model.named_parameters())
        self.fp8_layers = fp8_state_layers(model)
        if set(self.params) != set(layout.names):
            raise AssertionError(f"model and logical layout disagree: "
                                 f"{set(self.params) ^ set(layout.names)}")

    def _owner(self, i: int) -> tuple[int, int]:
        """(dp x cp rank of the replica that gathers parameter i, tp rank that keeps it)."""
        s = self.state
        return i % s.dp_cp, (i // s.dp_cp) % s.tp

    def collect(self, staging=None) -> dict[str, torch.Tensor]:
        """This rank's share of the checkpoint tensors. Collective over the world.

        ``staging`` (``mpcore.checkpoint_async.HostStaging``): the full tensors are written
        into its reused pinned buffers by asynchronous copies, with one device synchronize at
        the end, instead of into new pageable tensors one blocking copy at a time."""
        s, out = self.state, {}
        for i, name in enumerate(self.layout.names):
            param = self.params[name]
            replica, keeper = self._owner(i)
            entries = [("model", param)]
            opt_state = self.optimizer.state.get(param, {}) if self.optimizer else {}
            for key in sorted(opt_state):
                value = opt_state[key]
                if isinstance(value, torch.Tensor) and value.shape == param.shape:
                    entries.append((f"optim/{key}", value))
                elif isinstance(value, torch.Tensor) and value.numel() == 1:
                    if (s.dp_cp_rank, s.tp_rank) == (replica, keeper):
                        out[f"optim_scalar/{name}/{key}"] = value.detach().cpu().clone()
            for prefix, tensor in entries:
                local = _tp_local(tensor)  # collective over dp x cp (edp) under FSDP2
                if s.dp_cp_rank // s.ep == replica // s.ep:  # the replica's ep group
                    local = self.layout.gather_experts_to(name, local, s.ep_group,
                                                          replica % s.ep)
                if s.dp_cp_rank != replica:
                    continue
                keys = _Keys(prefix)
                alloc = None if staging is None or s.tp_rank != keeper else (
                    lambda hf_name, shape, dtype, keys=keys: staging.buffer(keys(hf_name), shape,
                                                                             dtype))
                full = self.layout.gather(name, local, s.tp_group,  # collective over tp
                                          alloc=alloc)
                if s.tp_rank == keeper:
                    for hf_name, t in full.items():
                        out[keys(hf_name)] = t
        if staging is not None:
            staging.ready(self.device)
        out.update(self._rng())
        out.update(self._fp8())
        return out

    def _fp8(self) -> dict[str, torch.Tensor]:
        out = {}
        for layer, gemm in self.fp8_layers.items():
            for key, value in (fp8_state(gemm) or {}).items():
                out[f"fp8/rank{self.state.rank}/{layer}/{key}"] = value.detach().cpu().clone()
        return out

    def _rng(self) -> dict[str, torch.Tensor]:
        r = self.state.rank
        out = {f"rng/rank{r}/cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            out[f"rng/rank{r}/cuda"] = torch.cuda.get_rng_state(self.device)
        for stream, value in self.tracker.state_dict().items():
            out[f"rng/rank{r}/tracker/{stream}"] = value
        return out

    def restore(self, folder, same_layout: bool) -> None:
        """Load model, optimizer (and RNG when ``same_layout``) from checkpoint ``folder``.
        Collective over the world."""
        stored = stored_tensors(folder)
        groups = self.optimizer.param_groups if self.optimizer else []
        opt_index = {id(p): i for i, p in enumerate(p for g in groups for p in g["params"])}
        opt_state: dict[int, dict] = {}
        for names in self._batches(stored):
            keys = [k for n in names for k in self._keys(n, stored)]
            full = load_tensors(folder, keys, stored)
            for name in names:
                self._restore_param(name, full, opt_state, opt_index)
        if self.optimizer:
            opt_sd = self.optimizer.state_dict()
            opt_sd["state"] = opt_state
            self.optimizer.load_state_dict(opt_sd)
        if same_layout:
            self._restore_rng(folder, stored)
        self._restore_fp8(folder, stored, same_layout)

    def _restore_fp8(self, folder, stored, same_layout: bool) -> None:
        saved = sorted(k for k in stored if k.startswith("fp8/"))
        quiet = self.state.rank != 0
        if not self.fp8_layers:
            if saved and not quiet:
                log.info("the checkpoint holds TransformerEngine FP8 (te_delayed) scaling "
                         "state; this run does not use it (model.fp8 is not te_delayed)")
            return
        if not saved:
            if not quiet:
                log.info("the checkpoint has no FP8 scaling state (saved without "
                         "model.fp8=te_delayed): the amax histories start empty, as in a "
                         "fresh FP8 run")
            return
        by_layer: dict[str, list[str]] = {}
        for key in saved:  # fp8/rank<R>/<layer>/<entry>
            layer = key.split("/", 2)[2].rsplit("/", 1)[0]
            by_layer.setdefault(layer, []).append(key)
        missing = sorted(set(self.fp8_layers) - set(by_layer))
        if missing:
            raise ValueError(f"checkpoint {folder} has FP8 scaling state for other layers than "
                             f"this model's (none for {missing[:3]}...)")
        mine = f"fp8/rank{self.state.rank}/"
        for layer, gemm in self.fp8_layers.items():
            values = load_tensors(folder, by_layer[layer], stored)
            ranks: dict[str, dict[str, torch.Tensor]] = {}
            for key, value in values.items():
                rank, entry = key.split("/", 2)[1], key.rsplit("/", 1)[1]
                ranks.setdefault(rank, {})[entry] = value
            own = ranks.get(mine.split("/")[1]) if same_layout else None
            load_fp8_state(gemm, own if own is not None else merge_fp8_states(list(ranks.values())))
        if not quiet:
            how = ("as saved" if same_layout else
                   "merged over the saved ranks (the layout changed)")
            log.info("restored FP8 scaling state of %d layers, %s", len(self.fp8_layers), how)

    def _keys(self, name: str, stored) -> list[str]:
        keys = [f"model/{hf}" for hf in self.layout.owners[name]]
        if self.optimizer is None:
            return keys
        for hf in self.layout.owners[name]:
            keys += [k for k in stored if k.startswith(f"optim/{hf}/")]
        return keys + [k for k in stored if k.startswith(f"optim_scalar/{name}/")]

    def _batches(self, stored) -> list[list[str]]:
        """Parameter names in groups of at most ``LOAD_BATCH_BYTES`` of stored tensors."""
        batches, current, size = [], [], 0
        for name in self.layout.names:
            nbytes = sum(stored[k][0].numel() * stored[k][1].itemsize
                         for k in self._keys(name, stored) if k in stored)
            if current and size + nbytes > LOAD_BATCH_BYTES:
                batches.append(current)
                current, size = [], 0
            current.append(name)
            size += nbytes
        return batches + ([current] if current else [])

    @torch.no_grad()
    def _restore_param(self, name: str, full: dict, opt_state: dict, opt_index: dict) -> None:
        param = self.params[name]
        hfs = self.layout.owners[name]
        local = self.layout.shard(name, {hf: full[f"model/{hf}"] for hf in hfs})
        param.copy_(_place(param, local))
        state = {}
        for key in {k.rsplit("/", 1)[1] for k in full if k.startswith(f"optim/{hfs[0]}/")}:
            value = self.layout.shard(name, {hf: full[f"optim/{hf}/{key}"] for hf in hfs})
            state[key] = _place(param, value.float())
        prefix = f"optim_scalar/{name}/"
        for k, v in full.items():
            if k.startswith(prefix):
                state[k[len(prefix):]] = v
        if state and self.optimizer:
            opt_state[opt_index[id(param)]] = state

    def _restore_rng(self, folder, stored) -> None:
        prefix = f"rng/rank{self.state.rank}/"
        keys = sorted(k for k in stored if k.startswith(prefix))
        states = load_tensors(folder, keys, stored)
        if prefix + "cpu" in states:
            torch.set_rng_state(states[prefix + "cpu"])
        if prefix + "cuda" in states and self.device.type == "cuda":
            torch.cuda.set_rng_state(states[prefix + "cuda"], self.device)
        tracker = {k[len(prefix + "tracker/"):]: v for k, v in states.items()
                   if k.startswith(prefix + "tracker/")}
        if tracker:
            self.tracker.load_state_dict(tracker)
