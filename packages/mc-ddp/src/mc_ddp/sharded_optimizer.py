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
(:mod:`mc_ddp.checkpoint_pieces`). Not covered: LBFGS (it caches its params at build).

A guarded step (``max_grad_norm=`` and/or ``grad_scaler=``, or ``clip_grad_norm()``): the
global grad norm (every piece counted once, :mod:`mc_ddp.grad_norm`), the overflow flag and
the step's own checks in one all-reduce, then one multiply that unscales and clips, or a
skip on every rank; ``step()`` returns a :class:`~mc_ddp.StepResult`.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import mc_groups as mg
from mc_ddp import _optimizer_checks as checks
from mc_ddp import _optimizer_state as sharded_state
from mc_ddp import _step_guard as guarded
from mc_ddp._optimizer_state import OwnedSlice
from mc_ddp._step_guard import StepResult
from mc_ddp.distributed_data_parallel import DistributedDataParallel
from mc_ddp.grad_norm import counted_slices
from mc_ddp.grad_scaler import DynamicGradScaler
from mc_groups.argcheck import check_flag, type_name
from mc_groups.collection import collection_or_default
from mc_groups.comm.cross_rank import CarriedStatus
from mc_groups.errors import InputStateError, InputTypeError, InputValueError
from mc_groups.param_attrs import MAIN_GRAD

__all__ = ["OwnedSlice", "ShardedOptimizer", "StepResult"]

