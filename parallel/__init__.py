"""The math of splitting: collectives, TP/SP layers, CP split and attention, labels, losses."""

if __name__ != "mpcore.parallel":  # reached by the bare name; mpcore/_names.py says why
    import runpy
    from pathlib import Path

    runpy.run_path(str(Path(__file__).parents[1] / "mpcore" / "_names.py"))["bare_import"](
        __name__, __path__)
else:
    from mpcore.parallel.context import ContextPlan, RankLayout, split_batch
    from mpcore.parallel.labels import LabelShifter, MtpTargets, pack_padded, position_ids
    from mpcore.parallel.loss import global_mean_loss, global_valid_count, loss_share

__all__ = [
    "ContextPlan",
    "LabelShifter",
    "MtpTargets",
    "RankLayout",
    "global_mean_loss",
    "global_valid_count",
    "loss_share",
    "pack_padded",
    "position_ids",
    "split_batch",
]
