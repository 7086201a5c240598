"""The config attributes the layers read, as a ``Protocol``.

Any object with these attributes works: :class:`mc_groups.ModelParallelConfig` (the
validated default), Megatron-Core's ``ModelParallelConfig`` / ``TransformerConfig``, or a
plain ``types.SimpleNamespace`` in a test.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["TensorParallelConfig"]


class TensorParallelConfig(Protocol):
    """What :mod:`mc_tp_layers` reads from a config.

    Attributes:
        sequence_parallel: activations outside the TP region are split along dim 0
            (the sequence); layers all-gather / reduce-scatter them on that dim.
        params_dtype: dtype of the weights and biases the layers allocate.
        use_cpu_initialization: build the full fp32 master weight with the CPU generator
            and keep this rank's slice (a TP=N model equals the TP=1 model sliced).
        perform_initialization: run ``init_method``; when False the weights are left
            uninitialised (TP attributes are still set).
        gradient_accumulation_fusion: add the weight gradient straight into
            ``weight.main_grad`` and return a dummy ``.grad``.
        defer_embedding_wgrad_compute: keep the LM head's activations and output
            gradients in buffers and compute its weight gradient later
            (:func:`mc_tp_layers.drain_embedding_wgrad_compute`).
        wgrad_deferral_limit: how many micro-batches to defer (0: all of them).
        expert_model_parallel_size, tensor_model_parallel_size,
            expert_tensor_parallel_size (None reads as the TP size): an expert layer's
            params are tagged ``allreduce=False`` (reduced over the expert-DP group, in the
            expert buffer) when ``ep > 1`` or ``etp != tp``, as in Megatron-Core.
        gtp_remat_size: > 1 shards each linear weight's dim 0 over the gtp_remat group;
            it is all-gathered before each GEMM and its gradient reduce-scattered.
        calculate_per_token_loss: the gtp_remat wgrad is SUM-reduced (per-token losses are
            normalised later) instead of averaged over the gtp_remat axis.

    The last four are read with ``getattr`` and Megatron's defaults (1, 1, None, False), so
    older configs without them keep working.
    """

    sequence_parallel: bool
    params_dtype: torch.dtype
    use_cpu_initialization: bool
    perform_initialization: bool
    gradient_accumulation_fusion: bool
    defer_embedding_wgrad_compute: bool
    wgrad_deferral_limit: int
    expert_model_parallel_size: int
    gtp_remat_size: int
