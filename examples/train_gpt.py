"""The mc demo trainer: a small GPT learns the opening of *Alice in Wonderland* on CPU ranks.

Run it with ``hatch run demo`` (``torchrun --standalone --nproc-per-node 4 -m
examples.train_gpt``): 4 gloo ranks, TP=2 × DP=2, sequence parallelism, the distributed
optimizer, grad reduction overlapped with backward and the param all-gather with forward,
the whole model's grad norm clipped to 1.0 (``--clip-grad``). Rank 0 shows a progress bar
(step, loss, grad norm before clipping, tokens/s), then the final loss, the throughput, a
parity line (the first steps' losses and grad norms against the same GPT trained, and
clipped, by plain PyTorch on one process) and the folder holding ``loss.png`` and
``metrics.json``.

Flags change the layout (``--tp``, ``--dp``, ``--pp`` with ``--schedule`` and ``--vpp``,
``--[no-]sequence-parallel``, ``--[no-]distributed-optimizer``), the run (``--steps``,
``--output``, ...) and the model (``--hidden-size``, ...); an impossible layout is reported
before any rank communicates (``--tp 1`` turns the default sequence parallelism off). Pipeline
parallelism: docs/pipeline.md.

The pieces live in :mod:`examples.gpt`: the flags in :mod:`examples.gpt.cli`, the run in
:mod:`examples.gpt.loop`, what it prints and writes in :mod:`examples.gpt.report`.

On GPUs: ``torchrun --nproc-per-node N -m examples.train_gpt --backend nccl --tp T --dp D``
(T × D = N): each rank trains on ``cuda:LOCAL_RANK`` over NCCL; the parity reference still
runs on rank 0's CPU. gloo (CPU) stays the default. On several nodes: one ``torchrun
--nnodes M --nproc-per-node N --rdzv-backend c10d --rdzv-endpoint HOST:PORT`` per node
(docs/multi_node.md); the trainer only reads the world torchrun built.

Checkpoints (:class:`mc_train.checkpoint.Checkpointer`): ``--save-dir DIR --save-every N`` publishes
``DIR/step-…`` every N steps and after the last one (model, optimizer state, step, every
loss so far, RNG states); ``--resume auto`` continues from the newest complete one in
``--save-dir`` (or starts fresh), ``--resume PATH`` from that one, at this run's layout.
Under ``torchrun --max-restarts K … --resume auto`` a run that lost a rank restarts from its
last complete checkpoint, and its ``metrics.json`` equals an uninterrupted run's (no extra
environment: every attempt joins in a key space of its own, :mod:`mc_groups.elastic`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

import mc_groups as mg
from examples.gpt.cli import BACKENDS, DemoRun, device_for, plan
from examples.gpt.cli import parse_args as _parse_args
from examples.gpt.loop import run
from examples.gpt.report import DemoResult
from mc_train.checkpoint import ResumeError

__all__ = [
    "BACKENDS",
    "DemoResult",
    "DemoRun",
    "device_for",
    "main",
    "parse_args",
    "plan",
    "run",
]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The demo's flags (see ``--help``)."""
    return _parse_args(argv, description=__doc__.split("\n\n")[0] if __doc__ else None)


def _checked(args: argparse.Namespace, world_size: int, rank: int) -> DemoRun | None:
    """The plan, or None after rank 0 printed why the flags cannot work."""
    try:
        return plan(args, world_size)
    except ValueError as err:
        if rank == 0:  # every rank finds the same error; one report is enough
            print(f"train_gpt: error: {err}", file=sys.stderr)
        return None


def _local_cuda_device(rank: int) -> torch.device | None:
    """``cuda:LOCAL_RANK``, made current; None after printing why there is none."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local < count:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        return device
    print(
        f"train_gpt: error: rank {rank}: --backend nccl needs a CUDA device per rank on each "
        f"node, but LOCAL_RANK={local} and {count} device(s) are visible; start at most "
        f"{count} ranks per node (torchrun --nproc-per-node) or use --backend gloo",
        file=sys.stderr,
    )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point under torchrun: validate, join the world (gloo, or NCCL on
    ``cuda:LOCAL_RANK``), train, report (or, with ``--preflight N``, only validate for N
    ranks)."""
    args = parse_args(argv)
    if args.preflight is not None:
        return 0 if _checked(args, args.preflight, rank=0) else 2
    if "WORLD_SIZE" not in os.environ:
        print("train_gpt: run under torchrun, e.g. `hatch run demo`", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    demo = _checked(args, int(os.environ["WORLD_SIZE"]), rank)
    if demo is None:
        return 2
    device = _local_cuda_device(rank) if demo.backend == "nccl" else None
    if demo.backend == "nccl" and device is None:
        return 2
    torch.set_num_threads(1)
    # A key space of this attempt's own in torchrun's store: restarts work with the store
    # shared (torch's default) too (mc_groups.elastic).
    timeout = timedelta(seconds=args.timeout)
    mg.elastic.init_process_group(demo.backend, timeout=timeout, device_id=device)
    try:
        run(demo)
    except ResumeError as err:
        if rank == 0:  # every rank raised the same error
            print(f"train_gpt: error: {err}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
