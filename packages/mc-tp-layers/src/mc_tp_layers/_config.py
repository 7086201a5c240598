"""What the layers require of a config and derive from it (sequence parallelism, expert
groups, the gtp_remat size), over the shared config protocol of :mod:`mc_groups.config`.

Any object with the required fields works: :class:`mc_groups.ModelParallelConfig` (the
validated default), Megatron-Core's ``ModelParallelConfig`` / ``TransformerConfig``, or a
plain ``types.SimpleNamespace`` in a test; every other field reads Megatron's default.
"""

from __future__ import annotations

import warnings

from mc_groups.config import TransformerConfigLike, check_config, config_value
from mc_groups.errors import InputValueError

# What every layer reads (every Megatron config has them).
_LAYER_FIELDS = (
    "sequence_parallel",
    "params_dtype",
    "use_cpu_initialization",
    "perform_initialization",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
    "wgrad_deferral_limit",
)


def check_layer_config(config: object) -> TransformerConfigLike:
    """``config`` when it has every field the layers read, each of the right type
    (:func:`mc_groups.config.check_config`)."""
    return check_config(config, "a tensor-parallel layer", required=_LAYER_FIELDS)


def check_tp_size(
    config: TransformerConfigLike, group_size: int, is_expert: bool, what: str
) -> None:
    """The TP size the config states matches the group the layer splits over.

    The layer splits over its group; code that reads the config (heads per rank, a
    sequence-parallel length, Megatron's ``get_tensor_model_parallel_world_size``
    replacements) would assume the config's size: a mismatch trains wrong numbers. The
    default ``tensor_model_parallel_size=1`` reads as unstated (Megatron's own tests build
    layers so with a larger group) and is accepted."""
    field = "tensor_model_parallel_size"
    stated = config_value(config, field)
    if is_expert and config_value(config, "expert_tensor_parallel_size") is not None:
        field = "expert_tensor_parallel_size"
        stated = config_value(config, field)
    if stated not in (1, group_size):
        raise InputValueError(
            f"{what}: config.{field}={stated} but its tensor-parallel group has "
            f"{group_size} rank(s); the layer splits over the group, while code reading the "
            f"config would assume {stated}: build the config and the groups with one size "
            "(mc_groups.initialize_model_parallel(tensor_model_parallel_size=...) and "
            "ModelParallelConfig(tensor_model_parallel_size=...))"
        )


def gtp_remat_size(config: TransformerConfigLike) -> int:
    """``config.gtp_remat_size`` (1 when the config lacks it)."""
    size: int = config_value(config, "gtp_remat_size")
    return size


def expert_parallel(config: TransformerConfigLike) -> bool:
    """True when experts are split over more than one expert-parallel rank."""
    return bool(config_value(config, "expert_model_parallel_size") > 1)


def uses_expert_groups(config: TransformerConfigLike, is_expert: bool) -> bool:
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
    tp = config_value(config, "tensor_model_parallel_size")
    etp = config_value(config, "expert_tensor_parallel_size")
    return expert_parallel(config) or (etp is not None and etp != tp)


def sequence_parallel(config: TransformerConfigLike, world: int, what: str) -> bool:
    """``config.sequence_parallel``, switched off (with a warning) for a one-rank TP group."""
    if config.sequence_parallel and world == 1:
        warnings.warn(
            f"{what}: sequence_parallel=True with a tensor-parallel group of one rank; "
            "sequence parallelism is disabled for this layer",
            stacklevel=3,
        )
        return False
    return bool(config.sequence_parallel)
