"""The config attributes the layers read, as a ``Protocol``; its check, and what the layers
derive from it (sequence parallelism, expert groups, the gtp_remat size).

Any object with these attributes works: :class:`mc_groups.ModelParallelConfig` (the
validated default), Megatron-Core's ``ModelParallelConfig`` / ``TransformerConfig``, or a
plain ``types.SimpleNamespace`` in a test.
"""

from __future__ import annotations

import warnings
from typing import Any, Protocol

import torch

from mc_groups.argcheck import check_flag, check_float_dtype, check_int, type_name
from mc_groups.errors import InputTypeError

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


_CONFIG_FIELDS = (
    "sequence_parallel",
    "params_dtype",
    "use_cpu_initialization",
    "perform_initialization",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit",
)
_CONFIG_FLAGS = (
    "sequence_parallel",
    "use_cpu_initialization",
    "perform_initialization",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
)
# Read with getattr and Megatron's defaults: (name, minimum, may be None).
_OPTIONAL_SIZES = (
    ("gtp_remat_size", 1, False),
    ("expert_model_parallel_size", 1, False),
    ("tensor_model_parallel_size", 1, False),
    ("expert_tensor_parallel_size", 1, True),
)


def check_config(config: object) -> TensorParallelConfig:
    """``config`` when it has every attribute the layers read, each of the right type.

    A config without an attribute, with a flag that is not a bool (``'no'`` would read as
    True), a size that is not an int, or a non-float ``params_dtype`` is a ``TypeError``
    naming ``config.<field>``; a negative size a ``ValueError``. Megatron's configs, and
    any object with these attributes, pass.
    """
    missing = [name for name in _CONFIG_FIELDS if not hasattr(config, name)]
    if missing:
        raise InputTypeError(
            f"config={type_name(config)} lacks {missing}; pass a "
            "mc_groups.ModelParallelConfig (or any object with the attributes of "
            "mc_tp_layers.TensorParallelConfig)"
        )
    read: Any = config  # every field checked present above
    for name in _CONFIG_FLAGS:
        check_flag(f"config.{name}", getattr(read, name))
    if hasattr(read, "calculate_per_token_loss"):
        check_flag("config.calculate_per_token_loss", read.calculate_per_token_loss)
    check_float_dtype("config.params_dtype", read.params_dtype)
    check_int("config.wgrad_deferral_limit", read.wgrad_deferral_limit, minimum=0)
    for name, minimum, optional in _OPTIONAL_SIZES:
        value = getattr(config, name, None if optional else 1)
        if not (optional and value is None):
            check_int(f"config.{name}", value, minimum=minimum)
    return config  # type: ignore[return-value]


def gtp_remat_size(config: TensorParallelConfig) -> int:
    """``config.gtp_remat_size`` (1 when an older config lacks it)."""
    return check_int("config.gtp_remat_size", getattr(config, "gtp_remat_size", 1))


def expert_parallel(config: TensorParallelConfig) -> bool:
    """True when experts are split over more than one expert-parallel rank."""
    return int(getattr(config, "expert_model_parallel_size", 1)) > 1


def uses_expert_groups(config: TensorParallelConfig, is_expert: bool) -> bool:
    """Megatron-Core's ``use_expert_pgs``: an expert layer whose params are reduced over the
    expert data-parallel group (tagged ``allreduce=False``, kept in the expert buffer).

    True for ``is_expert`` when experts are split over EP ranks (``ep > 1``) or the expert
    TP size differs from the dense one (``etp != tp``, ``etp=None`` reading as ``tp``): then
    the expert-DP group differs from the dense dp_cp group, so the params cannot share the
    dense buffer. An expert layer with ``ep = 1`` and ``etp = tp`` is reduced like a dense
    one.
    """
    if not is_expert:
        return False
    tp = int(getattr(config, "tensor_model_parallel_size", 1))
    etp = getattr(config, "expert_tensor_parallel_size", None)
    return expert_parallel(config) or (etp is not None and int(etp) != tp)


def sequence_parallel(config: TensorParallelConfig, world: int, what: str) -> bool:
    """``config.sequence_parallel``, switched off (with a warning) for a one-rank TP group."""
    if config.sequence_parallel and world == 1:
        warnings.warn(
            f"{what}: sequence_parallel=True with a tensor-parallel group of one rank; "
            "sequence parallelism is disabled for this layer",
            stacklevel=3,
        )
        return False
    return bool(config.sequence_parallel)
