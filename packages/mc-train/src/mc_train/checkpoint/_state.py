r"""The model and optimizer state of a rank's chunks as one DCP state dict at full shape,
tied copies written once (layout and why: :mod:`mc_train.checkpoint`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
import mc_moe
from mc_ddp import (
    DistributedDataParallel,
    ShardedOptimizer,
    TorchFullyShardedDataParallel,
    ensure_params_ready,
    load_optimizer_sharded_state_dict,
    optimizer_sharded_state_dict,
)
from mc_groups import param_attrs
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["load_state", "model_sharded_state_dict", "save_state", "unwrap"]

MODEL_PREFIX = "model."
OPTIMIZER_PREFIX = "optimizer."


# ShardedOptimizer over mc DDP chunks, or a torch optimizer stepping the params in place
# (FSDP2's): both checkpointed in ShardedOptimizer's keys
Optimizer = ShardedOptimizer | torch.optim.Optimizer


def unwrap(chunk: nn.Module) -> nn.Module:
    """The model inside an mc ``DistributedDataParallel`` or ``TorchFullyShardedDataParallel``
    (the chunk itself otherwise)."""
    wrappers = (DistributedDataParallel, TorchFullyShardedDataParallel)
    return chunk.module if isinstance(chunk, wrappers) else chunk


def _entries(
    module: nn.Module, tp_group: dist.ProcessGroup | None, prefix: str, seen: set[int]
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(key, param, value)`` for every param of ``module`` not in ``seen`` (by identity),
    and the buffers ``mc_moe.model_sharded_state_dict`` holds (routers' expert biases)."""
    params = dict(module.named_parameters())  # each weight under its first name, as the dict
    buffers = dict(module.named_buffers())
    out: list[tuple[str, torch.Tensor, torch.Tensor]] = []
    for key, value in mc_moe.model_sharded_state_dict(module, tp_group, prefix).items():
        name = key[len(prefix) :]
        param = params[name] if name in params else buffers[name]
        if id(param) not in seen:
            seen.add(id(param))
            out.append((key, param, value))
    return out


