"""Deprecated alias of :mod:`mc_tp_layers.sharded_state` (DTensor views for
``torch.distributed.checkpoint``), kept for one release: import from
``mc_tp_layers.sharded_state`` instead. The old name read like
``mc_tp_layers.random.checkpoint`` (activation recompute), Megatron's ``checkpoint``."""

from __future__ import annotations

import warnings

from mc_tp_layers.sharded_state import gtp_sharded_tensor, sharded_state_dict_of, tp_sharded_tensor

__all__ = ["gtp_sharded_tensor", "sharded_state_dict_of", "tp_sharded_tensor"]

warnings.warn(
    "mc_tp_layers.checkpoint is renamed mc_tp_layers.sharded_state; the old name goes in "
    "the next release",
    DeprecationWarning,
    stacklevel=2,
)
