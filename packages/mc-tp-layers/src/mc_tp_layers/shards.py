r"""Full tensor ↔ this rank's shard, for any parameter that carries mc's attributes.

One home for the tensor-parallel split: CPU initialisation, :func:`~mc_tp_layers.parallelize`'s
layers, the DCP views (:mod:`mc_tp_layers.sharded_state`), :func:`full_state_dict` /
:func:`load_full_state_dict` and the examples all cut and join through these functions.
What a parameter is split by is read from its attributes (:mod:`mc_groups.param_attrs`):
``tensor_model_parallel``, ``partition_dim``, ``partition_stride`` and, for a gtp_remat
shard, ``is_gtp_weight_remat`` with its ``group`` (:mod:`mc_tp_layers.gtp`).

The split (W ranks, rank r, stride k; Megatron's ``partition_stride``): the full tensor is
cut along ``partition_dim`` into ``k·W`` equal blocks and rank r keeps blocks
``r, r + W, …, r + (k-1)·W`` in that order, i.e. block r of each of the k equal parts of a
fused weight (``[q; k; v]``, ``[gate; up]``)::

    full (W=2, k=2):  [ p0b0 | p0b1 | p1b0 | p1b1 ]     rank 0: [p0b0 | p1b0]
                                                        rank 1: [p0b1 | p1b1]

With k = 1 this is plain ``chunk(W)[r]``. A gtp_remat shard is then cut again: its TP-local
weight padded with zero rows to ``G·s`` rows and rows ``[g·s, (g+1)·s)`` kept by rank g of
the gtp_remat group (:func:`~mc_tp_layers.gtp.gtp_local_rows`).

Going back (:func:`gather_full`) is a collective: one all-gather over the gtp_remat group
(gtp_remat shards only), then one over the TP group, per split parameter; nothing is issued
on a one-rank group. Cutting (:func:`local_shard`) communicates nothing.

For a whole model (any ``nn.Module``: mc's layers, a ``parallelize``\ d model, plain
replicated modules, or a mix), :func:`full_state_dict` and :func:`load_full_state_dict` apply
these to every split parameter, with the group of the module that owns it (its
``tp_group``, as mc's layers and ``parallelize``'s have) or the ``tp_group`` argument.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import check_optional_group, check_tensor, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers.gtp import gather_gtp_weight, gtp_local_rows

__all__ = [
    "full_state_dict",
    "gather_full",
    "join_shards",
    "load_full_state_dict",
    "local_shard",
    "split_full",
    "strided_view",
]


def _blocks(length: int, dim: int, stride: int, world: int, shape: Sequence[int]) -> int:
    """The block length along ``dim`` (``length / (stride · world)``), or a ``ValueError``."""
    if length % (stride * world):
        raise InputValueError(
            f"a tensor of shape {tuple(shape)} cannot be split along dim {dim} into "
            f"stride={stride} × {world} ranks' equal blocks ({length} is not divisible by "
            f"{stride * world})"
        )
    return length // (stride * world)


def split_full(
    full: torch.Tensor, dim: int, rank: int, world: int, stride: int = 1
) -> torch.Tensor:
    """Rank ``rank``'s shard of ``full`` split along ``dim`` over ``world`` ranks with
    ``stride`` (module notes): blocks ``rank, rank + world, …`` of ``stride · world`` equal
    blocks, concatenated. A view when ``stride`` is 1."""
    full = check_tensor("full", full)
    dim = param_attrs.check_partition_dim(dim, full.dim(), "dim")
    size = _blocks(int(full.shape[dim]), dim, stride, world, full.shape)
    if stride == 1:
        return full.narrow(dim, rank * size, size)
    blocks = [full.narrow(dim, (j * world + rank) * size, size) for j in range(stride)]
    return torch.cat(blocks, dim)


def join_shards(shards: Sequence[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The inverse of :func:`split_full`: the full tensor from every rank's shard, in rank
    order (``join_shards([split_full(t, d, r, W, k) for r in range(W)], d, k)`` is ``t``)."""
    if not shards:
        raise InputValueError("shards is empty; pass every rank's shard, in rank order")
    dim = param_attrs.check_partition_dim(dim, shards[0].dim(), "dim")
    pieces = [s.chunk(stride, dim) for s in shards]
    return torch.cat([piece[j] for j in range(stride) for piece in pieces], dim)


