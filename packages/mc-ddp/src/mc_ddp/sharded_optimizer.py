"""``ShardedOptimizer``: steps any ``torch.optim`` optimizer on fp32 masters of this rank's
shard of the params, so ``use_distributed_optimizer`` can train.

The subset of Megatron's ``DistributedOptimizer`` it covers::

    grads   main_grad shard of rank r  (reduce-scattered by DDP's finish_grad_sync)
              │ (view when fp32, fp32 copy otherwise)
    step    master_r  (fp32 copy of param shard r; for fp32 params the shard itself, as
              │        in Megatron) ── wrapped optimizer.step() ──▶ master_r'
              │ cast to the param dtype (nothing to do for fp32)
    params  param_data shard r  ── DDP param all-gather (now, or overlapped with the next
                                   forward by the pre-hooks) ──▶ every rank's full params

Shards are the buckets' equal ``dp`` slices (``bucket.shard_param_slices``), which cut
params at any element, so a param may have a master on several ranks (one slice each).
Without the distributed optimizer every rank holds the full all-reduced grads, and the
"shard" is the whole buffer: every rank steps every param (a replicated fp32-master
optimizer).

Checkpoints: ``state_dict()`` is this rank's shard (same layout to load); for
``torch.distributed.checkpoint``, ``sharded_state_dict(model_sharded_state_dict)`` keys each
param's master and state by the model's key and stores them as pieces of full-param-shaped
tensors, so a checkpoint loads at any TP × DP layout and bucket size
(:mod:`mc_ddp.checkpoint_pieces`). Not covered: grad clipping, loss scaling, the fp16/bf16
overflow checks, and LBFGS (it caches its params at build).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import mc_groups as mg
from mc_ddp import _optimizer_state as sharded_state
from mc_ddp._optimizer_state import OwnedSlice
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp.distributed_data_parallel import DistributedDataParallel
from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["OwnedSlice", "ShardedOptimizer"]

Param = torch.nn.Parameter


def _as_chunks(model_chunks: object) -> list[DistributedDataParallel]:
    chunks = [model_chunks] if isinstance(model_chunks, DistributedDataParallel) else model_chunks
    if not isinstance(chunks, Sequence) or not chunks:
        raise InputTypeError(
            "model_chunks must be a DistributedDataParallel or a non-empty list of them, "
            f"got {type_name(model_chunks)}"
        )
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, DistributedDataParallel):
            raise InputTypeError(
                f"model_chunks[{i}] is a {type_name(chunk)}; wrap each model chunk in "
                "mc_ddp.DistributedDataParallel first"
            )
    return list(chunks)


def _check_optimizer(optimizer: object) -> torch.optim.Optimizer:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise InputTypeError(
            f"optimizer={type_name(optimizer)} must be a torch.optim.Optimizer built over "
            "the model's params, e.g. torch.optim.AdamW(ddp.parameters(), lr=1e-3)"
        )
    if isinstance(optimizer, torch.optim.LBFGS):
        raise InputTypeError("optimizer=LBFGS caches its params when built and cannot be sharded")
    if optimizer.state:
        raise InputValueError(
            "optimizer already holds state: build the ShardedOptimizer before the first step "
            "(its state lives on the fp32 shard masters)"
        )
    return optimizer


def _owned_ranges(group: ParamAndGradBucketGroup) -> list[tuple[Param, int, int]]:
    rank, size = group.shard.rank, group.shard.size
    if not group.ddp_config.use_distributed_optimizer:
        rank, size = 0, 1
    return [
        (s.param, s.param_range[0], s.param_range[1])
        for bucket in group.buckets
        for s in bucket.shard_param_slices(rank, size)
    ]


def _check_step_dispatch(flag: object, chunks: list[DistributedDataParallel]) -> bool:
    check_flag("overlap_param_gather_with_optimizer_step", flag)
    if flag and not all(c.ddp_config.overlap_param_gather for c in chunks):
        raise InputValueError(
            "overlap_param_gather_with_optimizer_step=True needs every model chunk built with "
            "ddp_config.overlap_param_gather=True (and use_distributed_optimizer=True)"
        )
    return bool(flag)


def _check_saved_masters(masters: object, slots: Sequence[OwnedSlice]) -> list[torch.Tensor]:
    expected = [tuple(s.master.shape) for s in slots]
    shapes = None
    if isinstance(masters, list) and all(isinstance(m, torch.Tensor) for m in masters):
        shapes = [tuple(m.shape) for m in masters]
    if shapes != expected:
        got = shapes if shapes is not None else type(masters).__name__
        raise InputValueError(
            "state_dict['master_params'] does not match this rank's shard layout (same "
            "model, data-parallel size and bucket layout needed): expected tensors of shapes "
            f"{expected}, got {got}"
        )
    assert isinstance(masters, list)  # checked above
    for i, master in enumerate(masters):
        if not master.is_floating_point():
            raise InputTypeError(
                f"state_dict['master_params'][{i}] is {master.dtype}, not floating-point"
            )
    return masters


class ShardedOptimizer:
    """Wraps ``optimizer`` (built over the model params) to step fp32 masters of the param
    slices this rank owns in ``model_chunks`` (DDP wrappers).

    Construction replaces each param group's ``params`` with the masters of the params it
    held (hyperparameters stay per group); a param group may end up empty on a rank.

    ``step()``: requires every bucket group to have finished its grad sync this iteration;
    drains in-flight param gathers; ``master.grad ← main_grad slice`` (fp32); steps;
    writes masters into the params (cast); then, with the distributed optimizer and without
    ``overlap_param_gather``, all-gathers params synchronously (``start_param_sync``);
    with it, the next forward's pre-hooks gather bucket group by bucket group, or, with
    ``overlap_param_gather_with_optimizer_step=True``, ``step()`` dispatches every group's
    gather asynchronously (model start first) and the pre-hooks only wait for them.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
        *,
        overlap_param_gather_with_optimizer_step: bool = False,
    ) -> None:
        self.optimizer = _check_optimizer(optimizer)
        self.model_chunks = _as_chunks(model_chunks)
        self.overlap_param_gather_with_optimizer_step = _check_step_dispatch(
            overlap_param_gather_with_optimizer_step, self.model_chunks
        )
        for chunk in self.model_chunks:
            chunk.overlap_param_gather_with_optimizer_step = (
                self.overlap_param_gather_with_optimizer_step
            )
        owned = self._owned_slices()
        self._stepped_on: tuple[int, ...] | None = None
        self._slots: list[OwnedSlice] = []
        self._checkpoint_keys: sharded_state.CheckpointKeys | None = None
        for i, group in enumerate(self.optimizer.param_groups):
            masters = []
            for param in group["params"]:
                if param not in owned:
                    raise InputValueError(self._unknown_param_message(i, param))
                for start, end in owned[param]:
                    masters.append(self._new_slot(param, start, end).master)
            group["params"] = masters

    def _owned_slices(self) -> dict[Param, list[tuple[int, int]]]:
        owned: dict[Param, list[tuple[int, int]]] = {}
        for chunk in self.model_chunks:
            for param in chunk.params_with_grad:
                owned.setdefault(param, [])
            for group in chunk._all_groups():
                for param, start, end in _owned_ranges(group):
                    owned[param].append((start, end))
        return owned

    def _unknown_param_message(self, group_index: int, param: Param) -> str:
        return (
            f"optimizer.param_groups[{group_index}] holds a param (shape {tuple(param.shape)}) "
            "that no model chunk trains; build the optimizer over ddp.parameters() of the "
            "chunks passed as model_chunks"
        )

    def _new_slot(self, param: Param, start: int, end: int) -> OwnedSlice:
        view = param.detach().view(-1)[start:end]
        aliased = param.dtype == torch.float32
        master = view if aliased else view.to(torch.float32, copy=True)
        slot = OwnedSlice(param, start, end, master, aliased)
        self._slots.append(slot)
        return slot

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's param groups, which hold the masters (for LR schedulers)."""
        return self.optimizer.param_groups

    @property
    def owned_slices(self) -> list[OwnedSlice]:
        """Every param slice this rank steps, in param-group order (whole params without
        the distributed optimizer)."""
        return list(self._slots)

    @property
    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, one per owned param slice."""
        return [slot.master for slot in self._slots]

    def _generations(self) -> tuple[int, ...]:
        return tuple(chunk._iteration.generation for chunk in self.model_chunks)

    def _require_new_grads(self) -> None:
        if self._stepped_on == self._generations():
            raise RuntimeError(
                "step(): this optimizer already stepped on this iteration's gradients; a "
                "second step would apply them twice. Start the next iteration first: "
                "ddp.zero_grad_buffer(), forward and backward, ddp.finish_grad_sync() (or "
                "finalize_model_grads)"
            )

    def _require_synced_grads(self) -> None:
        for chunk in self.model_chunks:
            chunk._require_usable("step()")
            pending = [g.name for g in chunk._all_groups() if not g.grad_reduce_finished]
            if pending:
                raise RuntimeError(
                    f"step(): {pending} have not finished their grad sync this iteration; call "
                    "ddp.finish_grad_sync() (or finalize_model_grads) after backward"
                )

    @torch.no_grad()
    def step(self) -> None:
        """One optimizer step on this rank's masters, then publish the params (see class).
        Refused (before anything changes) without finished grad sync, a second time on the
        same gradients, with offloaded grads or params, or after the groups were destroyed."""
        with mg.fail_together(None, "ShardedOptimizer.step"):  # one rank's misuse: all raise
            self._require_synced_grads()
            self._require_new_grads()
        self._drain_param_gathers()
        for slot in self._slots:
            grad = param_attrs.main_grad_of(slot.param).view(-1)[slot.start : slot.end]
            slot.master.grad = grad.to(torch.float32)
        self.optimizer.step()
        self._stepped_on = self._generations()
        self._write_masters_to_params()
        self._publish_params(force_sync=False)

    def _require_resident_params(self, what: str) -> None:
        for chunk in self.model_chunks:
            if chunk._params_offloaded():
                raise RuntimeError(
                    f"{what}: the params are offloaded (offload_to_cpu(move_params=True)); "
                    "call each buffer's reload_from_cpu(move_params=True) first"
                )

    def _require_publishable(self, what: str) -> None:
        """Before writing params and all-gathering them: resident params, live groups."""
        for chunk in self.model_chunks:
            chunk._require_usable(what, grads=False)

    def _drain_param_gathers(self) -> None:
        # A gather still in flight would overwrite the shards this step writes.
        for chunk in self.model_chunks:
            for group in chunk._all_groups():
                group._wait_param_gather()

    def _write_masters_to_params(self) -> None:
        for slot in self._slots:
            if not slot.aliased:
                slot.param.data.view(-1)[slot.start : slot.end].copy_(slot.master)

    def _publish_params(self, *, force_sync: bool) -> None:
        for chunk in self.model_chunks:
            cfg = chunk.ddp_config
            if not cfg.use_distributed_optimizer:
                continue
            if force_sync or not cfg.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)
            elif self.overlap_param_gather_with_optimizer_step:
                chunk.start_param_sync(force_dispatch=True)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the masters' grads and the model params' ``.grad``.

        ``set_to_none`` is accepted for torch's signature; either way the grads become None,
        because ``step()`` rebuilds every master grad from ``main_grad`` (the DDP grad buffer
        is zeroed by ``ddp.zero_grad_buffer()``).
        """
        check_flag("set_to_none", set_to_none)
        for slot in self._slots:
            slot.master.grad = None
        for chunk in self.model_chunks:
            for param in chunk.params_with_grad:
                param.grad = None

    @torch.no_grad()
    def reload_model_params(self) -> None:
        """Refresh the masters from the current params (after ``broadcast_params`` or a
        checkpoint loaded into the model; fp32 masters alias the params already)."""
        self._require_resident_params("reload_model_params()")
        for slot in self._slots:
            if not slot.aliased:
                slot.master.copy_(slot.param.detach().view(-1)[slot.start : slot.end])

    def state_dict(self) -> dict[str, Any]:
        """A snapshot of this rank's state: the wrapped optimizer's state dict and the
        masters, copied (torch's own state_dict returns live references, so loading it into
        a second optimizer would make the two share moments)."""
        return {
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "master_params": [slot.master.clone() for slot in self._slots],
        }

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's state, write the masters into the params and all-gather them
        (collective with the distributed optimizer: every rank calls it). Everything is
        checked before anything is loaded: a mapping with ``master_params`` (tensors shaped
        like this rank's masters) and ``optimizer`` (the wrapped optimizer's state dict)."""
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(
                "state_dict must be the mapping ShardedOptimizer.state_dict() returned, got "
                f"{type_name(state_dict)}"
            )
        missing = [k for k in ("master_params", "optimizer") if k not in state_dict]
        if missing:
            raise InputValueError(
                f"state_dict has no {missing}: pass what ShardedOptimizer.state_dict() returned"
            )
        masters = _check_saved_masters(state_dict["master_params"], self._slots)
        inner = state_dict["optimizer"]
        if not isinstance(inner, Mapping) or not {"state", "param_groups"} <= set(inner):
            raise InputTypeError(
                "state_dict['optimizer'] must be the wrapped optimizer's state dict (with "
                f"'state' and 'param_groups'), got {type_name(inner)}"
            )
        self._require_publishable("load_state_dict()")
        self.optimizer.load_state_dict(dict(inner))
        for slot, saved in zip(self._slots, masters, strict=True):
            slot.master.copy_(saved)
        self._drain_param_gathers()
        self._write_masters_to_params()
        self._publish_params(force_sync=True)

    # -- distributed checkpoint (torch.distributed.checkpoint) -----------------------

    def _names(self) -> dict[Param, str]:
        return {p: n for chunk in self.model_chunks for p, n in chunk.param_to_name.items()}

    def sharded_state_dict(
        self,
        model_sharded_state_dict: Mapping[str, Any],
        is_loading: bool = False,
        prefix: str = "optimizer.",
    ) -> dict[str, Any]:
        """This rank's optimizer state for ``torch.distributed.checkpoint``, resharded by
        DCP to whatever layout loads it (TP size, DP size, bucket size, with or without the
        distributed optimizer).

        Each param is found in ``model_sharded_state_dict`` (the model chunks' DCP state
        dict, e.g. from the mc layers' ``sharded_state_dict()``: a DTensor or tensor viewing
        the param, under key ``K``). The master slice ``[start, end)`` this rank steps, and
        each optimizer state of that shape (Adam's ``exp_avg``, ``exp_avg_sq``), become
        :class:`~mc_ddp.checkpoint_pieces.CheckpointPieces` of a tensor shaped like ``K``'s
        global tensor: the boxes of the flat slice, placed at ``K``'s offsets on this rank.
        Keys: ``{prefix}{K}.fp32_param``, ``{prefix}{K}.{state}``; scalar states (``step``)
        and non-tensor states are stored as themselves under the same scheme (every rank
        owning a slice holds the same value; DCP writes one), and each param group's
        hyperparameters under ``{prefix}param_groups.{i}.{name}``.

        Saving (``is_loading=False``) needs state for every slice (after the first step).
        Loading (``is_loading=True``): slices without state first get the optimizer's own
        (one lr = 0 step on zero grads, which leaves every param unchanged), so DCP has
        tensors to load into. Tensors are views: ``dcp.save`` reads them, ``dcp.load`` writes
        them in place; then call :meth:`load_sharded_state_dict` with the same dict.
        Collective over the world (every rank calls it; ``dcp.save``/``dcp.load`` follow):
        one status exchange after the checks, so a check failing on one rank is an error on
        every rank (:func:`mc_groups.fail_together`) instead of a wait inside DCP.
        """
        with mg.fail_together(None, "ShardedOptimizer.sharded_state_dict"):
            if not isinstance(model_sharded_state_dict, Mapping):
                raise InputTypeError(
                    "model_sharded_state_dict must be a mapping {key: DTensor or tensor} (the "
                    f"model's sharded_state_dict()), got {type_name(model_sharded_state_dict)}"
                )
            if not isinstance(is_loading, bool):
                raise InputTypeError(f"is_loading={is_loading!r} must be a bool")
            if not isinstance(prefix, str):
                raise InputTypeError(f"prefix={prefix!r} must be a str, e.g. 'optimizer.'")
            names = self._names()
            places = sharded_state.placements(model_sharded_state_dict, self._slots, names)
        if is_loading:
            sharded_state.materialize_state(self.optimizer, self._slots)
        built = sharded_state.build_state_dict(self.optimizer, self._slots, places, names, prefix)
        self._checkpoint_keys = sharded_state.CheckpointKeys(prefix, places)
        return built

    @torch.no_grad()
    def load_sharded_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Finish a load into the dict the last :meth:`sharded_state_dict` call
        (``is_loading=True``) returned, after ``dcp.load`` filled it: restore the
        hyperparameters and non-tensor states DCP replaced in the dict, write the masters
        into the params (cast) and all-gather them (collective with the distributed
        optimizer: every rank calls it).
        """
        with mg.fail_together(None, "ShardedOptimizer.load_sharded_state_dict"):
            if not isinstance(state_dict, Mapping):
                raise InputTypeError(
                    f"state_dict must be the mapping sharded_state_dict() returned, got "
                    f"{type_name(state_dict)}"
                )
            keys = self._checkpoint_keys
            if keys is None:
                raise RuntimeError(
                    "load_sharded_state_dict() before sharded_state_dict(): build the dict with "
                    "sharded_state_dict(model_sharded_state_dict, is_loading=True), load it with "
                    "torch.distributed.checkpoint.load, then pass it here"
                )
            sharded_state.check_loaded_values(self.optimizer, self._slots, keys, state_dict)
            self._require_publishable("load_sharded_state_dict()")
        sharded_state.apply_loaded_values(self.optimizer, self._slots, keys, state_dict)
        self._drain_param_gathers()
        self._write_masters_to_params()
        self._publish_params(force_sync=True)
