"""Read every config attribute finalize uses, once, with Megatron-Core's defaults.

A missing optional attribute takes the default Megatron's ``TransformerConfig`` has, so a
``ModelParallelConfig`` (which knows nothing about MoE routers) works unchanged. A present
attribute of the wrong type is a ``TypeError`` naming it, raised before any collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mc_finalize.protocols import FinalizeConfig
from mc_groups.argcheck import check_flag, check_int, check_real, type_name
from mc_groups.errors import InputTypeError, InputValueError

_REQUIRED_BOOLS = ("sequence_parallel", "calculate_per_token_loss")
_OPTIONAL_BOOLS = (
    ("qk_layernorm", False),
    ("has_cond_embedder", False),
    ("flextron", False),
    ("moe_router_enable_expert_bias", False),
)


@dataclass(frozen=True)
class _Settings:
    sequence_parallel: bool
    calculate_per_token_loss: bool
    qk_layernorm: bool
    has_cond_embedder: bool
    flextron: bool
    moe_router_enable_expert_bias: bool
    moe_router_bias_update_rate: float
    load_balancing_types: tuple[str, ...]
    quantile_balancing_ema: float
    mtp_num_layers: int
    gtp_remat_size: int
    expert_gtp_remat_size: int

    @property
    def quantile_balancing(self) -> bool:
        return "quantile_balancing" in self.load_balancing_types

    @property
    def global_aux_loss(self) -> bool:
        return "global_aux_loss" in self.load_balancing_types


def _read_settings(config: FinalizeConfig, *, whole: bool = False) -> _Settings:
    """The settings of one call. ``sequence_parallel`` must be present (every Megatron
    config has it: a config without it is not a config). ``calculate_per_token_loss`` must
    be present for ``finalize_model_grads`` (``whole``); a step helper alone reads it as
    False when absent, as Megatron's helpers never read it (its ``ModelParallelConfig`` has
    none)."""
    flags = {
        name: _required_bool(config, name)
        if whole or name == "sequence_parallel"
        else _optional_bool(config, name, False)
        for name in _REQUIRED_BOOLS
    }
    for name, default in _OPTIONAL_BOOLS:
        flags[name] = _optional_bool(config, name, default)
    return _Settings(
        **flags,
        moe_router_bias_update_rate=_number(config, "moe_router_bias_update_rate", 1e-3, None),
        load_balancing_types=_balancing_types(config),
        quantile_balancing_ema=_number(config, "moe_router_quantile_balancing_ema", 0.0, 1.0),
        mtp_num_layers=_size(config, "mtp_num_layers", 0, minimum=0),
        gtp_remat_size=_size(config, "gtp_remat_size", 1, minimum=1),
        expert_gtp_remat_size=_size(config, "expert_gtp_remat_size", 1, minimum=1),
    )


def _required_bool(config: object, name: str) -> bool:
    if not hasattr(config, name):
        raise InputTypeError(
            f"config ({type_name(config)}) has no attribute {name!r}; finalize_model_grads "
            f"reads model[0].config.{name}: give the config a bool {name}"
        )
    return _optional_bool(config, name, False)


def _optional_bool(config: object, name: str, default: bool) -> bool:
    value = getattr(config, name, None)
    if value is None:
        return default
    return check_flag(f"config.{name}", value)


def _number(config: object, name: str, default: float, upper: float | None) -> float:
    value = getattr(config, name, None)
    if value is None:
        return default
    number = check_real(f"config.{name}", value, positive=True)
    if upper is not None and number > upper:
        raise InputValueError(f"config.{name}={value!r} must be >= 0 and <= {upper}")
    return number


def _size(config: object, name: str, default: int, *, minimum: int) -> int:
    value = getattr(config, name, None)
    if value is None:
        return default
    return check_int(f"config.{name}", value, minimum=minimum)


def _balancing_types(config: object) -> tuple[str, ...]:
    # Megatron accepts one type or a list of them (one per layer group).
    value = getattr(config, "moe_router_load_balancing_type", None)
    if value is None:
        return ("aux_loss",)
    if isinstance(value, str):
        return (value,)
    if isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InputTypeError(
        f"config.moe_router_load_balancing_type={value!r} must be a str or a list of str "
        "(e.g. 'aux_loss', 'global_aux_loss', 'quantile_balancing')"
    )