def strided_view(tensor: torch.Tensor, dim: int, stride: int) -> torch.Tensor:
    """``tensor`` viewed as ``[.., stride, d/stride, ..]`` around ``dim``: a rank's strided
    shard is then column r of the full tensor's view along ``dim + 1``, whatever the world
    size (how the DCP views store it)."""
    shape = list(tensor.shape)
    return tensor.view(*shape[:dim], stride, shape[dim] // stride, *shape[dim + 1 :])


def _split_of(param: torch.Tensor) -> tuple[int, int] | None:
    """``(partition_dim, stride)`` of a tensor-parallel shard, None for a whole tensor."""
    if not param_attrs.is_tensor_model_parallel(param):
        return None
    dim = param_attrs.check_partition_dim(param_attrs.partition_dim_of(param), param.dim())
    return dim, param_attrs.partition_stride_of(param)


def _tp_rank_world(tp_group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (0, 1) if tp_group is None else (mg.group_rank(tp_group), mg.group_size(tp_group))


def _is_split(param: torch.Tensor) -> bool:
    """``param`` is a tensor-parallel or gtp_remat shard (not the whole tensor)."""
    return param_attrs.is_tensor_model_parallel(param) or param_attrs.is_gtp_weight_remat(param)


def local_shard(
    param: torch.Tensor, full: torch.Tensor, tp_group: dist.ProcessGroup | None
) -> torch.Tensor:
    """This rank's piece of ``full`` in ``param``'s layout: its TP shard (``split_full``
    along ``partition_dim`` with ``partition_stride`` over ``tp_group``), then, for a
    gtp_remat shard, its rows of that (padded); ``full`` itself for a whole parameter. No
    communication; the result may be a view of ``full``."""
    check_tensor("param", param)
    check_tensor("full", full)
    split = _split_of(param)
    part = full
    if split is not None:
        rank, world = _tp_rank_world(tp_group)
        part = split_full(full, split[0], rank, world, split[1])
    gtp = param_attrs.gtp_group_of(param)
    if param_attrs.is_gtp_weight_remat(param) and gtp is not None:
        part = gtp_local_rows(part, mg.group_rank(gtp), mg.group_size(gtp))
    return part


def gather_full(
    param: torch.Tensor, tp_group: dist.ProcessGroup | None, label: str = "gather full"
) -> torch.Tensor:
    """The whole tensor of which ``param`` is this rank's shard (``param`` itself, detached,
    when it is whole). Collective: an all-gather over the gtp_remat group for a gtp_remat
    shard, then one over ``tp_group`` for a TP shard; none on a one-rank group. Every rank
    of the groups must call it, for the same parameters in the same order."""
    check_tensor("param", param)
    local = dtensors.full_tensor(param.detach(), label)  # an FSDP2 param: its TP shard
    if param_attrs.is_gtp_weight_remat(param):
        local = gather_gtp_weight(param)
    split = _split_of(param)
    if split is None or tp_group is None or mg.group_size(tp_group) == 1:
        return local
    world = mg.group_size(tp_group)
    out = local.new_empty((world * local.numel(),))
    mg.all_gather(out, local.contiguous().view(-1), tp_group, label=label)
    return join_shards(list(out.view(world, *local.shape).unbind(0)), split[0], split[1])


def _group_of(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None
) -> dist.ProcessGroup | None:
    own = getattr(module, "tp_group", None)
    return own if isinstance(own, dist.ProcessGroup) else tp_group


# (module, [(param name in the module, param, its TP group, split)]): the params whose
# state-dict entry mc rewrites, by the module that holds them (module order)
_Owned = list[
    tuple[torch.nn.Module, list[tuple[str, torch.nn.Parameter, "dist.ProcessGroup | None", bool]]]
]


def _owned_params(module: object, tp_group: dist.ProcessGroup | None, what: str) -> _Owned:
    """Every split param (and, under FSDP2, every DTensor param) by the module that holds
    it; a TP shard of a module without a ``tp_group`` needs the argument."""
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    check_optional_group("tp_group", tp_group, what=what)
    dtensors.reshard_fsdp(module)  # FSDP2's sharded params, as its state-dict hooks will
    param_attrs.restore_marks(module)  # after FSDP2's fully_shard replaced the params
    out: _Owned = []
    for name, sub in module.named_modules():
        prefix = f"{name}." if name else ""
        group = _group_of(sub, tp_group)
        entries = []
        for pname, param in sub.named_parameters(recurse=False):
            split = _is_split(param)
            if not split and not dtensors.is_dtensor(param):
                continue
            if split and group is None and param_attrs.is_tensor_model_parallel(param):
                raise InputValueError(
                    f"{what}: {prefix}{pname} is a tensor-parallel shard of a "
                    f"{type_name(sub)}, which has no tp_group; pass tp_group= (the group "
                    "it is split over)"
                )
            entries.append((pname, param, group, split))
        if entries:
            out.append((sub, entries))
    return out


def full_state_dict(
    module: torch.nn.Module, tp_group: dist.ProcessGroup | None = None
) -> dict[str, torch.Tensor]:
    """``module.state_dict()`` with every split parameter gathered whole, on every rank.

    Any model whose split params carry mc's attributes: mc's layers, a ``parallelize``\\ d
    model, plain replicated modules (their entries are returned as ``state_dict`` gives
    them). The keys and shapes are those of the unsplit model, so the result loads into its
    one-process twin (``load_state_dict``, then ``save_pretrained``). Each split param is
    gathered over its module's ``tp_group`` (``tp_group``: for a module that has none).

    Each param is gathered by a state-dict hook of the module that holds it, so the
    model's own hooks on the modules around it see whole tensors: torchtitan's fused
    ``wqkv``, split into ``wq`` / ``wk`` / ``wv`` by a hook of its parent, is split whole.

    Collectives: :func:`gather_full` per split param (one all-gather over TP; a gtp_remat
    shard first one over its gtp_remat group), in module order, on every rank (call it on
    all TP ranks). Under mc DDP with ``overlap_param_gather`` the last step's parameters
    arrive with the next forward: call ``mc_ddp.ensure_params_ready(model.parameters())``
    first. Under FSDP2 (``fully_shard``) each DTensor param is first gathered over its
    data-parallel mesh (:func:`mc_groups.dtensors.full_tensor`: one all-gather), and the
    marks ``fully_shard`` dropped are restored from the record
    :func:`~mc_tp_layers.parallelize` left (:func:`mc_groups.param_attrs.restore_marks`).
    """
    owned = _owned_params(module, tp_group, "full_state_dict")
    handles = [sub.register_state_dict_post_hook(_gathering(e)) for sub, e in owned]  # type: ignore[no-untyped-call]
    try:
        with torch.no_grad():
            state: dict[str, torch.Tensor] = module.state_dict()
    finally:
        for handle in handles:
            handle.remove()
    return state


def _gathering(
    entries: list[tuple[str, torch.nn.Parameter, dist.ProcessGroup | None, bool]],
) -> Any:
    def hook(_module: torch.nn.Module, state: dict[str, Any], prefix: str, _meta: object) -> None:
        for pname, param, group, split in entries:
            key = prefix + pname
            if key not in state:
                continue
            if split:
                state[key] = gather_full(param, group, label="full_state_dict")
            else:
                state[key] = dtensors.full_tensor(state[key].detach(), "full_state_dict")

    return hook


def load_full_state_dict(
    module: torch.nn.Module,
    state_dict: Mapping[str, torch.Tensor],
    strict: bool = True,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    """Load an unsplit model's state dict into ``module``: each split param gets this
    rank's piece (:func:`local_shard`; no communication). This is how a model parallelized
    on the meta device gets its weights (``module.to_empty(device=...)`` first), and how a
    model built from mc's layers takes a one-process model's weights.

    Each piece is cut by a load pre-hook of the module that holds the param, after the
    model's own pre-hooks of the modules around it (torchtitan's ``wq`` / ``wk`` / ``wv``
    merged into ``wqkv`` first). Under FSDP2, each DTensor param gets its data-parallel
    piece of this rank's TP shard (:func:`mc_groups.dtensors.distribute_like`).

    ``strict`` as in ``torch.nn.Module.load_state_dict`` (missing/unexpected keys and shape
    mismatches raise there); ``tp_group`` as in :func:`full_state_dict`. Entries named as
    the params are checked against the full shapes before anything loads.
    """
    owned = _owned_params(module, tp_group, "load_full_state_dict")
    if not isinstance(state_dict, Mapping):
        raise InputTypeError(f"state_dict must be a mapping, got {type_name(state_dict)}")
    names = {id(sub): name for name, sub in module.named_modules()}
    for sub, entries in owned:  # direct keys: cut once now, so a bad shape fails first
        prefix = f"{names[id(sub)]}." if names[id(sub)] else ""
        for pname, param, group, split in entries:
            value = state_dict.get(prefix + pname)
            if split and isinstance(value, torch.Tensor):
                local_shard(param, value, group)
    handles = [sub.register_load_state_dict_pre_hook(_cutting(e)) for sub, e in owned]  # type: ignore[no-untyped-call]
    try:
        module.load_state_dict(dict(state_dict), strict=strict)
    finally:
        for handle in handles:
            handle.remove()


def _cutting(entries: list[tuple[str, torch.nn.Parameter, dist.ProcessGroup | None, bool]]) -> Any:
    def hook(_module: torch.nn.Module, state: dict[str, Any], prefix: str, *_: object) -> None:
        for pname, param, group, split in entries:
            key = prefix + pname
            value = state.get(key)
            if not isinstance(value, torch.Tensor) or dtensors.is_dtensor(value):
                continue
            if split:
                value = local_shard(param, value, group)
            state[key] = dtensors.distribute_like(value, param)

    return hook
