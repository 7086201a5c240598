"""mc_tp_layers: Megatron-Core's tensor- and sequence-parallel layers on mc_groups.

- :mod:`mc_tp_layers.mappings`: autograd mappings between the TP and SP regions.
- :mod:`mc_tp_layers.linear`: the linear autograd functions (overlapped TP collectives,
  gradient-accumulation fusion, wgrad deferral, gtp_remat).
- :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
  :class:`VocabParallelEmbedding`: the layers.
- :func:`vocab_parallel_cross_entropy`: the loss of a vocabulary-split LM head.
- :mod:`mc_tp_layers.random`: the RNG tracker for device initialisation and dropout, and
  activation checkpointing that replays it (``mc_tp_layers.random.checkpoint``).
- :mod:`mc_tp_layers.sharded_state`: DTensor views for ``torch.distributed.checkpoint``,
  per layer and for a whole model (:func:`model_sharded_state_dict`).
- :mod:`mc_tp_layers.shards`: full tensor ↔ this rank's shard for any param carrying mc's
  attributes (strided, gtp_remat); :func:`full_state_dict` / :func:`load_full_state_dict`
  for any mc model.
- :mod:`mc_tp_layers.layers`: every name of Megatron's ``core.tensor_parallel.layers`` (this
  package takes its layers and attribute helpers from there, as Megatron's
  ``core.tensor_parallel`` does).
- :func:`backends`: which optional CUDA kernels (Transformer Engine, apex) are in use.
- :func:`check_tp_agreement` / :class:`TensorParallelAgreementError`: TP peers compare how
  they built their layers, once (:mod:`mc_tp_layers.agreement`).
- :func:`parallelize`: any model (``transformers``, torchtitan, your own ``nn.Linear`` /
  ``nn.Embedding``) gets these layers from a plan with ``transformers``' ``tp_plan`` names,
  built from its existing weights; :func:`sequence_parallel_plan` adds the
  sequence-parallel entries a decoder needs; styles in :mod:`mc_tp_layers.tp_plan`.

Groups are passed explicitly (``tp_group=`` / ``pg_collection=``); every collective goes
through :mod:`mc_groups`, so :func:`mc_groups.record_collectives` sees it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mc_tp_layers._gemm import backends
from mc_tp_layers.agreement import TensorParallelAgreementError, check_tp_agreement
from mc_tp_layers.cross_entropy import vocab_parallel_cross_entropy
from mc_tp_layers.gtp import shard_weight_for_gtp
from mc_tp_layers.layers import (
    ColumnParallelLinear,
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    gtp_local_pad_zero_count,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from mc_tp_layers.linear import drain_embedding_wgrad_compute
from mc_tp_layers.mappings import (
    all_gather_last_dim_from_tensor_parallel_region,
    all_to_all,
    all_to_all_hp2sp,
    all_to_all_sp2hp,
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_last_dim_to_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from mc_tp_layers.random import (
    CheckpointWithoutOutput,
    CudaRNGStatesTracker,
    RNGStatesTracker,
    clear_cuda_rng_tracker,
    get_cuda_rng_tracker,
    get_data_parallel_rng_tracker_name,
    get_expert_parallel_rng_tracker_name,
    get_model_parallel_rng_tracker_name,
    model_parallel_cuda_manual_seed,
    set_cuda_rng_tracker,
)
from mc_tp_layers.sharded_state import (
    gtp_sharded_tensor,
    model_sharded_state_dict,
    tp_sharded_tensor,
)
from mc_tp_layers.shards import full_state_dict, load_full_state_dict
from mc_tp_layers.tp_plan import (
    parallelize,
    sequence_parallel_plan,
    vocab_parallel_causal_lm_loss,
)
from mc_tp_layers.utils import (
    VocabUtility,
    divide,
    gather_split_1d_tensor,
    split_tensor_along_last_dim,
    split_tensor_into_1d_equal_chunks,
)

try:  # one source of the version: the distribution's pyproject.toml
    __version__ = version("mc-tp-layers")
except PackageNotFoundError:  # a checkout on sys.path, not installed (scripts/gpu_check.py)
    __version__ = "0+unknown"

__all__ = [
    "CheckpointWithoutOutput",
    "ColumnParallelLinear",
    "CudaRNGStatesTracker",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RNGStatesTracker",
    "RowParallelLinear",
    "TensorParallelAgreementError",
    "VocabParallelEmbedding",
    "VocabUtility",
    "all_gather_last_dim_from_tensor_parallel_region",
    "all_to_all",
    "all_to_all_hp2sp",
    "all_to_all_sp2hp",
    "backends",
    "check_tp_agreement",
    "clear_cuda_rng_tracker",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "copy_to_tensor_model_parallel_region",
    "divide",
    "drain_embedding_wgrad_compute",
    "full_state_dict",
    "gather_from_sequence_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "gather_split_1d_tensor",
    "get_cuda_rng_tracker",
    "get_data_parallel_rng_tracker_name",
    "get_expert_parallel_rng_tracker_name",
    "get_model_parallel_rng_tracker_name",
    "gtp_local_pad_zero_count",
    "gtp_sharded_tensor",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "load_full_state_dict",
    "model_parallel_cuda_manual_seed",
    "model_sharded_state_dict",
    "parallelize",
    "param_is_not_gtp_duplicate",
    "param_is_not_tensor_parallel_duplicate",
    "reduce_from_tensor_model_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "sequence_parallel_plan",
    "set_cuda_rng_tracker",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
    "shard_weight_for_gtp",
    "split_tensor_along_last_dim",
    "split_tensor_into_1d_equal_chunks",
    "tp_sharded_tensor",
    "vocab_parallel_causal_lm_loss",
    "vocab_parallel_cross_entropy",
]
