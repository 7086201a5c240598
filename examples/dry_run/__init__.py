"""Dry runs at thousands of ranks: what each rank of a GPT training run holds and moves per
step, simulated in one process.

``python -m examples.dry_run --world-size N [--rank r | --all-stages] --tp … --pp …`` joins
torch's fake process-group backend as rank r of N (:mod:`examples.dry_run.world`), builds
the ``ProcessGroupCollection`` with ``mc_groups.initialize_model_parallel``, builds the
rank's pipeline stage of the GPT of :mod:`examples.gpt` from mc layers on the meta device
(no memory for weights), wraps it in mc DDP with the distributed optimizer (buffers on the
meta device too) and ``ShardedOptimizer`` (AdamW), runs a warm-up step and one recorded
step (:mod:`examples.dry_run.step`), and reports (:mod:`examples.dry_run.report`) the
params, the param/grad buffers, the optimizer state, the buckets and every collective of
the step, as a table and as JSON. ``docs/dry_run.md`` gives the closed-form memory formula
and the measured cost.

- :mod:`examples.dry_run.spec`: :class:`DryRunSpec` and its checks.
- :mod:`examples.dry_run.world`: :func:`fake_world`.
- :mod:`examples.dry_run.step`: :func:`build_stage`, :func:`run_step`, :func:`record_step`
  (shared with the real 4-rank run the tests compare against).
- :mod:`examples.dry_run.report`: :class:`RankReport` and :func:`describe_rank`.
- :mod:`examples.dry_run.run`: :func:`dry_run` (one rank), :func:`stage_ranks`.
- :mod:`examples.dry_run.cli`: the command line.
"""

from __future__ import annotations

from examples.dry_run.report import (
    BucketInfo,
    CollectiveInfo,
    MemoryInfo,
    ParamInfo,
    RankReport,
    describe_rank,
)
from examples.dry_run.run import dry_run, meta_batches, stage_ranks
from examples.dry_run.spec import DryRunSpec, llama70b
from examples.dry_run.step import StageModel, build_stage, record_step, run_step
from examples.dry_run.world import fake_world

__all__ = [
    "BucketInfo",
    "CollectiveInfo",
    "DryRunSpec",
    "MemoryInfo",
    "ParamInfo",
    "RankReport",
    "StageModel",
    "build_stage",
    "describe_rank",
    "dry_run",
    "fake_world",
    "llama70b",
    "meta_batches",
    "record_step",
    "run_step",
    "stage_ranks",
]
