"""A training step that fails part-way (an exception in a forward or a backward, raised on
every rank at the same point) leaves the DDP object usable: the steps that follow match
bit for bit a run in which the failed attempt never happened.

"Match", precisely: after the failure the run either retries the failed step's batch
(then its losses and final weights must equal the uninterrupted run's) or skips it (then
they must equal those of a run trained on the same batches without the failed one). Both
are exact (``==`` / ``torch.equal``): a failed attempt that left anything behind (grads in
the buffer, half-learned hook order, a reduction in flight, AdamW state) changes a bit.

Layout: TP=2 × DP=2 with the distributed optimizer, overlapped grad reduce-scatter (issued
from the backward hooks) and param all-gather (from the forward pre-hooks), 2 micro-batches,
AdamW. Failures are raised by hooks armed for one step:
- forward of micro-batch 2 (after micro-batch 1's forward and backward under ``no_sync``),
  in block 1's MLP; the retry's ``zero_grad_buffer()`` alone recovers;
- backward of the last micro-batch at the embedding (the last module the backward
  reaches), once the hooks have issued the reductions of the buckets holding the blocks
  (checked with the recorder):
  ``zero_grad_buffer()`` refuses (reductions in flight) and names ``discard_grad_sync()``,
  which drains them without issuing any collective;
- the same backward failure in the first iteration, when the hooks are still learning how
  often each param becomes ready: ``discard_grad_sync()`` forgets the partial counts.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import mc_groups as mg
from examples.gpt import ParallelLayout, Trainer, final_weights, parallelize, train_step
from integration_tests._common import CFG, batch, full_weights, model_parallel
from integration_tests._reliability import ADAMW
from mc_groups.testing import RankPools

LAYOUT = ParallelLayout(tp=2, dp=2, distributed_optimizer=True)
CPU = torch.device("cpu")


class InjectedFailure(RuntimeError):
    """The exception the armed hooks raise."""


class _Trigger:
    """A hook that raises on its ``calls``-th call after :meth:`arm` (once)."""

    def __init__(self) -> None:
        self.countdown = 0

    def arm(self, calls: int) -> None:
        self.countdown = calls

    def __call__(self, *_: Any) -> None:
        if self.countdown:
            self.countdown -= 1
            if not self.countdown:
                raise InjectedFailure("injected failure")


class Case(NamedTuple):
    """``steps``: the batches trained, in order; ``fail_at``: the step whose first attempt
    fails (in ``where``), then is retried (``retry``) or skipped."""

    name: str
    steps: tuple[int, ...]
    fail_at: int | None = None
    where: str = ""
    retry: bool = True


CASES = [
    Case("uninterrupted", (0, 1, 2, 3, 4)),
    Case("forward fails, retried", (0, 1, 2, 3, 4), fail_at=2, where="forward"),
    Case("backward fails, retried", (0, 1, 2, 3, 4), fail_at=2, where="backward"),
    Case("first backward fails, retried", (0, 1, 2, 3, 4), fail_at=0, where="backward"),
    Case("without batch 2", (0, 1, 3, 4)),
    Case("forward fails, skipped", (0, 1, 2, 3, 4), fail_at=2, where="forward", retry=False),
]


def _install(trainer: Trainer, where: str) -> _Trigger:
    trigger, module = _Trigger(), trainer.model.module
    if where == "forward":
        module.get_submodule("decoder.layers.1.mlp").register_forward_pre_hook(trigger)
    else:
        module.get_submodule("embedding").register_full_backward_pre_hook(trigger)
    return trigger


def _fail_once(trainer: Trainer, trigger: _Trigger, step: int) -> dict[str, Any]:
    trigger.arm(2)  # the 2nd call: micro-batch 2's forward, or the last micro-batch's backward
    with mg.record_collectives() as log:
        try:
            train_step(trainer, batch(step))
        except InjectedFailure:
            pass
        else:
            raise AssertionError("the armed hook did not fire")
    in_flight = [r.label for r in log if r.label.startswith("grad reduce")]
    refusal = ""
    try:
        trainer.model.zero_grad_buffer()
    except RuntimeError as err:
        refusal = str(err)
        with mg.record_collectives() as discard_log:
            trainer.model.discard_grad_sync()
        assert not discard_log, discard_log  # it waits; it issues nothing
    return {"issued_before_failure": in_flight, "refusal": refusal}


def _run(case: Case) -> dict[str, Any]:
    with model_parallel(LAYOUT) as pgc:
        trainer = parallelize(CFG, LAYOUT, ADAMW, pgc, full_weights(), CPU)
        trigger = _install(trainer, case.where) if case.fail_at is not None else _Trigger()
        losses: list[float] = []
        failure: dict[str, Any] = {}
        for step in case.steps:
            if step == case.fail_at and not failure:
                failure = _fail_once(trainer, trigger, step)
                if not case.retry:
                    continue
            losses.append(train_step(trainer, batch(step)))
        return {"losses": losses, "weights": final_weights(trainer), **failure}


def run_cases(cases: list[Case]) -> list[dict[str, Any]]:
    """Runs on every rank: each case from the same initial weights."""
    return [_run(case) for case in cases]


def _same_run(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["losses"] == b["losses"] and all(
        torch.equal(v, b["weights"][k]) for k, v in a["weights"].items()
    )


def test_failed_steps_leave_no_trace(rank_pools: RankPools) -> None:
    per_rank = rank_pools.get(4).run(run_cases, CASES)
    for results in per_rank:
        out = {case.name: r for case, r in zip(CASES, results, strict=True)}
        plain, skipped = out["uninterrupted"], out["without batch 2"]
        assert plain["losses"] != skipped["losses"][:3]  # batch 2 matters
        for name in ("forward fails, retried", "backward fails, retried"):
            assert _same_run(out[name], plain), (name, out[name]["losses"], plain["losses"])
        assert _same_run(out["first backward fails, retried"], plain)
        assert _same_run(out["forward fails, skipped"], skipped)

        forward, backward = out["forward fails, retried"], out["backward fails, retried"]
        assert forward["refusal"] == ""  # nothing in flight: zero_grad_buffer() recovers
        assert backward["issued_before_failure"], "no reduction was in flight at the failure"
        assert "still in flight" in backward["refusal"], backward["refusal"]
        assert "discard_grad_sync()" in backward["refusal"], backward["refusal"]
        first = out["first backward fails, retried"]
        assert not first["issued_before_failure"]  # the first iteration only learns
        assert "got no gradient in the first iteration" in first["refusal"], first["refusal"]
        assert "discard_grad_sync()" in first["refusal"], first["refusal"]
