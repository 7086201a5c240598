"""mc-train: what a training run needs around mc's parts, for any model.

- :mod:`mc_train.split`: :func:`split_model` cuts a whole model into pipeline stages by
  module names (:func:`decoder_stages` names them for a decoder), keeping the model's class,
  ``forward`` and parameter names.
- :mod:`mc_train.pipeline`: :func:`build_pipeline` wraps this rank's chunks in mc DDP and
  drives them with a ``torch.distributed.pipelining`` schedule (:mod:`mc_train.schedules`:
  1F1B, GPipe, interleaved 1F1B); :meth:`Pipeline.forward_backward` runs a step's
  micro-batches and ``finalize_model_grads``.
- :mod:`mc_train.stages` / :mod:`mc_train.loss`: how a stage calls its chunk, and the
  per-token losses the pipeline reduces.
- :mod:`mc_train.checkpoint`: resumable checkpoints at any TP × PP × DP layout, written
  atomically, verified on load, agreed on by every rank
  (:class:`~mc_train.checkpoint.Checkpointer`; import it from ``mc_train.checkpoint``).
"""

from __future__ import annotations

from mc_groups import package_version
from mc_train.loss import IGNORE_INDEX, TokenLoss, causal_targets, token_cross_entropy
from mc_train.pipeline import Pipeline, StageShapes, build_pipeline
from mc_train.schedules import SCHEDULES, InFlight, check_schedule, in_flight_forwards
from mc_train.split import decoder_stages, split_model, stage_plan
from mc_train.stages import (
    HFCausalLMForward,
    StageForward,
    StageInfo,
    call_module,
    hf_causal_lm_forward,
)

__version__ = package_version("mc-train")

__all__ = [
    "IGNORE_INDEX",
    "SCHEDULES",
    "HFCausalLMForward",
    "InFlight",
    "Pipeline",
    "StageForward",
    "StageInfo",
    "StageShapes",
    "TokenLoss",
    "build_pipeline",
    "call_module",
    "causal_targets",
    "check_schedule",
    "decoder_stages",
    "hf_causal_lm_forward",
    "in_flight_forwards",
    "split_model",
    "stage_plan",
    "token_cross_entropy",
]