def model_sharded_state_dict(
    module: nn.Module, tp_group: dist.ProcessGroup | None = None, prefix: str = MODEL_PREFIX
) -> dict[str, torch.Tensor]:
    """``{prefix + param name: DTensor or tensor}``: views of ``module``'s params for DCP
    (package notes): :func:`mc_moe.model_sharded_state_dict` (``mc_tp_layers``' views, and
    the experts of a model ``mc_moe.parallelize`` split, over ``ep`` × ``expt_tp``) of the
    model inside an mc DDP or FSDP2 wrapper, under ``model.``. Split params become DTensors
    over their layer's TP group, or over ``tp_group`` for a module without one (required
    when there are such params), FSDP2's over ``(tp, dp)``; a weight held twice is listed
    once. No communication (under FSDP2: one exchange over the data-parallel group)."""
    if not isinstance(module, nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    return mc_moe.model_sharded_state_dict(unwrap(module), tp_group, prefix)


def _shared_names(modules: Sequence[nn.Module]) -> list[tuple[int, str]]:
    return [
        (v, name)
        for v, module in enumerate(modules)
        for name, param in module.named_parameters()
        if param_attrs.is_shared_embedding(param)
    ]


def _copy_keys(modules: Sequence[nn.Module], pp: dist.ProcessGroup | None) -> dict[int, str]:
    """``{id(param): key}`` for this rank's copies of a weight tied across stages: the key
    the first stage writes it under (package notes). Collective over ``pp``."""
    mine = _shared_names(modules)
    if pp is None or mg.group_size(pp) == 1:
        return {}
    seen = cast(
        list[list[tuple[int, str]]],
        mg.all_gather_objects(mine, pp, label="checkpoint: tied weights"),
    )
    first = [name for v, name in seen[0] if v == 0]
    if not first:
        return {}
    rank, canonical = mg.group_rank(pp), MODEL_PREFIX + first[0]
    copies: dict[int, str] = {}
    for v, module in enumerate(modules):
        for name, param in module.named_parameters():
            marked = param_attrs.is_shared_embedding(param)
            if marked and not (rank == 0 and v == 0 and name == first[0]):
                copies[id(param)] = canonical
    return copies


class _State:
    """A rank's chunks and optimizer, and the DCP dict of them (package notes)."""

    def __init__(
        self,
        chunks: Sequence[nn.Module],
        optimizer: Optimizer | None,
        pg_collection: mg.ProcessGroupCollection,
    ) -> None:
        self.modules = [unwrap(c) for c in chunks]
        self.optimizer = optimizer
        self.tp = pg_collection.tp
        self.loading: dict[str, torch.Tensor] = {}  # the model views the load read into
        self._copies: dict[int, str] | None = None
        self._pp = pg_collection.pp

    def _ready(self) -> None:
        # An overlapped param all-gather may still be due (save: the params must be whole)
        # or in flight (load: it would overwrite what the load writes).
        for module in self.modules:
            ensure_params_ready(list(module.parameters()))

    def _split(self) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, torch.Tensor]]]:
        """The entries this rank writes, and its copies (own key → (the first stage's key,
        value))."""
        if self._copies is None:
            self._copies = _copy_keys(self.modules, self._pp)
        seen: set[int] = set()
        own: dict[str, torch.Tensor] = {}
        copies: dict[str, tuple[str, torch.Tensor]] = {}
        for module in self.modules:
            for key, param, value in _entries(module, self.tp, MODEL_PREFIX, seen):
                if id(param) in self._copies:
                    copies[key] = (self._copies[id(param)], value)
                else:
                    own[key] = value
        return own, copies

    def for_save(self) -> dict[str, Any]:
        self._ready()
        own, copies = self._split()
        if self.optimizer is None:
            return own
        # The optimizer finds every param it steps by memory; its state of the copies is
        # dropped (the first stage writes it).
        full = {**own, **{k: v for k, (_, v) in copies.items()}}
        state = self._optimizer_state(full, is_loading=False)
        dropped = tuple(f"{OPTIMIZER_PREFIX}{k}." for k in copies)
        return {**own, **{k: v for k, v in state.items() if not k.startswith(dropped)}}

    def for_load(self) -> dict[str, Any]:
        self._ready()
        own, copies = self._split()
        for key, (canonical, value) in copies.items():
            if canonical in own:
                raise InputValueError(
                    f"{key} is a copy of the tied weight {canonical}, which this rank holds "
                    "too: a tied weight's copies sit on the first and the last stage"
                )
            own[canonical] = value
        if self.optimizer is None:
            return own
        self.loading = own
        return {**own, **self._optimizer_state(own, is_loading=True)}

    def _optimizer_state(self, model: dict[str, torch.Tensor], is_loading: bool) -> dict[str, Any]:
        if isinstance(self.optimizer, ShardedOptimizer):
            return self.optimizer.sharded_state_dict(model, is_loading=is_loading)
        assert self.optimizer is not None
        return optimizer_sharded_state_dict(self.optimizer, model, is_loading=is_loading)

    def finish_load(self, loaded: dict[str, Any]) -> None:
        """After DCP filled ``loaded``: the optimizer's values DCP replaced (and, with
        ShardedOptimizer, the masters written into the params and gathered)."""
        if isinstance(self.optimizer, ShardedOptimizer):
            self.optimizer.load_sharded_state_dict(loaded)
        elif self.optimizer is not None:
            load_optimizer_sharded_state_dict(self.optimizer, loaded, self.loading)


def save_state(
    path: str,
    chunks: Sequence[nn.Module],
    optimizer: Optimizer | None,
    pg_collection: mg.ProcessGroupCollection,
) -> None:
    """Write the model (and optimizer) state of every rank's ``chunks`` to the folder
    ``path`` through DCP (collective over the world; package notes)."""
    from torch.distributed.checkpoint.state_dict_saver import save  # noqa: PLC0415 (slow)

    save(_State(_check_chunks(chunks), optimizer, pg_collection).for_save(), checkpoint_id=path)


def load_state(
    path: str,
    chunks: Sequence[nn.Module],
    optimizer: Optimizer | None,
    pg_collection: mg.ProcessGroupCollection,
) -> None:
    """Load a checkpoint written by :func:`save_state` at any layout into ``chunks`` (and
    ``optimizer``): params in place, then the masters are written into the params and, with
    the distributed optimizer, all-gathered. Collective over the world."""
    from torch.distributed.checkpoint.state_dict_loader import load  # noqa: PLC0415 (slow)

    state = _State(_check_chunks(chunks), optimizer, pg_collection)
    loaded = state.for_load()
    load(loaded, checkpoint_id=path)
    state.finish_load(loaded)


def _check_chunks(chunks: object) -> list[nn.Module]:
    if isinstance(chunks, nn.Module):
        return [chunks]
    if not isinstance(chunks, Iterable) or isinstance(chunks, (str, bytes)):
        raise InputTypeError(
            f"chunks must be a model chunk or a list of them (nn.Module), got {type_name(chunks)}"
        )
    out = list(chunks)
    if not out or not all(isinstance(c, nn.Module) for c in out):
        raise InputTypeError("chunks must be a non-empty list of nn.Module (this rank's chunks)")
    return out
