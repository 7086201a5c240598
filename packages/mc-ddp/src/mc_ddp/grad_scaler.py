"""Dynamic loss scaling for fp16 training: Megatron-Core's ``DynamicGradScaler`` with
``torch.amp.GradScaler``'s semantics by default.

fp16 holds magnitudes up to 65504 and down to ~6e-8 (6e-5 normal): small gradients
underflow to zero. Scaling the loss by ``S`` scales every gradient by ``S`` (backward is
linear), which moves them into range; the optimizer step divides by ``S`` again (in fp32).
When a gradient overflowed (inf or NaN anywhere, on any rank holding a piece of the step)
the step is skipped and ``S`` shrinks; after ``growth_interval`` clean steps in a row it
grows::

    found_inf:  hysteresis_tracker -= 1; growth_tracker = 0
                if hysteresis_tracker <= 0:  S ← max(S · backoff_factor, min_scale)
    clean:      growth_tracker += 1
                if growth_tracker == growth_interval:
                    growth_tracker = 0; hysteresis_tracker = hysteresis
                    S ← S · growth_factor   (kept when that is not finite, as torch)

With the defaults (``hysteresis=1``, ``min_scale=0``) this is ``torch.amp.GradScaler``:
init 2**16, ×2 every 2000 clean steps, ×0.5 at every overflow. bf16 and fp32 have fp32's
exponent range and need no scaler (:class:`~mc_ddp.ShardedOptimizer` refuses one on bf16
params).

The scaler holds host numbers only (no tensor, no device synchronisation); the overflow
flag is found and agreed by :class:`~mc_ddp.ShardedOptimizer` (see its docs).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mc_groups.argcheck import check_int, check_real, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["DynamicGradScaler"]

_STATE_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")


class DynamicGradScaler:
    """The loss scale of an fp16 run and its update rule (module notes).

    Megatron-Core's argument names and order; the defaults give ``torch.amp.GradScaler``'s
    behaviour (Megatron's own defaults come from its command line:
    ``initial_loss_scale=2**32``, ``min_loss_scale=1``, ``loss_scale_window=1000``,
    ``hysteresis=2``).

    Args:
        initial_scale: the first scale ``S`` (> 0, finite).
        min_scale: the floor of a backoff (>= 0; 0: none, as torch).
        growth_factor: > 1.
        backoff_factor: in (0, 1).
        growth_interval: clean steps in a row before a growth (>= 1).
        hysteresis: overflows tolerated before a backoff (>= 1; 1: back off at every one).
    """

    def __init__(
        self,
        initial_scale: float = 2.0**16,
        min_scale: float = 0.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
    ) -> None:
        scale = check_real("initial_scale", initial_scale, positive=True, allow_zero=False)
        floor = check_real("min_scale", min_scale, positive=True)
        if floor > scale:
            raise InputValueError(
                f"min_scale={min_scale} is above initial_scale={initial_scale}; the floor must "
                "be at most the first scale"
            )
        growth = check_real("growth_factor", growth_factor)
        if not growth > 1.0:
            raise InputValueError(f"growth_factor={growth_factor} must be > 1 (e.g. 2.0)")
        backoff = check_real("backoff_factor", backoff_factor)
        if not 0.0 < backoff < 1.0:
            raise InputValueError(f"backoff_factor={backoff_factor} must be in (0, 1) (e.g. 0.5)")
        self.min_scale = floor
        self.growth_factor = growth
        self.backoff_factor = backoff
        self.growth_interval = check_int("growth_interval", growth_interval, minimum=1)
        self.hysteresis = check_int("hysteresis", hysteresis, minimum=1)
        self._scale = scale
        self._growth_tracker = 0
        self._hysteresis_tracker = self.hysteresis

    @property
    def scale(self) -> float:
        """The current loss scale ``S``."""
        return self._scale

    @property
    def inv_scale(self) -> float:
        """``1 / S``."""
        return 1.0 / self._scale

    def update(self, found_inf: bool) -> None:
        """One step's outcome: back off after an overflow, grow after ``growth_interval``
        clean steps (module notes). ``found_inf`` must be the same on every rank (the
        optimizer passes the agreed flag)."""
        if not isinstance(found_inf, bool):
            raise InputTypeError(f"found_inf={found_inf!r} must be a bool")
        if found_inf:
            self._growth_tracker = 0
            self._hysteresis_tracker -= 1
            if self._hysteresis_tracker <= 0:
                self._scale = max(self._scale * self.backoff_factor, self.min_scale)
            return
        self._growth_tracker += 1
        if self._growth_tracker == self.growth_interval:
            self._growth_tracker = 0
            self._hysteresis_tracker = self.hysteresis
            grown = self._scale * self.growth_factor
            if math.isfinite(grown):
                self._scale = grown

    def state_dict(self) -> dict[str, Any]:
        """``{"scale", "growth_tracker", "hysteresis_tracker"}`` (Megatron's keys)."""
        return {
            "scale": self._scale,
            "growth_tracker": self._growth_tracker,
            "hysteresis_tracker": self._hysteresis_tracker,
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved (a tensor scale, as Megatron saves it, is
        read as its value); everything is checked before anything changes."""
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(
                f"state_dict must be the mapping DynamicGradScaler.state_dict() returned, got "
                f"{type_name(state_dict)}"
            )
        missing = [k for k in _STATE_KEYS if k not in state_dict]
        if missing:
            raise InputValueError(f"state_dict has no {missing}: pass what state_dict() returned")
        raw = state_dict["scale"]
        value = float(raw.item()) if hasattr(raw, "item") else raw
        scale = check_real("state_dict['scale']", value, positive=True, allow_zero=False)
        growth = check_int("state_dict['growth_tracker']", state_dict["growth_tracker"], minimum=0)
        tracker = state_dict["hysteresis_tracker"]
        hysteresis = check_int("state_dict['hysteresis_tracker']", tracker, minimum=-(2**31))
        self._scale, self._growth_tracker, self._hysteresis_tracker = scale, growth, hysteresis

    def __repr__(self) -> str:
        return (
            f"DynamicGradScaler(scale={self._scale}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale})"
        )