Param = torch.nn.Parameter


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

    **Clipping and loss scaling** (see the module notes and ``docs/optimizer.md``):

    - ``max_grad_norm``: every ``step()`` computes the global grad norm of order
      ``norm_type`` (2.0, another p >= 1, or ``inf``) over the whole model, each piece
      counted once (:mod:`mc_ddp.grad_norm`), and scales every owned grad by
      ``min(1, max_grad_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``'s
      rule); :meth:`clip_grad_norm` does the same on demand and returns the norm.
    - ``grad_scaler`` (:class:`~mc_ddp.DynamicGradScaler`, fp16): scale the loss with
      :meth:`scale_loss`; ``step()`` unscales, skips the step on every rank when any owned
      grad on any rank overflowed, and updates the scale (``torch.amp.GradScaler``'s
      semantics). Refused on bf16 params (they need no scaler).
    - A non-finite norm skips the step on every rank (``StepResult.skipped``), or with
      ``error_if_nonfinite=True`` raises ``FloatingPointError`` on every rank.

    **One rank's failed check.** ``step()`` checks its preconditions on every rank
    (finished grad sync, not stepped twice, grads resident). A guarded step carries that
    status in its norm / overflow all-reduce (one more element: no extra collective), so a
    check failing on one rank is an error on every rank. An unguarded step issues what
    Megatron's does (the param all-gather) and nothing else: a check failing on one rank
    raises there, and its peers fail in their next collective within the group's timeout.
    ``peer_checks=True`` adds one :func:`mc_groups.fail_together` exchange per unguarded
    step (a world collective and, on GPUs, a host sync) so that every rank raises at once.

    Args:
        optimizer: a ``torch.optim`` optimizer built over the chunks' params.
        model_chunks: the DDP-wrapped model chunks (one per virtual pipeline stage).
        overlap_param_gather_with_optimizer_step: dispatch every param gather from
            ``step()`` (needs ``overlap_param_gather`` on every chunk).
        max_grad_norm: clip to this global norm (> 0) at every step; None: no clipping.
        norm_type: the norm's order (2.0, p >= 1, ``float('inf')`` or ``"inf"``).
        grad_scaler: fp16 dynamic loss scaling; None: none.
        error_if_nonfinite: raise instead of skipping when the norm is not finite.
        peer_checks: a status exchange per unguarded step (opt-in, see above).
        pg_collection: the groups the norm reads ranks from (``tp``, ``expt_tp``,
            ``gtp_remat``, ``expt_gtp_remat``, ``embd``, ``pp``); None: the registered
            default collection, looked up at the first norm.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model_chunks: DistributedDataParallel | Sequence[DistributedDataParallel],
        *,
        overlap_param_gather_with_optimizer_step: bool = False,
        max_grad_norm: float | None = None,
        norm_type: float | str = 2.0,
        grad_scaler: DynamicGradScaler | None = None,
        error_if_nonfinite: bool = False,
        peer_checks: bool = False,
        pg_collection: mg.ProcessGroupCollection | None = None,
    ) -> None:
        self.optimizer = checks.check_optimizer(optimizer)
        self.model_chunks = checks.as_chunks(model_chunks)
        self.overlap_param_gather_with_optimizer_step = checks.check_step_dispatch(
            overlap_param_gather_with_optimizer_step, self.model_chunks
        )
        self.max_grad_norm = checks.check_max_norm(max_grad_norm, "max_grad_norm", optional=True)
        self.norm_type = checks.check_norm_type(norm_type)
        self.grad_scaler = checks.check_scaler(grad_scaler, self.model_chunks)
        self.error_if_nonfinite = check_flag("error_if_nonfinite", error_if_nonfinite)
        self.peer_checks = check_flag("peer_checks", peer_checks)
        self._pg_collection = checks.check_optional_collection(pg_collection)
        self._prepared: tuple[tuple[int, ...], StepResult] | None = None
        self._counted: list[bool] | None = None
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
                for param, start, end in checks.owned_ranges(group):
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

    @property
    def _guard(self) -> guarded.Guard | None:
        if self.max_grad_norm is None and self.grad_scaler is None:
            return None
        return guarded.Guard(
            self.max_grad_norm, self.norm_type, self.grad_scaler, self.error_if_nonfinite
        )

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float, norm_type: float | str = 2.0) -> float:
        """Clip this iteration's grads to the global norm ``max_norm`` and return the norm
        before clipping (``torch.nn.utils.clip_grad_norm_``'s contract, over the whole
        sharded model; Megatron's ``optimizer.clip_grad_norm``). With a ``grad_scaler`` the
        grads are unscaled first and the norm is the unscaled one.

        Collective over the world: one all-reduce of a few numbers that also carries the
        step's checks (the next ``step()`` then issues no status exchange and no second
        norm). Once per iteration (a second call is an ``InputStateError``). A non-finite
        norm, or an overflow under loss scaling, leaves the grads as they are and makes the
        next ``step()`` skip (``error_if_nonfinite=True``: ``FloatingPointError`` on every
        rank). Bad arguments raise before any collective.
        """
        guard = guarded.Guard(
            checks.check_max_norm(max_norm, "max_norm"),
            checks.check_norm_type(norm_type),
            self.grad_scaler,
            self.error_if_nonfinite,
        )
        outcome = self._guarded(guard, "ShardedOptimizer.clip_grad_norm")
        assert outcome.grad_norm is not None  # a Guard with max_norm computes it
        return outcome.grad_norm

    @torch.no_grad()
    def step(self) -> StepResult:
        """One optimizer step on this rank's masters, then publish the params (see class).
        Refused (before anything changes, on every rank) without finished grad sync, a
        second time on the same gradients, with offloaded grads or params, or after the
        groups were destroyed. Returns what happened (:class:`StepResult`)."""
        outcome = self._prepared_outcome()
        if outcome is None:
            guard = self._guard
            if guard is not None:
                outcome = self._guarded(guard, "ShardedOptimizer.step")
            else:
                self._check_unguarded_step()
                self._build_master_grads()
                outcome = StepResult(skipped=False)
        self._drain_param_gathers()
        if not outcome.skipped:
            self.optimizer.step()
        self._stepped_on = self._generations()
        self._prepared = None
        if self.grad_scaler is not None:
            self.grad_scaler.update(outcome.found_inf)
        if not outcome.skipped:
            self._write_masters_to_params()
        self._publish_params(force_sync=False)
        return outcome

    def _build_master_grads(self) -> list[torch.Tensor]:
        """``master.grad ← main_grad[start:end]`` as fp32 (a view for fp32 grads, a copy
        otherwise) for every owned slice; returns them in slice order."""
        grads = []
        for slot in self._slots:
            main_grad: torch.Tensor = getattr(slot.param, MAIN_GRAD)  # set by the buffer
            slot.master.grad = main_grad.view(-1)[slot.start : slot.end].to(torch.float32)
            grads.append(slot.master.grad)
        return grads

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss × S`` with the scaler's current scale (``loss`` itself without a scaler):
        backward from the result (Megatron's ``optimizer.scale_loss``)."""
        if self.grad_scaler is None:
            return loss
        return loss * self.grad_scaler.scale

    def get_loss_scale(self) -> float:
        """The scale the next backward's loss should carry (1.0 without a scaler)."""
        return 1.0 if self.grad_scaler is None else self.grad_scaler.scale

    def _check_unguarded_step(self) -> None:
        if not self.peer_checks:
            self._require_step_ready()
            return
        with mg.fail_together(None, "ShardedOptimizer.step"):  # one rank's misuse: all raise
            self._require_step_ready()

    def _require_step_ready(self) -> None:
        self._require_synced_grads()
        self._require_new_grads()

    def _prepared_outcome(self) -> StepResult | None:
        if self._prepared is not None and self._prepared[0] == self._generations():
            return self._prepared[1]
        return None

    def _guarded(self, guard: guarded.Guard, where: str) -> StepResult:
        """Checks, norm and overflow in one all-reduce, then unscale and clip (or skip)."""
        status = CarriedStatus(where)
        counted: list[bool] = []
        with status.checks():
            self._require_step_ready()
            if self._prepared_outcome() is not None:
                raise InputStateError(
                    f"{where}: clip_grad_norm() already unscaled and clipped this iteration's "
                    "grads; call step() (or start the next iteration) instead of clipping twice"
                )
            counted = self._counted_slots() if guard.max_norm is not None else []
        grads = self._build_master_grads() if status.passed else []
        counted = counted or [False] * len(grads)
        outcome = guarded.reduce_step_values(guard, grads, counted, status, self._device())
        if guard.error_if_nonfinite and guard.scaler is None and outcome.skipped:
            raise FloatingPointError(
                f"{where}: a grad holds inf or NaN (global grad norm {outcome.grad_norm}); "
                "every rank raises and no param changed. Pass error_if_nonfinite=False to "
                "skip such steps"
            )
        guarded.apply(guard, outcome, grads)
        self._prepared = (self._generations(), outcome)
        return outcome

    def _counted_slots(self) -> list[bool]:
        """Per slot: this rank counts it in the global norm (computed once)."""
        if self._counted is None:
            pgc = collection_or_default(self._pg_collection, "ShardedOptimizer (grad norm)")
            self._counted = counted_slices(self.model_chunks, self._slots, pgc)
        return self._counted

    def _device(self) -> torch.device:
        for chunk in self.model_chunks:
            for param in chunk.params_with_grad:
                return param.device
        return torch.device("cpu")

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
        """A snapshot of this rank's state: the wrapped optimizer's state dict, the masters
        and the loss scaler's state (``grad_scaler``), copied (torch's own state_dict
        returns live references: loading it into a second optimizer would share moments)."""
        state = {
            "optimizer": copy.deepcopy(self.optimizer.state_dict()),
            "master_params": [slot.master.clone() for slot in self._slots],
        }
        if self.grad_scaler is not None:
            state["grad_scaler"] = self.grad_scaler.state_dict()
        return state

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load this rank's state, write the masters into the params and all-gather them
        (collective with the distributed optimizer: every rank calls it). Everything is
        checked before anything is loaded: a mapping with ``master_params`` (tensors shaped
        like this rank's masters) and ``optimizer`` (the wrapped optimizer's state dict)."""
        masters, inner = checks.check_saved_state(state_dict, self._slots)
        self._require_publishable("load_state_dict()")
        if self.grad_scaler is not None and "grad_scaler" in state_dict:
            self.grad_scaler.load_state_dict(state_dict["grad_scaler"])  # checks, then loads
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
        hyperparameters under ``{prefix}param_groups.{i}.{name}`` (a loss scaler's state
        under ``{prefix}grad_scaler.{scale,growth_tracker,hysteresis_tracker}``).

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
            checks.check_sharded_state_args(model_sharded_state_dict, is_loading, prefix)
            names = self._names()
            places = sharded_state.placements(model_sharded_state_dict, self._slots, names)
        if is_loading:
            sharded_state.materialize_state(self.optimizer, self._slots)
        built = sharded_state.build_state_dict(self.optimizer, self._slots, places, names, prefix)
        if self.grad_scaler is not None:  # replicated numbers: DCP writes one
            built.update(sharded_state.scaler_entries(self.grad_scaler.state_dict(), prefix))
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
            if self.grad_scaler is not None:  # checks, then loads (before anything else)
                saved = sharded_state.scaler_state(state_dict, keys.prefix)
                if saved is not None:
                    self.grad_scaler.load_state_dict(saved)
        sharded_state.apply_loaded_values(self.optimizer, self._slots, keys, state_dict)
        self._drain_param_gathers()
        self._write_masters_to_params()
        self._publish_params(force_sync=True)
