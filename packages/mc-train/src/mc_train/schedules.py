r"""The pipeline schedules mc offers, what each can run, and how many forwards it keeps alive.

Three of ``torch.distributed.pipelining``'s schedules::

    name           torch class               chunks per rank   micro-batches M (P stages)
    "1f1b"         Schedule1F1B              1                 M >= P (P = 1 too)
    "gpipe"        ScheduleGPipe             1                 any M >= 1
    "interleaved"  ScheduleInterleaved1F1B   V >= 2            M >= P and P | M

Refused: the zero-bubble schedules (``ScheduleInterleavedZeroBubble``,
``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) split each backward into an input half and
a weight half computed with ``torch.autograd.grad``, which does not run the
post-accumulate-grad hooks that move grads into mc DDP's ``main_grad`` buffer (the weight
grads would never be reduced); ``ScheduleLoopedBFS`` runs every micro-batch of a chunk
before the next chunk, which is not offered either (no test holds it). With fewer
micro-batches than stages the 1F1B schedules cannot fill the pipeline (torch refuses it
too); the interleaved schedule runs micro-batches in rounds of ``P``.

Without a pipeline (``P = 1``) ``"1f1b"`` runs one stage, the whole model: each
micro-batch's forward and backward in turn, grads accumulating until the last
(Megatron's ``forward_backward_no_pipelining``), so one training loop serves every layout.

In flight: the chunk-forwards whose backward has not run yet, at the peak of a step, on
pipeline stage ``p`` (:func:`in_flight_forwards`; measured by :class:`InFlight`)::

    gpipe        M · V
    1f1b         min(M, P − p)
    interleaved  min(M · V, 2·(P − p − 1) + (V − 1)·r + 1),  r = M div (M div P)  (P when P | M)
"""

from __future__ import annotations

from dataclasses import dataclass

from mc_groups.argcheck import check_int
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["SCHEDULES", "InFlight", "check_schedule", "in_flight_forwards"]

SCHEDULES = ("1f1b", "gpipe", "interleaved")
"""The schedules :func:`mc_train.build_pipeline` offers (module notes)."""

_REFUSED = {
    "zbv": "ScheduleZBVZeroBubble",
    "zbvzerobubble": "ScheduleZBVZeroBubble",
    "interleavedzb": "ScheduleInterleavedZeroBubble",
    "interleavedzerobubble": "ScheduleInterleavedZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
_WHY_ZB = (
    "splits each backward into input and weight halves computed with torch.autograd.grad, "
    "which skips the post-accumulate-grad hooks mc DDP moves grads into main_grad with (the "
    "weight grads would never be reduced)"
)


def check_schedule(schedule: str, *, pp: int, chunks: int, microbatches: int) -> None:
    """``InputValueError`` naming the fix when ``schedule`` cannot run ``chunks`` chunks per
    rank on ``pp`` pipeline ranks with ``microbatches`` micro-batches (module notes). Pure
    arithmetic: a trainer calls it before starting ranks."""
    if not isinstance(schedule, str):
        raise InputTypeError(f"schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
    key = schedule.lower().replace("_", "").replace("-", "")
    if key in _REFUSED or "zerobubble" in key:
        which = _REFUSED.get(key, schedule)
        raise InputValueError(
            f"schedule={schedule!r} ({which}) is not offered: it {_WHY_ZB}; use one of "
            f"{', '.join(SCHEDULES)}"
        )
    if schedule not in SCHEDULES:
        raise InputValueError(f"schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    check_int("pp", pp, minimum=1)
    check_int("chunks", chunks, minimum=1)
    m = check_int("microbatches", microbatches, minimum=1)
    if pp < 2 and schedule != "1f1b":
        raise InputValueError(
            f"schedule={schedule!r} needs pp >= 2 pipeline ranks (got pp={pp}); use '1f1b', "
            "which on one stage runs the micro-batches one after another"
        )
    if schedule == "interleaved" and chunks < 2:
        raise InputValueError(
            f"schedule='interleaved' runs several chunks per rank (got {chunks}); give each "
            "rank V >= 2 chunks (global stages p, p + pp, ...), or use '1f1b'"
        )
    if schedule != "interleaved" and chunks != 1:
        raise InputValueError(
            f"schedule={schedule!r} runs one chunk per rank (got {chunks}); use "
            "schedule='interleaved' for several"
        )
    if schedule != "gpipe" and m < pp:
        raise InputValueError(
            f"microbatches={m} < pp={pp}: the {schedule} schedule fills every stage with a "
            f"micro-batch before its first backward (torch.distributed.pipelining refuses "
            f"fewer micro-batches than stages); use at least {pp}, or schedule='gpipe'"
        )
    if schedule == "interleaved" and m % pp:
        raise InputValueError(
            f"microbatches={m} is not a multiple of pp={pp}: the interleaved schedule runs "
            f"micro-batches in rounds of pp; use a multiple of {pp}"
        )


def in_flight_forwards(schedule: str, stage: int, stages: int, microbatches: int, vpp: int) -> int:
    """Chunk-forwards alive at the peak on pipeline stage ``stage`` of ``stages``, with
    ``microbatches`` micro-batches and ``vpp`` chunks per rank (module notes; 1 without a
    pipeline)."""
    m, p, v = microbatches, stages, vpp
    if p == 1:
        return 1
    if schedule == "gpipe":
        return m * v
    if schedule == "1f1b":
        return min(m, p - stage)
    if schedule == "interleaved":
        per_round = m // max(1, m // p)  # torch's rounds of micro-batches (p when p | m)
        return min(m * v, 2 * (p - stage - 1) + (v - 1) * per_round + 1)
    raise InputValueError(f"schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")


@dataclass
class InFlight:
    """Chunk-forwards of this rank whose backward has not run yet: ``now``, and ``peak``,
    the most at once since the last ``reset()`` (the activations a schedule keeps alive;
    :func:`in_flight_forwards` predicts the peak)."""

    now: int = 0
    peak: int = 0

    def reset(self) -> None:
        """Start counting a new step."""
        self.now = self.peak = 0

    def forward(self) -> None:
        """A chunk's forward of one micro-batch ran."""
        self.now += 1
        self.peak = max(self.peak, self.now)

    def backward(self) -> None:
        """A chunk's backward of one micro-batch ran."""
        self.now -= 1
