"""The attributes carried on parameters: the one interface between mc's packages (and
Megatron-Core's params), named once, with typed accessors.

mc's packages meet on ``torch.nn.Parameter`` objects: a TP layer tags a weight, the buffer
gives it a ``main_grad``, DDP and finalize read the tags. The names stay Megatron-Core's, so
params built by Megatron (or by hand, as Megatron's users do) work with mc and the other
way round. Every mc package reads and writes these attributes through this module.

Each attribute: its value (and what absent means); who sets it; who reads it.

``allreduce`` (ALLREDUCE): bool (absent: True, a dense param). False marks an
  expert-parallel param, reduced over the expert data-parallel group.
  Set: mc-tp-layers (every layer's weight and bias), MoE layers, users.
  Read: mc-buffers (buffer key, strict), mc-ddp (expert groups, agreement), mc-finalize
  (which gtp_remat axis), mc-tp-layers (TP and gtp_remat dedup).
``is_managed_by_layer_wise_optimizer`` (IS_MANAGED_BY_LAYER_WISE_OPTIMIZER): bool (absent:
  False), the param is stepped by Megatron-Core's ``LayerWiseDistributedOptimizer`` (Muon)
  and goes into a buffer of its own, laid out so that it sits whole in one shard.
  Set: Megatron's ``tag_params_for_buffer_routing``, users. Read: mc-buffers (buffer key,
  strict).
``main_grad`` (MAIN_GRAD): Tensor (absent: the grad is ``.grad``).
  Set: mc-buffers (a view of the buffer's ``grad_data``, or a separate fp32 tensor; an
  ``OffloadedView`` while offloaded).
  Read: mc-ddp (backward hook, sharded optimizer), mc-tp-layers (fused wgrad accumulation,
  deferred-wgrad drain), mc-finalize (the grad to reduce).
``main_grad_copy_in_grad_buffer`` (MAIN_GRAD_COPY): Tensor, the buffer view a separate
  fp32 ``main_grad`` is copied into before the reduction.
  Set: mc-buffers. Read: mc-ddp (bucket group).
``grad_added_to_main_grad`` (GRAD_ADDED_TO_MAIN_GRAD): bool (absent: no DDP manages it).
  Set: mc-ddp (False at build and at ``zero_grad_buffer``), mc-tp-layers (True once the
  layer accumulated the weight gradient into ``main_grad``, only where present).
  Read: mc-ddp (backward hook, strict), mc-tp-layers (presence).
``zero_out_wgrad`` (ZERO_OUT_WGRAD): bool (False). Set: users, Transformer Engine.
  Read: mc-ddp (backward hook, strict), mc-tp-layers (zeroed dummy gradient).
``skip_backward_post_hook`` (SKIP_BACKWARD_POST_HOOK): bool (False). Set: users,
  Transformer Engine. Read: mc-ddp (``delay_wgrad_compute``, strict).
``shared_embedding`` (SHARED_EMBEDDING): bool (False), the word-embedding weight tied with
  the output layer (mc marks both stages' copies). Set: users. Read: mc-buffers (own
  bucket, strict), mc-finalize (models without ``share_embeddings_and_output_weights``),
  mc-ddp (the grad norm counts it on the first ``embd`` rank only).
``shared`` (SHARED): bool (False), Megatron's mark of the last stage's duplicate of the
  tied embedding. Set: Megatron-Core's models. Read: mc-ddp (never counted in the norm).
``sequence_parallel`` (SEQUENCE_PARALLEL): bool (False), a replicated param whose grad is a
  partial sum over tp *because of sequence parallelism* (each rank saw its sequence slice).
  Set: mc-tp-layers (row-parallel bias), users (layer norms). Read: mc-finalize (SUM over
  tp only when ``config.sequence_parallel``, as Megatron; marked while it is off, an error
  naming the param: ``sum_gradients_across_tp_domain`` is the mark of such a grad).
``sum_gradients_across_tp_domain`` (SUM_GRADIENTS_ACROSS_TP_DOMAIN): bool (False), mc's mark
  of a replicated param whose grad is a partial sum over tp whatever the sequence
  parallelism (a norm weight shared by all heads, applied after a column-parallel layer:
  each rank holds its heads' part). Set: users. Read: mc-finalize (SUM over tp, with or
  without ``config.sequence_parallel``; refused together with the AVG mark or on a TP
  shard).
``average_gradients_across_tp_domain`` (AVERAGE_GRADIENTS_ACROSS_TP_DOMAIN): bool (False).
  Set: users. Read: mc-finalize (AVG over tp).
``pipeline_parallel`` / ``flextron_router_pp_sync`` (PIPELINE_PARALLEL /
  FLEXTRON_ROUTER_PP_SYNC): bool (False), conditional embedders / Flextron routers
  replicated on every pipeline stage. Set: users. Read: mc-finalize (SUM over pp), mc-ddp
  (the norm counts them on pp rank 0).
``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` (TENSOR_MODEL_PARALLEL,
  PARTITION_DIM, PARTITION_STRIDE): bool, int, int (False, -1, 1).
  Set: :func:`set_tensor_model_parallel_attributes` (mc-tp-layers' layers, mc-moe's
  experts, users). Read: mc-tp-layers (dedup, checkpoints); copied with ``expert_tp``,
  ``is_qkv``, ``qkv_split_shapes`` (Megatron's, :func:`copy_tensor_model_parallel_attributes`).
``is_gtp_weight_remat`` (IS_GTP_WEIGHT_REMAT): bool (False), a gtp_remat weight shard.
  Set: mc-tp-layers (``shard_weight_for_gtp``, with ``group``, ``gtp_remat_size``,
  ``pad_length``, ``gtp_unsharded_shape``, ``gtp_wgrad_scale``). Read: mc-finalize (skips
  the gtp_remat axis), mc-tp-layers (gather, reduce-scatter, checkpoints, dedup).
``gtp_remat_rank``, ``gtp_replica_group`` (GTP_REMAT_RANK, GTP_REPLICA_GROUP): int,
  ProcessGroup (0, absent), a param replicated over gtp_remat. Set: mc-tp-layers.
  Read: mc-tp-layers (dedup), checkpoint code.

**Records on the owning module.** A wrapper that replaces parameters (FSDP2's
``fully_shard`` swaps each for a new DTensor parameter, pytorch #136929) drops every
attribute above. :func:`record_marks` keeps, on each module (``_mc_param_marks``,
MARK_RECORD), its own params' attribute dicts by name (the live ``__dict__``: marks set
later are seen); :func:`restore_marks` copies them onto whatever parameter holds the name now. Set:
``mc_tp_layers.parallelize``, ``mc_ddp.TorchFullyShardedDataParallel``, users (before
their own ``fully_shard``). Read: mc-finalize, ``mc_ddp.clip_grad_norm``, mc-tp-layers'
full-state and checkpoint functions (each calls :func:`restore_marks` first).

Megatron-Core's functions over the tensor-parallel and gtp_remat marks live here too
(Megatron's ``core.tensor_parallel.layers`` names, which :mod:`mc_tp_layers.layers`
re-exports): :func:`set_tensor_model_parallel_attributes`,
:func:`set_defaults_if_not_set_tensor_model_parallel_attributes`,
:func:`copy_tensor_model_parallel_attributes`, :func:`param_is_not_tensor_parallel_duplicate`,
:func:`copy_gtp_attributes`, :func:`param_is_not_gtp_duplicate`,
:func:`gtp_local_pad_zero_count`.

Private tags of one package stay with it: mc-buffers' param-data slot
(``mc_buffers._param_checks.BUFFER_VIEW_ATTR``) and mc-ddp's ready callback
(``mc_ddp.PARAM_READY_CALLBACK_ATTR``).

The accessors are one ``getattr``/``setattr`` each: they run in backward hooks, once per
param per step. Readers of a bool mark take its truthiness, as Megatron does;
:func:`bool_attr` is the strict read (a ``TypeError`` for ``allreduce=0``) the packages use
where a misread mark would silently change what is reduced.
"""

