"""Stand-in for launch/pretrain.py under torchrun: proves the allocation, rendezvous and gloo.

    torchrun ... allreduce_probe.py OUT_DIR

Each rank all-reduces (rank + 1) over gloo and writes OUT_DIR/rank<R>.json with its global and
local rank, world size, the Slurm node it ran on (SLURMD_NODENAME) and the reduced value, which
must be world * (world + 1) / 2.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out_dir = Path(sys.argv[1])
    dist.init_process_group("gloo")
    value = torch.tensor([float(dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(value)
    record = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node": os.environ.get("SLURMD_NODENAME"),
        "sum": value.item(),
    }
    (out_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
