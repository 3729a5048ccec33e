"""The math of splitting: collectives, TP/SP layers, CP split and attention, labels, losses."""

from parallel.context import ContextPlan, RankLayout, split_batch
from parallel.labels import LabelShifter, pack_padded, position_ids
from parallel.loss import global_mean_loss, global_valid_count, loss_share

__all__ = [
    "ContextPlan",
    "LabelShifter",
    "RankLayout",
    "global_mean_loss",
    "global_valid_count",
    "loss_share",
    "pack_padded",
    "position_ids",
    "split_batch",
]
