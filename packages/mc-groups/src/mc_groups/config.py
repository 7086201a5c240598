"""The one config protocol of mc: the config fields the packages read, their types and
Megatron-Core's defaults, and the one check and the one reader every package uses.

Field names are Megatron-Core's, so Megatron's ``ModelParallelConfig`` and
``TransformerConfig`` work wherever mc takes a config, and so does any object with the
fields a function reads (a ``types.SimpleNamespace`` in a test). :class:`ModelParallelConfig`
below is the validated default for users without Megatron. The rules, the same in every
package::

    a field the config lacks        reads Megatron-Core's default (config_value)
    a field the config has          must have the field's type (None only where
                                    Megatron's type allows it), checked by check_config
    a field a caller cannot do      listed in check_config(..., required=): a config
    without                         without it is a TypeError naming it

A package checks a config once where it receives it (``check_config``: a layer and DDP
at construction, ``finalize_model_grads`` at each call) and reads fields with
:func:`config_value`. :class:`TransformerConfigLike` is the static type of such a config:
the fields some package requires. Who reads what (the table ``_FIELDS`` holds each field's
check and default)::

    field                                   default      read by
    sequence_parallel                       False        tp-layers (required), finalize (required)
    params_dtype                            float32      tp-layers (required)
    use_cpu_initialization                  False        tp-layers (required)
    perform_initialization                  True         tp-layers (required)
    gradient_accumulation_fusion            False        tp-layers (required)
    defer_embedding_wgrad_compute           False        tp-layers (required)
    wgrad_deferral_limit                    0            tp-layers (required)
    calculate_per_token_loss                False        ddp (required), finalize (required),
                                                         tp-layers (gtp_remat wgrad SUM)
    tensor_model_parallel_size              1            tp-layers (expert groups)
    expert_model_parallel_size              1            tp-layers (expert groups)
    expert_tensor_parallel_size             None (= tp)  tp-layers (expert groups)
    gtp_remat_size                          1            tp-layers, finalize
    expert_gtp_remat_size                   1            finalize
    cuda_graph_impl                         "none"       ddp (keeps grad_added_to_main_grad)
    qk_layernorm                            False        finalize (q/k norm grads over tp)
    has_cond_embedder                       False        finalize (conditional embedders)
    flextron                                False        finalize (Flextron routers)
    mtp_num_layers                          None (= 0)   finalize (embedding chunk)
    moe_router_enable_expert_bias           False        finalize (router expert bias), moe
                                                         (wires transformers routers)
    moe_router_bias_update_rate             1e-3         finalize
    moe_router_load_balancing_type          "aux_loss"   finalize (str or list of str)
    moe_router_quantile_balancing_ema       0.0          finalize (in [0, 1])
    recompute_granularity                   None         ddp's FSDP2 wrapper (backward prefetch
                                                         order; None, "full" or "selective")

plus the fields only :class:`ModelParallelConfig` validates (pipeline and context sizes,
fp16 / bf16, ...). A new field goes into ``_FIELDS`` with Megatron's name and default.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol, cast

import torch
from torch import nn

from mc_groups.argcheck import (
    check_flag,
    check_float_dtype,
    check_int,
    check_optional_int,
    check_optional_str,
    check_real,
    check_str,
    type_name,
)
from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "CONFIG_RECORD",
    "ModelParallelConfig",
    "TransformerConfigLike",
    "check_config",
    "config_value",
    "record_config",
    "recorded_config",
]

CONFIG_RECORD = "_mc_parallel_config"
"""The module attribute holding the config a model was made tensor-parallel with."""


class TransformerConfigLike(Protocol):
    """What mc reads from a config, as a static type: the fields some package requires.

    Megatron-Core's ``TransformerConfig``, :class:`ModelParallelConfig` or any object with
    these attributes qualifies (a ``ModelParallelConfig`` of Megatron's, which has no
    ``calculate_per_token_loss``, works everywhere that field is not required: the layers
    and finalize's step helpers). Every other field is optional and read with Megatron's
    default (module notes).
    """

    @property
    def sequence_parallel(self) -> bool:
        """Activations outside the TP region are split along the sequence (dim 0); the
        grads of params marked ``sequence_parallel`` are partial sums over tp."""
        ...

    @property
    def calculate_per_token_loss(self) -> bool:
        """Losses are summed per token and divided by the global token count in
        ``finalize_model_grads``: DDP does not average over data-parallel ranks."""
        ...

    @property
    def params_dtype(self) -> torch.dtype:
        """dtype of the weights and biases the layers allocate."""
        ...

    @property
    def use_cpu_initialization(self) -> bool:
        """Build the full fp32 master weight on CPU and keep this rank's slice."""
        ...

    @property
    def perform_initialization(self) -> bool:
        """Run ``init_method`` on new weights (False leaves them uninitialised)."""
        ...

    @property
    def gradient_accumulation_fusion(self) -> bool:
        """Accumulate weight gradients straight into ``weight.main_grad``."""
        ...

    @property
    def defer_embedding_wgrad_compute(self) -> bool:
        """Defer the LM head's weight-gradient GEMM of the last pipeline stage."""
        ...

    @property
    def wgrad_deferral_limit(self) -> int:
        """How many micro-batches to defer; 0 defers all of them."""
        ...


def _size(name: str, value: object) -> int:
    return check_int(name, value, minimum=1)


def _optional_size(name: str, value: object) -> int | None:
    return check_optional_int(name, value, minimum=1)


def _count(name: str, value: object) -> int:
    return check_int(name, value, minimum=0)


def _optional_count(name: str, value: object) -> int | None:
    return check_optional_int(name, value, minimum=0)


def _rate(name: str, value: object) -> float:
    return check_real(name, value, positive=True)


def _fraction(name: str, value: object) -> float:
    number = check_real(name, value, positive=True)
    if number > 1.0:
        raise InputValueError(f"{name}={value!r} must be >= 0 and <= 1.0")
    return number


def _granularity(name: str, value: object) -> str | None:
    granularity = check_optional_str(name, value)
    if granularity not in (None, "full", "selective"):
        raise InputValueError(
            f"{name}={value!r} must be None, 'full' or 'selective' (Megatron-Core's values)"
        )
    return granularity


def _dtype(name: str, value: object) -> torch.dtype:
    dtype = check_float_dtype(name, value)
    assert dtype is not None  # allow_none=False
    return dtype


_BALANCING_TYPES = (
    "aux_loss",
    "seq_aux_loss",
    "global_aux_loss",
    "sinkhorn",
    "quantile_balancing",
    "none",
)


def _balancing_types(name: str, value: object) -> tuple[str, ...]:
    # Megatron accepts one type or a list of them (one per layer group).
    if isinstance(value, str):
        types: tuple[str, ...] = (value,)
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        types = tuple(value)
    else:
        raise InputTypeError(
            f"{name}={value!r} must be a str or a list of str "
            "(e.g. 'aux_loss', 'global_aux_loss', 'quantile_balancing')"
        )
    unknown = [t for t in types if t not in _BALANCING_TYPES]
    if unknown:
        raise InputValueError(
            f"{name}={value!r}: {unknown[0]!r} is not a load-balancing type; use one of "
            f"{list(_BALANCING_TYPES)} (Megatron-Core's names)"
        )
    return types


@dataclass(frozen=True)
class _Field:
    check: Callable[[str, object], Any]
    default: Any


# Every field mc reads or ModelParallelConfig holds: its check and Megatron-Core's default.
_FIELDS: dict[str, _Field] = {
    "tensor_model_parallel_size": _Field(_size, 1),
    "pipeline_model_parallel_size": _Field(_size, 1),
    "virtual_pipeline_model_parallel_size": _Field(_optional_size, None),
    "sequence_parallel": _Field(check_flag, False),
    "context_parallel_size": _Field(_size, 1),
    "expert_model_parallel_size": _Field(_size, 1),
    "expert_tensor_parallel_size": _Field(_optional_size, None),
    "gtp_remat_size": _Field(_size, 1),
    "expert_gtp_remat_size": _Field(_size, 1),
    "perform_initialization": _Field(check_flag, True),
    "use_cpu_initialization": _Field(check_flag, False),
    "params_dtype": _Field(_dtype, torch.float32),
    "fp16": _Field(check_flag, False),
    "bf16": _Field(check_flag, False),
    "gradient_accumulation_fusion": _Field(check_flag, False),
    "defer_embedding_wgrad_compute": _Field(check_flag, False),
    "wgrad_deferral_limit": _Field(_count, 0),
    "calculate_per_token_loss": _Field(check_flag, False),
    "delay_wgrad_compute": _Field(check_flag, False),
    "tp_comm_overlap": _Field(check_flag, False),
    "cuda_graph_impl": _Field(check_str, "none"),
    "qk_layernorm": _Field(check_flag, False),
    "has_cond_embedder": _Field(check_flag, False),
    "flextron": _Field(check_flag, False),
    "mtp_num_layers": _Field(_optional_count, None),
    "moe_router_enable_expert_bias": _Field(check_flag, False),
    "moe_router_bias_update_rate": _Field(_rate, 1e-3),
    "moe_router_load_balancing_type": _Field(_balancing_types, ("aux_loss",)),
    "moe_router_quantile_balancing_ema": _Field(_fraction, 0.0),
    "recompute_granularity": _Field(_granularity, None),
}


def check_config(
    config: object, what: str, *, required: Iterable[str] = ()
) -> TransformerConfigLike:
    """``config`` when it has every field of ``required`` and each field of the module's
    table that it has holds the field's type; else an error before anything happens.

    A missing required field is a ``TypeError`` naming the fields and ``what`` (the
    caller); a field of the wrong type a ``TypeError`` naming ``config.<field>`` and the
    value (``'yes'`` is not a bool); a value out of range (a size of 0) a ``ValueError``.
    Returns the config itself.
    """
    missing = [name for name in required if not hasattr(config, name)]
    if missing:
        raise InputTypeError(
            f"config={type_name(config)} lacks {missing}: {what} reads config."
            f"{missing[0]}; pass Megatron-Core's TransformerConfig, a "
            "mc_groups.ModelParallelConfig, or any object with these attributes "
            "(mc_groups.TransformerConfigLike)"
        )
    for name, field in _FIELDS.items():
        if hasattr(config, name):
            field.check(f"config.{name}", getattr(config, name))
    return cast(TransformerConfigLike, config)


def config_value(config: object, name: str) -> Any:
    """``config.<name>`` checked, or Megatron-Core's default when the config lacks it.

    ``name`` must be a field of the module's table (a ``KeyError`` otherwise: a typo in
    mc, not in the user's config). A ``moe_router_load_balancing_type`` reads as a tuple.
    """
    field = _FIELDS[name]
    if not hasattr(config, name):
        return field.default
    return field.check(f"config.{name}", getattr(config, name))


@dataclass
class ModelParallelConfig:
    """Parallel layout and layer-behaviour switches (Megatron-Core field names).

    Attributes:
        tensor_model_parallel_size: ranks a tensor-parallel layer is split over.
        pipeline_model_parallel_size: pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank, or None.
        sequence_parallel: shard activations outside the TP region along the sequence
            (dim 0); needs ``tensor_model_parallel_size > 1``.
        context_parallel_size / expert_model_parallel_size / expert_tensor_parallel_size /
            gtp_remat_size: the other axis sizes.
        perform_initialization: run ``init_method`` on new weights (False leaves them
            uninitialised; TP attributes are still set).
        use_cpu_initialization: build the full fp32 master weight on CPU and keep this
            rank's slice, so a TP=N model equals the TP=1 model sliced.
        params_dtype: dtype of the layer parameters (a floating-point dtype).
        fp16 / bf16: mixed-precision flags (mutually exclusive).
        gradient_accumulation_fusion: accumulate weight gradients straight into
            ``weight.main_grad`` (the DDP grad buffer).
        defer_embedding_wgrad_compute / wgrad_deferral_limit: defer the LM-head weight
            gradient GEMM of the last pipeline stage (limit 0 = all micro-batches).
        calculate_per_token_loss: losses are summed per token and normalised in
            finalize_model_grads instead of averaged per micro-batch.
        delay_wgrad_compute: weight gradients computed in ``backward_dw``.
        tp_comm_overlap: userbuffer overlap (Transformer Engine only; rejected here).
        moe_router_load_balancing_type: Megatron's router balancing (``"aux_loss"``,
            ``"seq_aux_loss"``, ``"global_aux_loss"``, ``"sinkhorn"``,
            ``"quantile_balancing"``, ``"none"``, or a list of them); finalize resets the
            global aux-loss trackers and updates ``qb_beta`` by it.
        moe_router_enable_expert_bias / moe_router_bias_update_rate: aux-loss-free
            balancing: ``finalize_model_grads`` moves each router's ``expert_bias`` by the
            rate towards balance once per global batch (``mc_moe.parallelize`` wires
            ``transformers`` routers that have such a bias).
        moe_router_quantile_balancing_ema: EMA of the quantile-balancing bias ``qb_beta``.
        recompute_granularity: the model recomputes activations in backward (``"full"`` or
            ``"selective"``, Megatron's ``TransformerConfig`` field; the model does the
            recomputing): FSDP2's wrapper then fixes the backward prefetch order.

    Fields are checked by ``check_config`` at construction and by :meth:`replace`.
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    gtp_remat_size: int = 1
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    gradient_accumulation_fusion: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    calculate_per_token_loss: bool = False
    delay_wgrad_compute: bool = False
    tp_comm_overlap: bool = False
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    moe_router_quantile_balancing_ema: float = 0.0
    recompute_granularity: str | None = None

    def __post_init__(self) -> None:
        check_config(self, "ModelParallelConfig")
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise InputValueError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1 (got "
                f"{self.tensor_model_parallel_size}); sequence parallelism shards activations "
                "over the tensor-parallel group"
            )
        if self.fp16 and self.bf16:
            raise InputValueError("fp16=True and bf16=True: choose one mixed-precision mode")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and self.pipeline_model_parallel_size <= 1:
            raise InputValueError(
                f"virtual_pipeline_model_parallel_size={vpp} needs "
                f"pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size})"
            )
        if self.tp_comm_overlap:
            raise InputValueError(
                "tp_comm_overlap=True needs Transformer Engine userbuffers, which mc's "
                "pure-torch layers do not use; set tp_comm_overlap=False"
            )

    def replace(self, **changes: object) -> ModelParallelConfig:
        """A validated copy with ``changes`` applied (unknown names are a ValueError)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InputValueError(f"ModelParallelConfig has no field(s) {unknown}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelParallelConfig(**values)


def record_config(module: nn.Module, config: object) -> None:
    """Record on ``module`` the parallel config it was converted with
    (``mc_tp_layers.parallelize`` does), for readers that get the model but not the config:
    a ``transformers`` or torchtitan model's own ``.config`` is its library's, so
    ``mc_finalize.finalize_model_grads`` reads mc's settings (``sequence_parallel``, …) from
    this record (see :func:`recorded_config`)."""
    module.__dict__[CONFIG_RECORD] = config


def recorded_config(module: object) -> object | None:
    """The config :func:`record_config` recorded on ``module`` or, when a wrapper holds it
    (``.module``), on the module inside; None when there is none."""
    current: object = module
    while current is not None:
        found: object = getattr(current, "__dict__", {}).get(CONFIG_RECORD)
        if found is not None:
            return found
        current = getattr(current, "module", None)
    return None