from __future__ import annotations

import sys
from typing import Protocol

import torch
import torch.distributed as dist

from mc_groups.argcheck import (
    check_flag,
    check_int,
    check_optional_group,
    check_tensor,
    type_name,
)
from mc_groups.collection import collection_or_default
from mc_groups.errors import InputStateError, InputTypeError, InputValueError

__all__ = [
    "ALLREDUCE",
    "AVERAGE_GRADIENTS_ACROSS_TP_DOMAIN",
    "EXPERT_TP",
    "FLEXTRON_ROUTER_PP_SYNC",
    "GRAD_ADDED_TO_MAIN_GRAD",
    "GTP_ATTRIBUTES",
    "GTP_GROUP",
    "GTP_REMAT_RANK",
    "GTP_REMAT_SIZE",
    "GTP_REPLICA_GROUP",
    "GTP_UNSHARDED_SHAPE",
    "GTP_WGRAD_SCALE",
    "IS_GTP_WEIGHT_REMAT",
    "IS_MANAGED_BY_LAYER_WISE_OPTIMIZER",
    "IS_QKV",
    "MAIN_GRAD",
    "MAIN_GRAD_COPY",
    "MARK_RECORD",
    "MODEL_PARALLEL_ATTRIBUTE_DEFAULTS",
    "PAD_LENGTH",
    "PARTITION_DIM",
    "PARTITION_STRIDE",
    "PIPELINE_PARALLEL",
    "QKV_SPLIT_SHAPES",
    "SEQUENCE_PARALLEL",
    "SHARED",
    "SHARED_EMBEDDING",
    "SKIP_BACKWARD_POST_HOOK",
    "SUM_GRADIENTS_ACROSS_TP_DOMAIN",
    "TENSOR_MODEL_PARALLEL",
    "ZERO_OUT_WGRAD",
    "RankedGroup",
    "averages_grad_across_tp",
    "bool_attr",
    "check_partition_dim",
    "clear_grad_added_to_main_grad",
    "copy_gtp_attributes",
    "copy_tensor_model_parallel_attributes",
    "drop_main_grad_copy",
    "gtp_group_of",
    "gtp_local_pad_zero_count",
    "gtp_remat_rank_of",
    "gtp_remat_size_of",
    "gtp_unsharded_shape_of",
    "gtp_wgrad_scale_of",
    "has_grad_added_flag",
    "has_main_grad",
    "has_main_grad_copy",
    "is_expert_param",
    "is_gtp_weight_remat",
    "is_layer_wise_managed",
    "is_replicated_over_pp",
    "is_sequence_parallel_param",
    "is_shared_duplicate",
    "is_shared_embedding",
    "is_tensor_model_parallel",
    "main_grad_copy_of",
    "main_grad_of",
    "main_grad_or_none",
    "mark_allreduce",
    "mark_grad_added_to_main_grad",
    "mark_gtp_replica",
    "mark_gtp_weight_remat",
    "mark_sequence_parallel",
    "mark_sum_gradients_across_tp_domain",
    "pad_length_of",
    "param_is_not_gtp_duplicate",
    "param_is_not_tensor_parallel_duplicate",
    "partition_dim_of",
    "partition_stride_of",
    "record_marks",
    "restore_marks",
    "set_defaults_if_not_set_tensor_model_parallel_attributes",
    "set_main_grad",
    "set_main_grad_copy",
    "set_tensor_model_parallel_attributes",
    "sums_grad_across_tp",
    "zeroes_wgrad",
]

