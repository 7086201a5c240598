"""mc_tp_layers: Megatron-Core's tensor- and sequence-parallel layers on mc_groups.

The package root holds what a training script calls; everything else is in the module of
its mechanism, under Megatron's module names where Megatron has one:

- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`: the layers (:mod:`mc_tp_layers.layers`, which also
  holds every other name of Megatron's ``core.tensor_parallel.layers``: the linear
  functions, the param-mark helpers).
- :func:`vocab_parallel_cross_entropy`: the loss of a vocabulary-split LM head.
- :func:`model_parallel_cuda_manual_seed`, :func:`get_cuda_rng_tracker`,
  :class:`RNGStatesTracker`, :func:`checkpoint`, :class:`CheckpointWithoutOutput`: RNG
  streams and activation recompute that replays them (:mod:`mc_tp_layers.random`).
- :func:`parallelize`, :func:`sequence_parallel_plan`, :func:`vocab_parallel_causal_lm_loss`:
  any model (``transformers``, torchtitan, your own ``nn.Linear`` / ``nn.Embedding``)
  gets these layers from a plan with ``transformers``' ``tp_plan`` names, built from its
  existing weights (styles in :mod:`mc_tp_layers.tp_plan`).
- :func:`full_state_dict` / :func:`load_full_state_dict` (whole tensors, any mc model;
  :mod:`mc_tp_layers.shards`) and :func:`model_sharded_state_dict` (DTensor views for
  ``torch.distributed.checkpoint``; :mod:`mc_tp_layers.sharded_state`).
- :class:`TensorParallelAgreementError`: TP peers built a layer differently (each layer's
  constructor compares it with its peers: :mod:`mc_tp_layers.agreement`).
- :func:`backends`: which optional CUDA kernels (Transformer Engine, apex) are in use.

The mappings between the TP and sequence-parallel regions are :mod:`mc_tp_layers.mappings`;
the linear functions and the deferred LM-head weight gradients
(:func:`~mc_tp_layers.linear.drain_embedding_wgrad_compute`) :mod:`mc_tp_layers.linear`;
Megatron's helpers :mod:`mc_tp_layers.utils`; gtp_remat sharding :mod:`mc_tp_layers.gtp`.
Groups are passed explicitly (``tp_group=`` / ``pg_collection=``); every collective goes
through :mod:`mc_groups`, so :func:`mc_groups.record_collectives` sees it.
"""

from __future__ import annotations

from mc_groups import package_version
from mc_tp_layers._gemm import backends
from mc_tp_layers.agreement import TensorParallelAgreementError
from mc_tp_layers.cross_entropy import vocab_parallel_cross_entropy
from mc_tp_layers.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from mc_tp_layers.random import (
    CheckpointWithoutOutput,
    RNGStatesTracker,
    checkpoint,
    get_cuda_rng_tracker,
    model_parallel_cuda_manual_seed,
)
from mc_tp_layers.sharded_state import model_sharded_state_dict
from mc_tp_layers.shards import full_state_dict, load_full_state_dict
from mc_tp_layers.tp_plan import (
    parallelize,
    sequence_parallel_plan,
    vocab_parallel_causal_lm_loss,
)

__version__ = package_version("mc-tp-layers")

__all__ = [
    "CheckpointWithoutOutput",
    "ColumnParallelLinear",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TensorParallelAgreementError",
    "VocabParallelEmbedding",
    "backends",
    "checkpoint",
    "full_state_dict",
    "get_cuda_rng_tracker",
    "load_full_state_dict",
    "model_parallel_cuda_manual_seed",
    "model_sharded_state_dict",
    "parallelize",
    "sequence_parallel_plan",
    "vocab_parallel_causal_lm_loss",
    "vocab_parallel_cross_entropy",
]
