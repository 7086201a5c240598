"""What DDP knows about the current iteration's gradients (one record per wrapper), so that
the optimizer, ``scale_gradients``, the offload calls and ``finish_grad_sync`` can refuse a
call out of order with a message that says what happened this iteration."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IterationState"]


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
