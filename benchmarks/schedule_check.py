"""Cost of mc_groups' opt-in collective-schedule check on a DDP training step, 2 gloo ranks.

The model, batch, bucket size and step are ``benchmarks/ddp_step.py``'s (an MLP of 3 blocks
``Linear(1024 → 4096) → ReLU → Linear(4096 → 1024)``, 25.2 M fp32 params, batch 64 per rank,
25 MiB buckets, one thread per rank). Each mc variant is built once and its step is timed
twice per round, once without and once inside ``mc_groups.check_collective_schedule()``:
the same object, the same work, only the switch differs, and the rounds interleave them so
load from other processes hits both alike.

Reported per variant: median step without and with the check (the slower rank's median),
their ratio, the collectives one step issues (each one is preceded by an 8-byte
fingerprint all-gather when checking) and whether the ratio meets the target (≤ 1.05 ×
for every variant). Prints a Markdown table; exits 1 when a target is missed. From the
repository root::

    python -m benchmarks.schedule_check [--iters N] [--warmup N]
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

import mc_groups as mg

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from benchmarks._common import Step

TARGET = 1.05


def _variants(pgc: mg.ProcessGroupCollection) -> dict[str, Step]:
    ddp_step = importlib.import_module("benchmarks.ddp_step")
    bucket = ddp_step.BUCKET_ELEMENTS
    built: dict[str, tuple[Step, Any]] = {
        "mc DDP (overlap)": ddp_step._mc_variant(pgc, overlap_grad_reduce=True, bucket_size=bucket),
        "mc DDP (no overlap)": ddp_step._mc_variant(pgc),
        "mc DDP (distributed optimizer)": ddp_step._mc_variant(
            pgc,
            step_dispatch=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
            use_distributed_optimizer=True,
            bucket_size=bucket,
        ),
    }
    return {name: step for name, (step, _) in built.items()}


def _checked(step: Step) -> Step:
    def run() -> None:
        with mg.check_collective_schedule():
            step()

    return run


def _collectives_per_step(step: Step) -> int:
    with mg.record_collectives() as log:
        step()
    return len(log)


def _measure(warmup: int, iters: int) -> dict[str, Any]:
    """On every rank: time each variant with and without the check."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel()
    try:
        variants = _variants(pgc)
        steps: dict[str, Step] = {}
        for name, step in variants.items():
            steps[f"{name}|off"] = step
            steps[f"{name}|on"] = _checked(step)
        medians = _common.interleaved_medians(steps, warmup, iters)
        # counted after the first iterations, whose extra gathers and learning are one-offs
        counts = {name: _collectives_per_step(step) for name, step in variants.items()}
        return {"medians": medians, "collectives": counts}
    finally:
        mg.destroy_model_parallel(pgc)


def _table(per_rank: list[dict[str, Any]]) -> tuple[list[str], bool]:
    slowest = _common.slowest_medians(per_rank)
    lines = [
        "| variant | collectives per step | median step, check off (ms) | check on (ms) | "
        f"ratio | target ≤ {TARGET} |",
        "|---|---:|---:|---:|---:|---|",
    ]
    ok = True
    for name, count in per_rank[0]["collectives"].items():
        off, on = slowest[f"{name}|off"], slowest[f"{name}|on"]
        ratio = on / off
        met = ratio <= TARGET
        ok &= met
        lines.append(
            f"| {name} | {count} | {off * 1e3:.1f} | {on * 1e3:.1f} | {ratio:.3f} | "
            f"{'met' if met else 'MISSED'} |"
        )
    return lines, ok


def main() -> int:
    args = _common.parse_arguments(__doc__, iters=15, iters_help="timed rounds (>= 10)", warmup=2)
    with _common.rank_pool(2) as pool:
        per_rank = pool.run(
            _common.rank_worker("benchmarks.schedule_check"), args.warmup, args.iters
        )
    print("25.2 M-param MLP (benchmarks/ddp_step.py), batch 64 per rank, 2 gloo ranks, 1 thread")
    lines, ok = _table(per_rank)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
