r"""Resumable checkpoints for any model whose params carry mc's attributes, at any
TP × PP × DP layout (``torch.distributed.checkpoint``, resharded on load).

- :class:`Checkpointer`: owns the folder, the save interval and the retention;
  ``save(step)`` publishes ``folder/step-NNNNNNNN`` atomically (every rank's part written,
  then a manifest of sizes and SHA-256, then a rename), ``load("auto")`` resumes from the
  newest intact one, passing over damaged ones, with the verdict agreed by every rank.
- :func:`find_checkpoint`: that verdict alone (before the model is built), as :class:`Found`.
- :class:`RunState`: ``trainer.json``, the step and the run's settings and state.
- :func:`save_state` / :func:`load_state` / :func:`model_sharded_state_dict`: the DCP state
  dict of a rank's chunks and ``ShardedOptimizer`` (:mod:`mc_train.checkpoint.state`:
  full-shape keys, tied copies written once).
"""

from __future__ import annotations

from mc_train.checkpoint.checkpointer import Checkpointer, CheckpointWriteError, Resumed
from mc_train.checkpoint.folders import COMPLETE
from mc_train.checkpoint.resume import Found, ResumeError, find_checkpoint
from mc_train.checkpoint.rng import RNGTracker
from mc_train.checkpoint.run_state import STATE_FILE, RunState
from mc_train.checkpoint.state import load_state, model_sharded_state_dict, save_state

__all__ = [
    "COMPLETE",
    "STATE_FILE",
    "CheckpointWriteError",
    "Checkpointer",
    "Found",
    "RNGTracker",
    "ResumeError",
    "Resumed",
    "RunState",
    "find_checkpoint",
    "load_state",
    "model_sharded_state_dict",
    "save_state",
]