ALLREDUCE = "allreduce"
IS_MANAGED_BY_LAYER_WISE_OPTIMIZER = "is_managed_by_layer_wise_optimizer"
MAIN_GRAD = "main_grad"
MAIN_GRAD_COPY = "main_grad_copy_in_grad_buffer"
GRAD_ADDED_TO_MAIN_GRAD = "grad_added_to_main_grad"
ZERO_OUT_WGRAD = "zero_out_wgrad"
SKIP_BACKWARD_POST_HOOK = "skip_backward_post_hook"
SHARED_EMBEDDING = "shared_embedding"
SHARED = "shared"
SEQUENCE_PARALLEL = "sequence_parallel"
AVERAGE_GRADIENTS_ACROSS_TP_DOMAIN = "average_gradients_across_tp_domain"
SUM_GRADIENTS_ACROSS_TP_DOMAIN = "sum_gradients_across_tp_domain"
PIPELINE_PARALLEL = "pipeline_parallel"
FLEXTRON_ROUTER_PP_SYNC = "flextron_router_pp_sync"
TENSOR_MODEL_PARALLEL = "tensor_model_parallel"
PARTITION_DIM = "partition_dim"
PARTITION_STRIDE = "partition_stride"
EXPERT_TP = "expert_tp"
IS_QKV = "is_qkv"
QKV_SPLIT_SHAPES = "qkv_split_shapes"
IS_GTP_WEIGHT_REMAT = "is_gtp_weight_remat"
GTP_GROUP = "group"
GTP_REMAT_SIZE = "gtp_remat_size"
PAD_LENGTH = "pad_length"
GTP_UNSHARDED_SHAPE = "gtp_unsharded_shape"
GTP_WGRAD_SCALE = "gtp_wgrad_scale"
GTP_REMAT_RANK = "gtp_remat_rank"
GTP_REPLICA_GROUP = "gtp_replica_group"
MARK_RECORD = "_mc_param_marks"


def bool_attr(param: torch.Tensor, attr: str, default: bool, name: str | None = None) -> bool:
    """The bool attribute ``attr`` of ``param`` (``default`` when absent); any other value is
    a ``TypeError`` naming the param (``name``, else its shape and dtype): ``allreduce=0`` or
    ``skip_backward_post_hook=1`` must not be read by truthiness."""
    value = getattr(param, attr, default)
    if value is True or value is False:
        return value
    if name is None:
        where = f"param (shape {tuple(param.shape)}, {str(param.dtype).removeprefix('torch.')})"
    else:
        where = f"param '{name}'"
    raise InputTypeError(
        f"{where} has {attr}={value!r}; the attribute must be a bool (True or False)"
    )


