"""What DDP knows about the current iteration: how often each param of a bucket group became
ready (the counts behind Megatron's ``per_param_grad_ready_counts`` and
``golden_per_param_grad_ready_counts``), and one record per wrapper of what happened to this
iteration's gradients (so that the optimizer, ``scale_gradients``, the offload calls and
``finish_grad_sync`` can refuse a call out of order with a message that says what happened).

Ready counts: a bucket group dispatches its reduction from the backward hook that makes this
iteration's counts equal the golden counts (those of the first iteration). Megatron keeps
both as dicts keyed by param; every update then hashes the param twice, and a tensor's hash
is a Python call. Here each param has a fixed slot (its position in the group) and the
counts are a list of ints: the hook's update is two list operations, the comparison runs
only once the number of ready gradients reaches the golden total, and the dicts Megatron's
code reads are built from the lists when asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from mc_groups.errors import InputValueError

__all__ = ["IterationState", "ReadyCounts"]

Param = torch.nn.Parameter


class ReadyCounts:
    """Per-slot ready counts of one bucket group for this iteration, and the golden ones.

    ``counts[i]``: how often ``params[i]`` became ready this iteration (last microbatch);
    ``ready``: their sum. ``golden`` / ``golden_total``: the counts the first iteration
    learned (None / -1 until then), which later iterations must reach to dispatch.
    """

    __slots__ = ("counts", "golden", "golden_total", "params", "ready", "slots")

    def __init__(self, params: Sequence[Param]) -> None:
        self.params: list[Param] = list(params)
        self.slots: dict[Param, int] = {p: i for i, p in enumerate(self.params)}
        self.counts: list[int] = [0] * len(self.params)
        self.ready = 0
        self.golden: list[int] | None = None
        self.golden_total = -1

    def clear(self) -> None:
        """Forget this iteration's counts."""
        self.counts = [0] * len(self.params)
        self.ready = 0

    def learn(self) -> bool:
        """Make this iteration's counts the golden ones when any param became ready (the
        first iteration's reset); False (nothing learned) otherwise."""
        if not self.ready:
            return False
        self.golden, self.golden_total = self.counts, self.ready
        self.counts = [0] * len(self.params)
        self.ready = 0
        return True

    def missing(self) -> list[Param]:
        """The params that have not become ready this iteration, in slot order."""
        return [p for p, n in zip(self.params, self.counts, strict=True) if not n]

    def off(self) -> list[tuple[Param, int, int]]:
        """``(param, seen, expected)`` for each param whose count differs from the golden."""
        golden = self.golden or [0] * len(self.params)
        return [
            (p, n, g) for p, n, g in zip(self.params, self.counts, golden, strict=True) if n != g
        ]

    def not_dispatched(self, group: str, names: Mapping[Param, str]) -> str:
        """Why ``finish_grad_sync`` finds no reduction the hooks started: which params (up
        to 3, named) have not become ready as often as in the first iteration."""
        off = self.off()
        detail = ", ".join(f"'{names.get(p, '<unnamed>')}' {n}/{g}" for p, n, g in off[:3])
        return (
            f"{group}: finish_grad_sync() but the reduction was never started: "
            f"{len(off)} of {len(self.params)} params have not become ready as often as in "
            f"the first iteration (seen/expected: {detail}). Finish the backward of the last "
            "microbatch (outside no_sync()) first, and call zero_grad_buffer() once per "
            "iteration"
        )

    def as_dict(self, golden: bool = False) -> dict[Param, int]:
        """This iteration's (or the golden) counts as Megatron's dict: param → count, params
        with a zero count left out (a snapshot; changing it changes nothing)."""
        values = (self.golden or []) if golden else self.counts
        return {p: n for p, n in zip(self.params, values, strict=False) if n}

    def assign(self, counts: Mapping[Param, int], golden: bool = False) -> None:
        """Set this iteration's (or the golden) counts from Megatron's dict (params that are
        not in this group are refused)."""
        values = [0] * len(self.params)
        for param, count in counts.items():
            slot = self.slots.get(param)
            if slot is None:
                raise InputValueError(
                    f"the ready counts name a param (shape {tuple(param.shape)}) that is not in "
                    "this bucket group; pass counts of the group's own params"
                )
            values[slot] = int(count)
        if golden:
            self.golden, self.golden_total = values, sum(values)
        else:
            self.counts, self.ready = values, sum(values)


@dataclass
class IterationState:
    """What DDP knows about this iteration's gradients; ``zero_grad_buffer`` starts the
    next iteration (``generation + 1``, every other field cleared)."""

    generation: int = 0
    """``zero_grad_buffer()`` calls so far: an optimizer compares it to refuse a second
    step on the same gradients."""
    scaled_by: str | None = None
    """The factor ``scale_gradients`` applied this iteration (shown in the error)."""
    accumulated: bool = False
    """A backward hook added a gradient this iteration."""
    finalized: bool = False
    """``mark_grads_finalized()`` was called (``finalize_model_grads`` ran)."""
    discarded: bool = False
    """``offload_grad_buffers()`` dropped gradients this iteration had accumulated."""
    force_all_reduce: bool | None = None
    """How ``finish_grad_sync`` completed this iteration (None: not yet)."""

    def next(self) -> None:
        """Start the next iteration."""
        self.generation += 1
        self.scaled_by, self.accumulated, self.finalized, self.discarded = None, False, False, False
        self.force_all_reduce = None
