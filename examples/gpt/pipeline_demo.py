"""The demo trainer's pipeline flags (``--pp``, ``--vpp``, ``--schedule``), their checks,
and the trainer they build (:mod:`examples.gpt.pipeline`), kept out of
``examples/train_gpt.py`` so the trainer only asks "which trainer, which step".

``--pp P`` cuts the GPT's layers into P stages (``--vpp V``: P·V virtual chunks, the
interleaved schedule); the world is ``tp × dp × pp`` ranks. Checks, all before torchrun
starts ranks (``--preflight``): layers divisible by the stages (and chunks), at least
``pp`` micro-batches for 1F1B and interleaved 1F1B (a multiple of ``pp`` for the latter),
``--vpp`` exactly with ``--schedule interleaved``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

import mc_groups as mg
from examples.gpt.config import GPTConfig, OptimizerConfig, ParallelLayout
from examples.gpt.pipeline import SCHEDULES, PipelineTrainer, build_pipeline, check_schedule
from examples.gpt.pipeline import pipeline_step as _pipeline_step

__all__ = ["add_pipeline_flags", "check_pipeline_flags", "pipeline_trainer"]


def add_pipeline_flags(parser: argparse.ArgumentParser) -> None:
    """``--pp``, ``--vpp``, ``--schedule`` on the demo's parser."""
    parser.add_argument(
        "--pp", type=int, default=1, help="pipeline stages (default 1: no pipeline)"
    )
    parser.add_argument(
        "--vpp",
        type=int,
        default=None,
        help="virtual chunks per pipeline stage (with --schedule interleaved)",
    )
    parser.add_argument(
        "--schedule",
        choices=SCHEDULES,
        default=None,
        help="pipeline schedule from torch.distributed.pipelining (default: 1f1b, or "
        "interleaved with --vpp)",
    )


def check_pipeline_flags(args: argparse.Namespace, model: GPTConfig, layout: ParallelLayout) -> str:
    """The schedule the flags choose; ``ValueError`` naming the flag and the fix when the
    pipeline cannot run (see module notes). Without ``--pp`` the pipeline flags must be
    absent."""
    pp, vpp = layout.pp, layout.vpp
    schedule = getattr(args, "schedule", None)
    if pp < 1:
        raise ValueError(f"--pp={pp} must be >= 1")
    if pp == 1:
        if vpp is not None or schedule is not None:
            raise ValueError(
                f"--vpp/--schedule (got vpp={vpp}, schedule={schedule}) need --pp > 1: "
                "they describe a pipeline; pass --pp 2 or more"
            )
        return "1f1b"
    if vpp is not None and vpp < 2:
        raise ValueError(f"--vpp={vpp} must be >= 2 (virtual chunks per stage), or left out")
    chosen = schedule or ("interleaved" if vpp is not None else "1f1b")
    try:
        check_schedule(chosen, layout, model)
    except ValueError as err:
        raise ValueError(f"--pp {pp} --schedule {chosen}: {err}") from None
    return chosen


def pipeline_trainer(
    cfg: GPTConfig,
    layout: ParallelLayout,
    opt: OptimizerConfig,
    pgc: mg.ProcessGroupCollection,
    full: dict[str, torch.Tensor],
    device: torch.device,
    *,
    schedule: str,
    global_batch: int,
) -> tuple[PipelineTrainer, Callable[[torch.Tensor], float]]:
    """This rank's pipeline trainer and its step (``tokens [B, s+1] → loss``)."""
    rows = global_batch // (layout.dp * layout.microbatches)
    trainer = build_pipeline(
        cfg, layout, opt, pgc, full, device, schedule=schedule, micro_batch_size=rows
    )
    return trainer, lambda tokens: _pipeline_step(trainer, tokens)
