"""The load-balancing (and z-) loss of a MoE model inside one training step.

The step's loss is ``ce + router_aux_loss_coef * aux + router_z_loss_coef * z`` with aux and z
GLOBAL statistics of the step (``mpcore.models.common.moe_loss``): every micro-batch's share needs
the step's expert loads C and row count R. With one micro-batch they come from its own forward
(one [E + 1] all-reduce over dp x cp); with several, ``MoeStep`` first runs a counting forward
of each micro-batch without gradients (one extra forward per micro-batch: the price of an
exact gradient, since micro-batch 1's gradient depends on micro-batch 2's loads).

    moe = MoeStep.start(model, module, inputs, state, forward)   # None for a dense model
    for inp in inputs:
        share = ce_share(inp) + moe.share()       # right after that micro-batch's forward
    moe.metrics() -> {"aux_loss", "z_loss", "expert_load", "dropped_tokens"} (global)

Nothing here waits for the device: the shares and the step's sums stay device tensors, and
``metrics()`` (a collective and a host copy) runs only when the trainer logs a step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mpcore.models.common.moe_loss import aux_share, global_counts, z_share
from mpcore.parallel.loss import sum_over_group
from mpcore.parallel.state import ParallelState


class MoeStep:
    """One step's MoE loss terms (module docstring). Build it with :meth:`start`."""

    def __init__(self, model, state: ParallelState, counts, rows):
        self.model, self.state, self.counts, self.rows = model, state, counts, rows
        self.aux = self.z = None  # () fp32 on the model's device, summed over micro-batches
        self.dropped = 0

    @classmethod
    def start(cls, model, inputs: list[dict], state: ParallelState,
              forward: Callable[[dict], None]) -> MoeStep | None:
        """None unless ``model`` (unwrapped) has MoE layers; with several micro-batches the
        counting forwards run here (``forward(inp)`` under no_grad)."""
        if not hasattr(model, "router_stats"):
            return None
        counts = rows = None
        if len(inputs) > 1:
            stats = []
            with torch.no_grad():
                for inp in inputs:
                    forward(inp)
                    stats.append(model.router_stats())
            counts, rows = global_counts(stats, state.dp_cp_group)
        return cls(model, state, counts, rows)

    def share(self) -> torch.Tensor:
        """This micro-batch's share of the weighted aux and z losses (after its forward)."""
        stats = self.model.router_stats()
        if self.counts is None:
            self.counts, self.rows = global_counts([stats], self.state.dp_cp_group)
        cfg = self.model.moe_cfg
        aux = aux_share(stats, self.counts, self.rows)
        z = z_share(stats, self.rows)
        # Started from the first share, not from a CPU zero (its copy to the GPU would sync).
        self.aux = aux.detach() if self.aux is None else self.aux + aux.detach()
        self.z = z.detach() if self.z is None else self.z + z.detach()
        self.dropped += stats.dropped
        return cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z

    def metrics(self) -> dict:
        """The step's global aux and z losses, tokens per expert (pooled over layers) and
        dropped tokens. Collective over dp x cp, and it waits for the device: call it when
        the step is logged (every rank at the same steps), not on every step."""
        if self.aux is None:
            raise RuntimeError("MoeStep.metrics() before any share(): no micro-batch ran")
        group = self.state.dp_cp_group
        return {"aux_loss": float(sum_over_group(self.aux, group)),
                "z_loss": float(sum_over_group(self.z, group)),
                "expert_load": [int(c) for c in self.counts.tolist()],
                "dropped_tokens": self.dropped}


def moe_record(metrics: dict) -> dict:
    """The step line's and metrics.jsonl's MoE fields of ``MoeStep.metrics()``: the global aux
    and z losses, dropped tokens, tokens per expert and their max over their mean (1 is a
    perfectly balanced router; ``mpcore.metrics``)."""
    load = metrics["expert_load"]
    mean = sum(load) / max(len(load), 1)
    return {"aux_loss": metrics["aux_loss"], "z_loss": metrics["z_loss"],
            "dropped_tokens": metrics["dropped_tokens"], "expert_load": load,
            "expert_imbalance": max(load) / mean if mean else None}
