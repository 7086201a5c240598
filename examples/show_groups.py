"""Build a ProcessGroupCollection on 4 CPU ranks and print every rank's groups.

Run with ``hatch run demo`` (which calls ``torchrun --standalone --nproc-per-node 4``).
Prints, from rank 0, the group each rank belongs to for every role, then checks one
all-reduce per group against its expected sum.
"""

from __future__ import annotations

import argparse
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

import mc_groups as mg


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    return parser.parse_args()


def main() -> None:
    args = _parse()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    pgc = mg.initialize_model_parallel(args.tp, args.pp)
    rows = {name: mg.group_ranks(group) for name, group in pgc.items()}
    table = cast(
        list[dict[str, tuple[int, ...]]],
        mg.all_gather_objects(rows, pgc.require("world", "show_groups")),
    )
    checks = []
    for _, group in pgc.items():
        t = torch.tensor([float(dist.get_rank())])
        mg.all_reduce(t, group)
        checks.append(t.item() == float(sum(mg.group_ranks(group))))
    if dist.get_rank() == 0:
        print(repr(pgc))
        for name in rows:
            per_rank = "  ".join(f"r{r}:{list(t.get(name, ()))}" for r, t in enumerate(table))
            print(f"{name:>18}  {per_rank}")
    ok = mg.all_gather_objects(all(checks), pgc.require("world", "show_groups"))
    if dist.get_rank() == 0:
        print(f"all-reduce over every group matched the sum of its ranks: {all(ok)}")
    mg.destroy_model_parallel(pgc)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
