"""The ShardedOptimizer's state as a DCP state dict keyed like the model's (see
:meth:`mc_ddp.ShardedOptimizer.sharded_state_dict`). Nothing here communicates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from numbers import Real
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mc_ddp.checkpoint_pieces import CheckpointPieces, pieces_of_flat_slice
from mc_groups import dtensors
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError

if TYPE_CHECKING:  # DCP and DTensor are imported where used: over a second to import
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

Param = torch.nn.Parameter
MASTER_KEY = "fp32_param"


class OwnedSlice(NamedTuple):
    """One param slice this rank steps: elements ``[start, end)`` of the flattened (local)
    ``param``, and its fp32 ``master`` (``aliased``: the master is the param slice itself,
    for fp32 params; the optimizer's state for it is ``optimizer.state[master]``)."""

    param: Param
    start: int
    end: int
    master: torch.Tensor
    aliased: bool


class Placement(NamedTuple):
    """Where a param's local tensor sits in the checkpoint: the model state dict's key, the
    local tensor's shape there (e.g. a strided view), its offsets and the global shape."""

    key: str
    local_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    global_shape: tuple[int, ...]


def _placement(key: str, value: object) -> tuple[torch.Tensor, Placement] | None:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415 (see the imports)

    if isinstance(value, DTensor):
        # DCP's own view of where this rank's chunk sits (untyped in torch).
        chunks: list[ChunkStorageMetadata] = value.__create_chunk_list__()  # type: ignore[no-untyped-call]
        if len(chunks) != 1:
            raise NotImplementedError(
                f"model_sharded_state_dict[{key!r}] is a DTensor holding {len(chunks)} chunks "
                "on this rank; one chunk per rank is supported"
            )
        local = value.to_local()
        shape = tuple(local.shape)
        return local, Placement(key, shape, tuple(chunks[0].offsets), tuple(value.shape))
    if isinstance(value, torch.Tensor) and not isinstance(value, CheckpointPieces):
        shape = tuple(value.shape)
        return value, Placement(key, shape, (0,) * len(shape), shape)
    return None


def placements(
    model_sharded_state_dict: Mapping[str, Any],
    slots: Sequence[OwnedSlice],
    names: Mapping[Param, str],
) -> dict[Param, Placement]:
    """Each slot's param found in the model's state dict by its memory (the DTensor or
    tensor there is a view of the param: same first element, same element count)."""
    by_memory: dict[tuple[int, int], Placement] = {}
    for key, value in model_sharded_state_dict.items():
        found = _placement(key, value)
        if found is not None and found[0].is_contiguous():
            by_memory.setdefault((found[0].data_ptr(), found[0].numel()), found[1])
    out: dict[Param, Placement] = {}
    for slot in slots:
        place = by_memory.get((slot.param.data_ptr(), slot.param.numel()))
        if place is None:
            raise InputValueError(
                f"model_sharded_state_dict has no entry for param "
                f"'{names.get(slot.param, '<unnamed>')}' (shape {tuple(slot.param.shape)}): "
                "pass the state dict of the model chunks this optimizer steps, built from "
                "their live params (e.g. the layers' sharded_state_dict())"
            )
        out[slot.param] = place
    return out


def _zero_lr(group: dict[str, Any]) -> None:
    lr = group["lr"]
    group["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0


@torch.no_grad()
def materialize_state(optimizer: torch.optim.Optimizer, slots: Sequence[OwnedSlice]) -> None:
    """Give every slot without state the optimizer's own state (the keys and shapes its
    ``step()`` creates): one ``step()`` with lr = 0 and zero grads on those slots only.

    lr = 0 leaves every param bit-identical in torch's optimizers (Adam(W): ``p·(1 − 0·wd)``
    and ``p − 0·m/(√v + eps)``; SGD: ``p − 0·buf``); the state values it writes are
    placeholders that the checkpoint load overwrites.
    """
    missing = {id(s.master) for s in slots if not optimizer.state.get(s.master)}
    if not missing:
        return
    saved_grads = [s.master.grad for s in slots]
    saved_lrs = [g["lr"] for g in optimizer.param_groups]
    try:
        for slot in slots:
            fresh = id(slot.master) in missing
            slot.master.grad = torch.zeros_like(slot.master) if fresh else None
        for group in optimizer.param_groups:
            _zero_lr(group)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs, strict=True):
            group["lr"] = lr
        for slot, grad in zip(slots, saved_grads, strict=True):
            slot.master.grad = grad


def _flat_pieces(flat: torch.Tensor, slot: OwnedSlice, place: Placement) -> CheckpointPieces:
    local = flat.detach()  # a view DCP loads into in place (a param stepped in place too)
    if dtensors.is_dtensor(local):  # FSDP2's: this rank's rows
        local = local.to_local()  # type: ignore[attr-defined]
    return pieces_of_flat_slice(
        local.view(-1), slot.start, place.local_shape, place.offsets, place.global_shape
    )


def group_key(prefix: str, index: int, name: str) -> str:
    """The key of hyperparameter ``name`` of param group ``index``."""
    return f"{prefix}param_groups.{index}.{name}"


def _state_entries(
    state: Mapping[str, Any], slot: OwnedSlice, place: Placement, base: str
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            out[base + name] = value  # replicated over every rank owning a slice
        elif value.shape == slot.master.shape:
            out[base + name] = _flat_pieces(value, slot, place)
        else:
            raise NotImplementedError(
                f"optimizer state {name!r} of {place.key!r} has shape {tuple(value.shape)}, "
                f"neither a scalar nor the master slice's {tuple(slot.master.shape)}: it "
                "cannot be resharded elementwise"
            )
    return out


def build_state_dict(
    optimizer: torch.optim.Optimizer,
    slots: Sequence[OwnedSlice],
    places: Mapping[Param, Placement],
    names: Mapping[Param, str],
    prefix: str,
) -> dict[str, Any]:
    """Hyperparameters per param group, then per slot: the master and every state value
    (elementwise states as pieces, scalars and other values as themselves)."""
    out: dict[str, Any] = {}
    for index, group in enumerate(optimizer.param_groups):
        for name, value in group.items():
            if name != "params":
                out[group_key(prefix, index, name)] = value
    for slot in slots:
        state = optimizer.state.get(slot.master)
        if not state:
            raise RuntimeError(
                f"sharded_state_dict(): param '{names.get(slot.param, '<unnamed>')}' has no "
                "optimizer state yet; save after the first step(), or pass is_loading=True "
                "to build a state to load a checkpoint into"
            )
        place = places[slot.param]
        base = f"{prefix}{place.key}."
        out[base + MASTER_KEY] = _flat_pieces(slot.master, slot, place)
        out.update(_state_entries(state, slot, place, base))
    return out


class CheckpointKeys(NamedTuple):
    """How the last state dict was keyed: its prefix and each param's placement."""

    prefix: str
    places: Mapping[Param, Placement]


def _same_kind(old: object, new: object) -> bool:
    """A loaded value may replace ``old`` when it is of the same kind: a real number (or a
    one-element tensor) for a number, a tensor or number for a tensor, a sequence for a
    sequence, a bool or None for a bool or None (``foreach``), else the same type."""
    if old is None or isinstance(old, bool):
        return new is None or isinstance(new, bool)
    if isinstance(old, Real):
        scalar = isinstance(new, torch.Tensor) and new.numel() == 1
        return scalar or (isinstance(new, Real) and not isinstance(new, bool))
    if isinstance(old, torch.Tensor):
        return isinstance(new, torch.Tensor) or (
            isinstance(new, Real) and not isinstance(new, bool)
        )
    if isinstance(old, (list, tuple)):
        return isinstance(new, (list, tuple))
    return isinstance(new, type(old))


def check_loaded_values(
    optimizer: torch.optim.Optimizer,
    slots: Sequence[OwnedSlice],
    keys: CheckpointKeys,
    state_dict: Mapping[str, Any],
) -> None:
    """Every hyperparameter key present with a value of its current kind, and every
    non-tensor state value of its kind: checked before :func:`apply_loaded_values` changes
    anything."""
    prefix = keys.prefix
    for index, group in enumerate(optimizer.param_groups):
        for name in [n for n in group if n != "params"]:
            key = group_key(prefix, index, name)
            if key not in state_dict:
                raise InputValueError(
                    f"state_dict has no {key!r}: pass the dict the last sharded_state_dict() "
                    "call returned, after torch.distributed.checkpoint.load filled it"
                )
            _check_kind(key, group[name], state_dict[key])
    for slot in slots:
        base = f"{prefix}{keys.places[slot.param].key}."
        for name, value in optimizer.state[slot.master].items():
            if not isinstance(value, torch.Tensor) and base + name in state_dict:
                _check_kind(base + name, value, state_dict[base + name])


def _check_kind(key: str, old: object, new: object) -> None:
    if not _same_kind(old, new):
        raise InputTypeError(
            f"state_dict[{key!r}] is {new!r} ({type_name(new)}) where the optimizer holds "
            f"a {type_name(old)}: the checkpoint does not fit this optimizer"
        )


def apply_loaded_values(
    optimizer: torch.optim.Optimizer,
    slots: Sequence[OwnedSlice],
    keys: CheckpointKeys,
    state_dict: Mapping[str, Any],
) -> None:
    """Write the values DCP replaced in ``state_dict`` (hyperparameters and non-tensor
    states; tensors were loaded in place) back into the optimizer (after
    :func:`check_loaded_values`)."""
    prefix = keys.prefix
    for index, group in enumerate(optimizer.param_groups):
        for name in [n for n in group if n != "params"]:
            group[name] = state_dict[group_key(prefix, index, name)]
    for slot in slots:
        base = f"{prefix}{keys.places[slot.param].key}."
        state = optimizer.state[slot.master]
        for name, value in state.items():
            if not isinstance(value, torch.Tensor) and base + name in state_dict:
                state[name] = state_dict[base + name]


_SCALER_KEYS = ("scale", "growth_tracker", "hysteresis_tracker")


def scaler_entries(scaler_state: Mapping[str, Any], prefix: str) -> dict[str, Any]:
    """A loss scaler's state as ``{prefix}grad_scaler.{key}`` numbers."""
    return {f"{prefix}grad_scaler.{k}": scaler_state[k] for k in _SCALER_KEYS}


def scaler_state(state_dict: Mapping[str, Any], prefix: str) -> dict[str, Any] | None:
    """The scaler's state back from :func:`scaler_entries`' keys (None when the checkpoint
    holds none: saved without a scaler)."""
    keys = [f"{prefix}grad_scaler.{k}" for k in _SCALER_KEYS]
    if not all(k in state_dict for k in keys):
        return None
    return {k: state_dict[key] for k, key in zip(_SCALER_KEYS, keys, strict=True)}