# -- data-parallel marks -------------------------------------------------------------------


def is_expert_param(param: torch.Tensor) -> bool:
    """``allreduce=False``: an expert-parallel param, reduced over the expert data-parallel
    group instead of the dense one (absent reads as a dense param)."""
    return not getattr(param, ALLREDUCE, True)


def mark_allreduce(param: torch.Tensor, allreduce: bool) -> None:
    """Tag ``param`` dense (True) or expert-parallel (False)."""
    param.allreduce = allreduce  # type: ignore[attr-defined]


def is_layer_wise_managed(param: torch.Tensor) -> bool:
    """``is_managed_by_layer_wise_optimizer=True``: Megatron's layer-wise optimizer steps the
    param, so it goes into a buffer of its own (absent reads as False; a non-bool is a
    ``TypeError``, as a misread tag would move the param to another buffer)."""
    return bool_attr(param, IS_MANAGED_BY_LAYER_WISE_OPTIMIZER, False)


def is_shared_embedding(param: torch.Tensor) -> bool:
    """``shared_embedding=True``: the word-embedding weight tied with the output layer."""
    return bool(getattr(param, SHARED_EMBEDDING, False))


def is_shared_duplicate(param: torch.Tensor) -> bool:
    """``shared=True`` (Megatron's mark): the last stage's duplicate of a tied embedding."""
    return bool(getattr(param, SHARED, False))


def is_replicated_over_pp(param: torch.Tensor) -> bool:
    """``pipeline_parallel=True`` or ``flextron_router_pp_sync=True``: a copy on every
    pipeline stage (summed over pp by finalize when its config switch is on)."""
    return bool(getattr(param, PIPELINE_PARALLEL, False)) or bool(
        getattr(param, FLEXTRON_ROUTER_PP_SYNC, False)
    )


# -- main_grad and the backward-hook protocol ----------------------------------------------


def has_main_grad(param: torch.Tensor) -> bool:
    """``param`` carries a ``main_grad`` attribute (its grad lives there, not in ``.grad``)."""
    return hasattr(param, MAIN_GRAD)


def main_grad_of(param: torch.Tensor) -> torch.Tensor:
    """``param.main_grad`` of a param that has one (``AttributeError`` otherwise, as the
    attribute read it stands for)."""
    grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
    return grad


def main_grad_or_none(param: torch.Tensor) -> torch.Tensor | None:
    """``param.main_grad``, or None when it has none (callers that explain the absence)."""
    grad: torch.Tensor | None = getattr(param, MAIN_GRAD, None)
    return grad


def set_main_grad(param: torch.Tensor, grad: torch.Tensor) -> None:
    """Point ``param.main_grad`` at ``grad``."""
    param.main_grad = grad  # type: ignore[attr-defined]


def has_main_grad_copy(param: torch.Tensor) -> bool:
    """``param`` accumulates in a separate fp32 ``main_grad`` that is copied into the buffer
    (``main_grad_copy_in_grad_buffer``) before the reduction."""
    return hasattr(param, MAIN_GRAD_COPY)


def main_grad_copy_of(param: torch.Tensor) -> torch.Tensor:
    """``param.main_grad_copy_in_grad_buffer`` of a param that has one."""
    copy: torch.Tensor = param.main_grad_copy_in_grad_buffer  # type: ignore[attr-defined]
    return copy


def set_main_grad_copy(param: torch.Tensor, view: torch.Tensor) -> None:
    """Point ``param.main_grad_copy_in_grad_buffer`` at ``view``."""
    param.main_grad_copy_in_grad_buffer = view  # type: ignore[attr-defined]


def drop_main_grad_copy(param: torch.Tensor) -> None:
    """Remove ``main_grad_copy_in_grad_buffer`` when ``param`` has one."""
    if hasattr(param, MAIN_GRAD_COPY):
        delattr(param, MAIN_GRAD_COPY)


def has_grad_added_flag(param: torch.Tensor) -> bool:
    """``param`` carries ``grad_added_to_main_grad``: a DDP wrapper manages it, so a layer
    that accumulated the weight gradient into ``main_grad`` says so through the flag."""
    return hasattr(param, GRAD_ADDED_TO_MAIN_GRAD)


def mark_grad_added_to_main_grad(param: torch.Tensor) -> None:
    """The layer added this step's weight gradient into ``main_grad`` itself."""
    param.grad_added_to_main_grad = True  # type: ignore[attr-defined]


def clear_grad_added_to_main_grad(param: torch.Tensor) -> None:
    """Start an iteration: no gradient was added into ``main_grad`` by a layer yet."""
    param.grad_added_to_main_grad = False  # type: ignore[attr-defined]


