"""Megatron-Core's ``core.tensor_parallel.layers`` names, in one import.

``from megatron.core.tensor_parallel.layers import X`` becomes
``from mc_tp_layers.layers import X`` for every name of that module's documentation,
including the underscore helpers it documents. :mod:`mc_tp_layers` re-exports the public
ones from here (as Megatron's ``core.tensor_parallel`` does from its ``layers``).
"""

from __future__ import annotations

from mc_tp_layers._gemm import _grad_accum_fusion_available, _linear_forward, _wgrad_gemm
from mc_tp_layers.attributes import (
    _MODEL_PARALLEL_ATTRIBUTE_DEFAULTS,
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    gtp_local_pad_zero_count,
    param_is_not_gtp_duplicate,
    param_is_not_tensor_parallel_duplicate,
    set_defaults_if_not_set_tensor_model_parallel_attributes,
    set_tensor_model_parallel_attributes,
)
from mc_tp_layers.column import ColumnParallelLinear
from mc_tp_layers.embedding import VocabParallelEmbedding
from mc_tp_layers.initialization import _initialize_affine_weight_cpu, _initialize_affine_weight_gpu
from mc_tp_layers.linear import (
    LinearWithFrozenWeight,
    LinearWithGradAccumulationAndAsyncCommunication,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.row import RowParallelLinear

__all__ = [
    "_MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
    "ColumnParallelLinear",
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "_grad_accum_fusion_available",
    "_initialize_affine_weight_cpu",
    "_initialize_affine_weight_gpu",
    "_linear_forward",
    "_wgrad_gemm",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "gtp_local_pad_zero_count",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
    "param_is_not_gtp_duplicate",
    "param_is_not_tensor_parallel_duplicate",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_tensor_model_parallel_attributes",
]
