"""Each rank's random number generator states, saved with a checkpoint.

What Megatron's checkpoints keep per rank: Python's ``random``, torch's CPU generator, the
CUDA device's generator (when the rank trains on one), and a tracker's named streams (mc's
:class:`mc_tp_layers.RNGStatesTracker`, e.g. the model-parallel stream dropout in TP
regions draws from). Restored only when the world size is the saved one: rank r gets rank
r's; at another size there is no rank to take them from and they are left as they are.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any, Protocol

import torch

from mc_train.checkpoint._folders import write_synced

__all__ = ["RNGTracker", "restore_rng", "save_rng"]


class RNGTracker(Protocol):
    """Named RNG streams that can be read and replaced (:class:`mc_tp_layers.RNGStatesTracker`
    and Megatron's ``CudaRNGStatesTracker`` have these)."""

    def get_states(self) -> dict[str, Any]:
        """Every stream's state."""
        ...

    def set_states(self, states: dict[str, Any]) -> None:
        """Replace the streams with ``states``."""
        ...


def save_rng(path: Path, device: torch.device, tracker: RNGTracker | None) -> None:
    """Write this rank's generator states to ``path`` (fsynced)."""
    state: dict[str, Any] = {"cpu": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if tracker is not None:
        state["tracker"] = tracker.get_states()
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    write_synced(path, buffer.getvalue())


def restore_rng(path: Path, device: torch.device, tracker: RNGTracker | None) -> None:
    """Restore the generator states :func:`save_rng` wrote to ``path``."""
    saved = torch.load(path, weights_only=True)
    torch.set_rng_state(saved["cpu"])
    if "python" in saved:
        version, internal, gauss = saved["python"]
        random.setstate((version, tuple(internal), gauss))
    if device.type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"], device)
    if tracker is not None and "tracker" in saved:
        tracker.set_states(saved["tracker"])