def zeroes_wgrad(param: torch.Tensor) -> bool:
    """``zero_out_wgrad=True``: the dummy gradient a layer returns must be zeros."""
    return bool(getattr(param, ZERO_OUT_WGRAD, False))


# -- tensor-parallel marks -----------------------------------------------------------------


def is_sequence_parallel_param(param: torch.Tensor) -> bool:
    """``sequence_parallel=True``: a replicated param whose grad is a partial sum over the
    tensor-parallel ranks (each saw only its sequence slice)."""
    return bool(getattr(param, SEQUENCE_PARALLEL, False))


def mark_sequence_parallel(param: torch.Tensor, sequence_parallel: bool) -> None:
    """Tag ``param``'s grad as a partial sum over tp (True) or not."""
    param.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]


def sums_grad_across_tp(param: torch.Tensor) -> bool:
    """``sum_gradients_across_tp_domain=True``: a replicated param whose grad is a partial
    sum over the tp ranks whatever the sequence parallelism (each rank holds its heads'
    or columns' part); finalize sums it over tp."""
    return bool(getattr(param, SUM_GRADIENTS_ACROSS_TP_DOMAIN, False))


def mark_sum_gradients_across_tp_domain(param: torch.Tensor, flag: bool = True) -> None:
    """Tag ``param``'s grad as a partial sum over tp in every configuration (True) or not:
    ``finalize_model_grads`` sums it over tp with or without sequence parallelism, and the
    grad norm counts it once."""
    param.sum_gradients_across_tp_domain = flag  # type: ignore[attr-defined]


def averages_grad_across_tp(param: torch.Tensor) -> bool:
    """``average_gradients_across_tp_domain=True``: every tp rank computed the full grad;
    finalize averages them."""
    return bool(getattr(param, AVERAGE_GRADIENTS_ACROSS_TP_DOMAIN, False))


def is_tensor_model_parallel(param: torch.Tensor) -> bool:
    """``tensor_model_parallel=True``: ``param`` is one tensor-parallel shard."""
    return bool(getattr(param, TENSOR_MODEL_PARALLEL, False))


def partition_dim_of(param: torch.Tensor, default: int = -1) -> int:
    """The dimension a tensor-parallel shard is split along (``default`` when untagged)."""
    return int(getattr(param, PARTITION_DIM, default))


def partition_stride_of(param: torch.Tensor) -> int:
    """The stride of the split (1 when untagged)."""
    return int(getattr(param, PARTITION_STRIDE, 1))


# -- gtp_remat -----------------------------------------------------------------------------


def is_gtp_weight_remat(param: torch.Tensor) -> bool:
    """``is_gtp_weight_remat=True``: a gtp_remat shard, whose gradient was already reduced
    over the gtp_remat axis by its own reduce-scatter."""
    return bool(getattr(param, IS_GTP_WEIGHT_REMAT, False))


def mark_gtp_weight_remat(
    shard: torch.Tensor,
    group: dist.ProcessGroup,
    pad_length: int,
    unsharded_shape: tuple[int, ...],
    wgrad_scale: float,
) -> None:
    """Tag ``shard`` as this rank's rows of a weight sharded over the gtp_remat ``group``
    (``pad_length`` zero rows appended before the split; ``wgrad_scale`` pre-scales its
    gradient's reduce-scatter)."""
    shard.is_gtp_weight_remat = True  # type: ignore[attr-defined]
    shard.group = group  # type: ignore[attr-defined]
    shard.gtp_remat_size = int(group.size())  # type: ignore[attr-defined]
    shard.pad_length = pad_length  # type: ignore[attr-defined]
    shard.gtp_unsharded_shape = unsharded_shape  # type: ignore[attr-defined]
    shard.gtp_wgrad_scale = wgrad_scale  # type: ignore[attr-defined]


def gtp_group_of(shard: torch.Tensor) -> dist.ProcessGroup | None:
    """The gtp_remat group a shard was cut over (its ``group``), or None for no shard."""
    group: dist.ProcessGroup | None = getattr(shard, GTP_GROUP, None)
    return group


def gtp_remat_size_of(shard: torch.Tensor) -> int | None:
    """The shard's ``gtp_remat_size`` as stored, or None for no shard."""
    size: int | None = getattr(shard, GTP_REMAT_SIZE, None)
    return size


def pad_length_of(shard: torch.Tensor) -> int:
    """Zero rows appended to dim 0 before sharding (0 when absent or None)."""
    return int(getattr(shard, PAD_LENGTH, 0) or 0)


def gtp_unsharded_shape_of(shard: torch.Tensor) -> tuple[int, ...] | None:
    """The TP-local shape the shard was cut from, or None for a weight that is no shard."""
    shape = getattr(shard, GTP_UNSHARDED_SHAPE, None)
    return None if shape is None else tuple(shape)


