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
  tp only when ``config.sequence_parallel``, as Megatron).
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
  Set: mc-tp-layers (``set_tensor_model_parallel_attributes``). Read: mc-tp-layers (dedup,
  checkpoints); copied with ``expert_tp``, ``is_qkv``, ``qkv_split_shapes`` (Megatron's).
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

Private tags of one package stay with it: mc-buffers' param-data slot
(``mc_buffers._param_checks.BUFFER_VIEW_ATTR``) and mc-ddp's ready callback
(``mc_ddp.PARAM_READY_CALLBACK_ATTR``).

The accessors are one ``getattr``/``setattr`` each: they run in backward hooks, once per
param per step. Readers of a bool mark take its truthiness, as Megatron does;
:func:`bool_attr` is the strict read (a ``TypeError`` for ``allreduce=0``) the packages use
where a misread mark would silently change what is reduced.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_groups.errors import InputStateError, InputTypeError

__all__ = [
    "ALLREDUCE",
    "AVERAGE_GRADIENTS_ACROSS_TP_DOMAIN",
    "EXPERT_TP",
    "FLEXTRON_ROUTER_PP_SYNC",
    "GRAD_ADDED_TO_MAIN_GRAD",
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
    "averages_grad_across_tp",
    "bool_attr",
    "clear_grad_added_to_main_grad",
    "drop_main_grad_copy",
    "gtp_group_of",
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
    "partition_dim_of",
    "partition_stride_of",
    "record_marks",
    "restore_marks",
    "set_main_grad",
    "set_main_grad_copy",
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
