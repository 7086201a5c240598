"""A short chaos run (``scripts/chaos.py``): the demo under plain ``torchrun --max-restarts 3``
meets three faults, one per attempt, and ends with the losses of a run that met none.

Localizes what the single-fault restart tests (``test_demo_torchrun.py``) cannot: faults in
a row, each restart resuming from what the previous attempts left (a damaged checkpoint
passed over, a checkpoint replaced by a later save, a partial one removed), and a stalled
worker found by the group's timeout rather than a closed connection. The plan is fixed
(not drawn from a seed) so the three kinds the SIGKILL tests do not cover are all here:

1. attempt 0: after the step-4 checkpoint is published, rank 1 truncates its shard in it
   and dies: attempt 1 passes over step 4 (named, damaged) and resumes from step 2;
2. attempt 1: rank 0 stalls after step 5: rank 1 fails at its next collective after the
   group's 10 s timeout (short, yet long enough that no healthy collective on a loaded
   CI machine runs into it); attempt 2 resumes from step 4 (re-saved by attempt 1);
3. attempt 2: rank 1 dies while the step-6 checkpoint is half written: attempt 3 resumes
   from step 4 and runs to step 8.

Reference (exact, ``==``): the same demo uninterrupted on the session's 2-rank pool. Cost:
4 attempts of 2 workers, each importing torch, plus the stall's timeouts.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch.distributed as dist

from examples import train_gpt
from examples.gpt.faults import Fault
from integration_tests import _prefetch
from integration_tests._scripts import load_script
from mc_groups.testing import RankPools

chaos = load_script("chaos")


def pool_demo(argv: list[str]) -> list[float]:
    """Runs on every rank of a pool: the demo's ``run`` (the uninterrupted reference)."""
    plan = train_gpt.plan(train_gpt.parse_args(argv), dist.get_world_size())
    return train_gpt.run(plan, io.StringIO()).losses


FAULTS = (Fault(0, 1, 4, "damage"), Fault(1, 0, 5, "stall"), Fault(2, 1, 6, "save"))
PLAN = chaos.ChaosPlan(FAULTS, steps=8, save_every=2, nproc=2)


def _chaos_run(out: Path) -> tuple[int, list[float]]:
    return chaos.run_chaos(PLAN, out, timeout_s=10.0)  # type: ignore[no-any-return]


# Started in the background when the session has collected this module (one torchrun job
# of four attempts): integration_tests/_prefetch.py.
PREFETCH = {"chaos run": _chaos_run}


def test_three_faults_in_a_row_end_with_the_uninterrupted_losses(
    rank_pools: RankPools, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    out, (code, losses) = _prefetch.take(request, "chaos run", tmp_path)
    log = (out / "chaos.log").read_text(encoding="utf-8", errors="replace")
    assert code == 0, log[-6000:]
    reports = chaos.fault_reports(out / "events.jsonl")
    struck = [(r.attempt, r.rank, r.step, r.kind) for r in reports]
    assert struck == [(f.attempt, f.rank, f.step, f.kind) for f in FAULTS]
    assert [r.resumed_from for r in reports] == [2, 4, 4]
    assert [len(r.passed_over) for r in reports] == [1, 0, 0]
    assert reports[0].passed_over[0].startswith("step-00000004: __1_0.distcp differs")
    assert "written by rank 1" in reports[0].passed_over[0]
    assert all(r.recovery_s is not None and r.recovery_s > 0 for r in reports)
    assert "ignored .step-00000006.partial" in log

    argv = [*chaos.demo_argv(PLAN), "--output", str(tmp_path / "reference")]
    reference = rank_pools.get(2).run(pool_demo, argv)[0]
    assert len(losses) == 8
    assert losses == reference
    metrics = json.loads((out / "chaos" / "metrics.json").read_text(encoding="utf-8"))
    assert metrics["resumed_step"] == 4
