"""The dry run of one rank: join a fake world, build the rank's stage on the meta device,
run a warm-up step and a recorded step, report.

Why two steps: mc DDP learns in its first iteration how often each param's grad becomes
ready (later iterations dispatch a bucket's reduction as soon as its last grad arrives), and
the distributed optimizer's param all-gathers of a step run in the next step's forward. The
recorded second step is what every later step of a run does.
"""

from __future__ import annotations

import time

import torch

from examples.dry_run.activations import measure_activations
from examples.dry_run.report import RankReport, describe_rank
from examples.dry_run.spec import DryRunSpec
from examples.dry_run.step import Batch, build_stage, record_step, run_step
from examples.dry_run.world import fake_world
from mc_groups.rank_generator import RankGenerator

__all__ = ["META", "dry_run", "meta_batches", "stage_ranks"]

META = torch.device("meta")


def meta_batches(spec: DryRunSpec) -> list[Batch]:
    """One ``(tokens, labels)`` pair of shape ``[b, s/cp]`` per micro-batch, on meta."""
    shape = (spec.micro_batch_size, spec.local_seq_length)
    tokens = torch.zeros(shape, dtype=torch.long, device=META)
    return [(tokens, tokens) for _ in range(spec.layout.microbatches)]


def stage_ranks(spec: DryRunSpec) -> list[int]:
    """One rank per pipeline stage: the ranks of rank 0's pipeline group (TP, CP and DP
    rank 0 of every stage), in stage order."""
    lay = spec.layout
    generator = RankGenerator(lay.tp, 1, lay.dp, lay.pp, lay.cp, gtp_remat=lay.gtp_remat)
    return next(ranks for ranks in generator.get_ranks("pp") if 0 in ranks)


def dry_run(spec: DryRunSpec, rank: int, timings: dict[str, float] | None = None) -> RankReport:
    """What ``rank`` of ``spec.world_size`` holds and moves per step (see the module notes).

    Runs in this process on torch's fake backend; the process must not have a default
    process group of its own (see :func:`~examples.dry_run.world.fake_world`). ``timings``,
    when given, receives the seconds of each part: ``groups`` (joining the world and
    ``initialize_model_parallel``), ``build`` (model, DDP, optimizer), ``activations`` (a
    measured forward, :mod:`examples.dry_run.activations`), ``warm-up step``,
    ``recorded step``, ``report`` and ``teardown`` (destroying the world and its groups).
    """
    spec.check()
    clock = _Clock(timings)
    with fake_world(rank, spec.world_size):
        pgc = spec.layout.initialize_groups()
        clock.lap("groups")
        stage = build_stage(spec, pgc, META)
        batches = meta_batches(spec)
        clock.lap("build")
        activations = measure_activations(stage, batches[0])
        clock.lap("activations")
        run_step(stage, batches)
        clock.lap("warm-up step")
        records = record_step(stage, batches)
        clock.lap("recorded step")
        report = describe_rank(stage, records, activations)
        clock.lap("report")
    clock.lap("teardown")
    return report


class _Clock:
    """Lap times into an optional dict."""

    def __init__(self, into: dict[str, float] | None) -> None:
        self._into = into
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        if self._into is not None:
            self._into[name] = now - self._last
        self._last = now