def gtp_wgrad_scale_of(shard: torch.Tensor, default: float) -> float:
    """The factor the shard's weight gradient is scaled by before its reduce-scatter."""
    return float(getattr(shard, GTP_WGRAD_SCALE, default))


def gtp_remat_rank_of(param: torch.Tensor) -> int:
    """This rank's position on the gtp_remat axis of a replicated param (0 without one)."""
    return int(getattr(param, GTP_REMAT_RANK, 0))


def mark_gtp_replica(param: torch.Tensor, group: dist.ProcessGroup) -> None:
    """Tag ``param`` as replicated over the gtp_remat ``group`` (its rank there and the
    group holding the identical copies: dedup and checkpoints)."""
    param.gtp_remat_rank = int(group.rank())  # type: ignore[attr-defined]
    param.gtp_replica_group = group  # type: ignore[attr-defined]


# -- records on the owning module (marks that survive a parameter swap) --------------------

# Per-step state, not marks: a swapped-in parameter starts without a grad of its own.
_NOT_KEPT = frozenset({MAIN_GRAD, MAIN_GRAD_COPY, GRAD_ADDED_TO_MAIN_GRAD})


def record_marks(module: torch.nn.Module) -> int:
    """Record, on every submodule of ``module``, its own parameters' attribute dicts by
    name, so :func:`restore_marks` can put the marks back after a wrapper replaced the
    parameters (FSDP2's ``fully_shard``). Idempotent; the record holds each parameter's
    live ``__dict__`` and shape, not the tensor. Returns the number of parameters recorded."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    restore_marks(module)  # a record made before an earlier swap: put its marks back first
    count = 0
    for sub in module.modules():
        own = {n: p for n, p in sub._parameters.items() if p is not None}
        if own:
            sub.__dict__[MARK_RECORD] = {n: (tuple(p.shape), vars(p)) for n, p in own.items()}
            count += len(own)
    return count


def restore_marks(module: torch.nn.Module) -> int:
    """Copy the recorded marks (:func:`record_marks`) onto the parameters that hold each
    recorded name now, where they lack them (a parameter's own attributes win); per-step
    state (``main_grad``, ``grad_added_to_main_grad``) and ``_``-names are not copied.
    Cheap when nothing was swapped (one identity check per recorded parameter). Returns the
    number of parameters that got marks back.

    Raises ``InputStateError`` naming the parameter when a recorded name is gone or now
    holds a tensor of another shape: its marks cannot be kept, and reading it unmarked would
    reduce or save it wrongly."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    restored = 0
    for prefix, sub in module.named_modules():
        record = sub.__dict__.get(MARK_RECORD)
        if not record:
            continue
        for name, (shape, marks) in record.items():
            param = sub._parameters.get(name)
            current = None if param is None else vars(param)
            if current is marks:
                continue
            where = f"{prefix}.{name}" if prefix else name
            if param is None or current is None or tuple(param.shape) != shape:
                now = "is gone" if param is None else f"has shape {tuple(param.shape)}"
                raise InputStateError(
                    f"parameter '{where}' {now}, but mc recorded its marks at shape {shape}: "
                    "the module was changed after mc_tp_layers.parallelize / record_marks, so "
                    "its tensor-parallel marks cannot be kept; change the module before "
                    "parallelize, or call mc_groups.param_attrs.record_marks(model) again"
                )
            for key, value in marks.items():
                if key not in _NOT_KEPT and not key.startswith("_") and key not in current:
                    setattr(param, key, value)
            record[name] = (shape, current)
            restored += 1
    return restored


# -- Megatron-Core's functions over the tensor-parallel and gtp_remat marks ----------------
# (``core.tensor_parallel.layers``' names; mc_tp_layers.layers re-exports them)

MODEL_PARALLEL_ATTRIBUTE_DEFAULTS: dict[str, object] = {
    EXPERT_TP: False,
    IS_QKV: False,
    QKV_SPLIT_SHAPES: None,
    TENSOR_MODEL_PARALLEL: False,
    PARTITION_DIM: -1,
    PARTITION_STRIDE: 1,
}
"""The TP attributes and the values an unsharded parameter has (Megatron-Core's six keys:
``expert_tp`` marks an expert-TP shard, ``is_qkv`` / ``qkv_split_shapes`` a fused QKV
weight and the sizes of its Q, K and V blocks, which optimizers that orthogonalise per
block need on every copy of the weight)."""

GTP_ATTRIBUTES: tuple[str, ...] = (
    IS_GTP_WEIGHT_REMAT,
    ALLREDUCE,
    GTP_REMAT_RANK,
    GTP_REPLICA_GROUP,
    GTP_REMAT_SIZE,
    GTP_UNSHARDED_SHAPE,
    PAD_LENGTH,
    GTP_GROUP,
)
"""Attributes :func:`copy_gtp_attributes` carries from a parameter to its copies
(``allreduce`` too: the dense/expert tag decides which gtp_remat axis the dedup uses)."""


def set_tensor_model_parallel_attributes(
    tensor: torch.Tensor, is_parallel: bool, dim: int, stride: int
) -> None:
    """Set ``tensor_model_parallel``, ``partition_dim`` and ``partition_stride``.

    Setting the same values again is allowed; different values than those already set
    raise ``ValueError`` (a parameter cannot be split two ways). ``dim`` must be a dimension
    of ``tensor`` (``[-ndim, ndim)``; -1 also marks an unsplit 0-D tensor), ``stride`` an
    int >= 1. (:func:`copy_tensor_model_parallel_attributes` copies the tags unchecked: a
    flattened copy keeps its source's dim.)
    """
    check_tensor("tensor", tensor)
    check_flag("is_parallel", is_parallel)
    check_partition_dim(dim, tensor.dim() if is_parallel else max(tensor.dim(), 1), "dim")
    check_int("stride", stride)
    wanted = {
        TENSOR_MODEL_PARALLEL: is_parallel,
        PARTITION_DIM: dim,
        PARTITION_STRIDE: stride,
    }
    clashes = {
        name: getattr(tensor, name)
        for name, value in wanted.items()
        if hasattr(tensor, name) and getattr(tensor, name) != value
    }
    if clashes:
        raise InputValueError(
            f"tensor already carries TP attributes {clashes}, which differ from {wanted}; "
            "copy it (tensor.detach().clone()) before re-labelling"
        )
    for name, value in wanted.items():
        setattr(tensor, name, value)


def set_defaults_if_not_set_tensor_model_parallel_attributes(tensor: torch.Tensor) -> None:
    """Give ``tensor`` the unsharded defaults for every TP attribute it lacks."""
    check_tensor("tensor", tensor)
    for name, value in MODEL_PARALLEL_ATTRIBUTE_DEFAULTS.items():
        if not hasattr(tensor, name):
            setattr(tensor, name, value)


def copy_tensor_model_parallel_attributes(
    destination_tensor: torch.Tensor, source_tensor: torch.Tensor
) -> None:
    """Copy every TP attribute ``source_tensor`` has onto ``destination_tensor``.

    The keys are those of :data:`MODEL_PARALLEL_ATTRIBUTE_DEFAULTS` (``is_qkv`` and
    ``qkv_split_shapes`` included); attributes the source lacks are left alone.
    """
    check_tensor("destination_tensor", destination_tensor)
    check_tensor("source_tensor", source_tensor)
    for name in MODEL_PARALLEL_ATTRIBUTE_DEFAULTS:
        if hasattr(source_tensor, name):
            setattr(destination_tensor, name, getattr(source_tensor, name))


class RankedGroup(Protocol):
    """What :func:`param_is_not_tensor_parallel_duplicate` reads of a group: its ``rank()``
    (a ``ProcessGroup`` has it; so does any stand-in a Megatron user passes)."""

    def rank(self) -> int:
        """This process's rank in the group."""
        ...


def _ranked(name: str, group: object) -> RankedGroup | None:
    """``group`` when it is None, a live ``ProcessGroup``, or another object with a callable
    ``rank()`` (nothing is communicated, so no more is needed)."""
    if group is None or isinstance(group, dist.ProcessGroup):
        check_optional_group(name, group)
        return group
    if callable(getattr(group, "rank", None)):
        return group  # type: ignore[return-value]  # has rank(): the protocol
    raise InputTypeError(
        f"{name}={group!r} ({type_name(group)}) must be a torch.distributed.ProcessGroup, an "
        "object with a rank() method, or None"
    )


def param_is_not_tensor_parallel_duplicate(
    param: torch.Tensor,
    tp_group: dist.ProcessGroup | RankedGroup | None = None,
    expert_tp_group: dist.ProcessGroup | RankedGroup | None = None,
) -> bool:
    """True if ``param`` counts once when summing over the tensor-parallel ranks.

    A TP shard (``tensor_model_parallel``) is unique on every rank; a replicated parameter
    counts only on rank 0 of its group. The group, as in Megatron-Core: ``expert_tp_group``
    for a parameter reduced over the expert data-parallel group (``allreduce`` False) when
    it is given, else ``tp_group`` when given. With neither, the registered default
    collection's ``expt_tp`` (expert params) or ``tp`` (the others) — where Megatron falls
    back to its global dense TP rank for both. Only the group's ``rank()`` is read, so any
    object with one will do (:class:`RankedGroup`).
    """
    check_tensor("param", param)
    tp = _ranked("tp_group", tp_group)
    expert_tp = _ranked("expert_tp_group", expert_tp_group)
    if is_tensor_model_parallel(param):
        return True
    is_expert = is_expert_param(param)
    group = expert_tp if is_expert and expert_tp is not None else tp
    if group is not None and not isinstance(group, dist.ProcessGroup):
        return int(group.rank()) == 0
    if group is None:
        what = "param_is_not_tensor_parallel_duplicate"
        explicit = "tp_group=<ProcessGroup> (expert_tp_group= for an expert param)"
        collection = collection_or_default(None, what, explicit=explicit)
        group = collection.require("expt_tp" if is_expert else "tp", what)
    return int(group.rank()) == 0


def copy_gtp_attributes(destination: torch.Tensor, source: torch.Tensor) -> None:
    """Copy the GTP attributes (:data:`GTP_ATTRIBUTES`) ``source`` has onto ``destination``.

    Use it on any view or copy of a parameter (an optimizer's fp32 master or shard): the
    dedup tags keep :func:`param_is_not_gtp_duplicate` right, and ``pad_length`` with
    ``group`` keep :func:`gtp_local_pad_zero_count` right (without both it returns 0).
    """
    check_tensor("destination", destination)
    check_tensor("source", source)
    for name in GTP_ATTRIBUTES:
        if hasattr(source, name):
            setattr(destination, name, getattr(source, name))


def param_is_not_gtp_duplicate(param: torch.Tensor) -> bool:
    """True if ``param``'s gradient counts once across the gtp_remat axis.

    GTP shards are unique on every rank of the axis (kept). A parameter replicated over
    the axis counts only where ``gtp_remat_rank`` is 0; without GTP the tag is absent and
    reads as 0, so every parameter is kept.
    """
    check_tensor("param", param)
    if is_gtp_weight_remat(param):
        return True
    return gtp_remat_rank_of(param) == 0


def gtp_local_pad_zero_count(gtp_shard: torch.Tensor, range_start: int, range_end: int) -> int:
    """Padding elements inside ``gtp_shard.view(-1)[range_start:range_end]``.

    A GTP weight of ``d0`` rows is padded with ``pad_length`` zero rows at the end of dim 0
    and split evenly over the ``G`` ranks of ``gtp_shard.group``: every shard holds
    ``s = (d0 + pad_length) / G`` rows, and rank r holds rows ``[r·s, (r+1)·s)`` of the
    padded weight. The padding rows ``[G·s - pad_length, G·s)`` usually sit in the last
    shard but spill into earlier ones when ``pad_length > s``; the count uses this rank's
    row offset, so both cases are right. Returns 0 when ``pad_length`` or ``group`` is
    missing.

    Args:
        gtp_shard: this rank's shard (carries ``pad_length`` and ``group``).
        range_start: first flat index of the fragment asked about.
        range_end: one past its last flat index (``0, gtp_shard.numel()`` for all).
    """
    check_tensor("gtp_shard", gtp_shard)
    start_at = check_int("range_start", range_start, minimum=0)
    if check_int("range_end", range_end, minimum=0) < start_at:
        raise InputValueError(
            f"range_end={range_end} < range_start={range_start}; the range is "
            "[range_start, range_end)"
        )
    pad_length = pad_length_of(gtp_shard)
    group = gtp_group_of(gtp_shard)
    if pad_length == 0 or group is None or gtp_shard.dim() == 0:
        return 0
    rows = gtp_shard.shape[0]
    row_numel = gtp_shard.numel() // rows if rows else 0
    pad_first_row = rows * int(group.size()) - pad_length
    local_pad_rows = rows - min(max(pad_first_row - int(group.rank()) * rows, 0), rows)
    pad_start = (rows - local_pad_rows) * row_numel
    start, end = max(range_start, pad_start), min(range_end, gtp_shard.numel())
    return max(end - start, 0)


def check_partition_dim(value: object, ndim: int, arg: str = "partition_dim") -> int:
    """``value`` as a dimension index of a ``ndim``-D tensor, normalised to ``[0, ndim)``.

    Only ``[-ndim, ndim)`` is accepted: a dim that Python's ``%`` would wrap (5 on a 2-D
    weight reading as 1) is a ``ValueError``, not another dimension.
    """
    dim = check_int(arg, value, minimum=-sys.maxsize - 1)
    if not -ndim <= dim < ndim:
        raise InputValueError(
            f"{arg}={dim} is not a dimension of a {ndim}-D tensor; use one of "
            f"{list(range(ndim))} (or {list(range(-ndim, 0))} from the end)"
        )
    return dim % ndim
