r"""``Checkpointer``: the object a training loop saves and resumes through (the package notes
of :mod:`mc_train.checkpoint` give the folder layout and the save and resume protocols)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import ShardedOptimizer
from mc_groups.argcheck import check_int, type_name
from mc_groups.errors import InputStateError, InputTypeError
from mc_train.checkpoint import _folders as folders
from mc_train.checkpoint._resume import Found, ResumeError, find_checkpoint
from mc_train.checkpoint._rng import RNGTracker, restore_rng, save_rng
from mc_train.checkpoint._run_state import STATE_FILE, RunState
from mc_train.checkpoint._state import _check_chunks, load_state, save_state

__all__ = ["CheckpointWriteError", "Checkpointer", "Resumed"]


class CheckpointWriteError(RuntimeError):
    """A save that failed on some rank; every rank raises it and nothing is published."""


class Resumed(NamedTuple):
    """What :meth:`Checkpointer.load` found and loaded: the checkpoint's ``path`` (None:
    nothing to resume, a fresh start), its ``step`` (0 then; the next step to train is
    ``step + 1``) and the ``state`` it was saved with (``{}`` then); ``ignored``: incomplete
    folders passed over, ``removed``: those of them deleted (leftovers of interrupted
    saves); ``damaged``: published checkpoints passed over because a file differs from its
    ``COMPLETE`` (``"step-N: why"``), kept on disk for a look."""

    path: Path | None
    step: int
    state: dict[str, Any]
    ignored: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    damaged: tuple[str, ...] = ()


def _attempt(action: Callable[[], object]) -> str | None:
    """``None`` when ``action`` ran, else its error as text (sent to the other ranks)."""
    from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415 (slow)

    try:
        action()
    except (OSError, RuntimeError, ValueError, CheckpointException) as err:
        return f"{type(err).__name__}: {err}"
    return None


class Checkpointer:
    """Saves and resumes this rank's ``model`` chunks and ``optimizer`` in ``folder``
    (module notes), at any TP × PP × DP layout.

    Args:
        folder: where checkpoints are published (``folder/step-NNNNNNNN``), on a file
            system every rank sees; None: this checkpointer only loads (by path).
        model: this rank's model chunks (mc DDP wrappers or plain modules), or one module.
        optimizer: their ``ShardedOptimizer``, or, for chunks under FSDP2, the
            ``torch.optim`` optimizer stepping their sharded params (checkpointed in
            ShardedOptimizer's keys: a checkpoint loads on either side,
            :mod:`mc_ddp.torch_optimizer_state`); None: the model only.
        pg_collection: the groups (``world`` coordinates; ``pp`` finds tied copies; ``tp``
            splits non-mc tensor-parallel params).
        interval: :meth:`save` writes every ``interval`` steps (and when told ``last``);
            None: only when told ``last``.
        keep: published checkpoints kept (the newest ``keep``; None: all).
        run: the settings a resuming run must share (JSON values), compared on load.
        rng_tracker: a tracker whose streams are saved with each rank's RNG states.
    """

    def __init__(
        self,
        folder: str | Path | None,
        model: nn.Module | Sequence[nn.Module],
        optimizer: ShardedOptimizer | torch.optim.Optimizer | None,
        *,
        pg_collection: mg.ProcessGroupCollection,
        interval: int | None = None,
        keep: int | None = None,
        run: Mapping[str, Any] | None = None,
        rng_tracker: RNGTracker | None = None,
    ) -> None:
        if folder is not None and not isinstance(folder, (str, Path)):
            raise InputTypeError(f"folder must be a path or None, got {type_name(folder)}")
        self.folder = None if folder is None else Path(folder)
        self.chunks = _check_chunks(model)
        if optimizer is not None and not isinstance(
            optimizer, (ShardedOptimizer, torch.optim.Optimizer)
        ):
            raise InputTypeError(
                f"optimizer must be an mc_ddp.ShardedOptimizer over the model's chunks, a "
                f"torch.optim.Optimizer over FSDP2's params, or None; got {type_name(optimizer)}"
            )
        self.optimizer = optimizer
        if not isinstance(pg_collection, mg.ProcessGroupCollection):
            raise InputTypeError(
                f"pg_collection must be a mc_groups.ProcessGroupCollection, got "
                f"{type_name(pg_collection)}"
            )
        self.pg_collection = pg_collection
        self.interval = None if interval is None else check_int("interval", interval)
        self.keep = None if keep is None else check_int("keep", keep)
        if run is not None and not isinstance(run, Mapping):
            raise InputTypeError(f"run must be a mapping of settings, got {type_name(run)}")
        self.run: dict[str, Any] = json.loads(json.dumps(dict(run or {})))
        self.rng_tracker = rng_tracker
        self.device = next(iter(self.chunks[0].parameters()), torch.empty(0)).device

    def _world(self) -> dist.ProcessGroup:
        return self.pg_collection.require("world", "Checkpointer")

    def should_save(self, step: int, *, last: bool = False) -> bool:
        """Whether :meth:`save` writes at ``step``: ``last``, or a multiple of the interval."""
        return last or (self.interval is not None and step % self.interval == 0)

    def _layout(self) -> dict[str, Any]:
        pgc = self.pg_collection
        sizes = {role: getattr(pgc, role) for role in ("tp", "pp", "dp", "cp")}
        layout = {k: 1 if g is None else mg.group_size(g) for k, g in sizes.items()}
        return {**layout, "chunks": len(self.chunks)}

    def save(
        self,
        step: int,
        *,
        state: Mapping[str, Any] | None = None,
        last: bool = False,
        after_write: Callable[[], None] | None = None,
    ) -> Path | None:
        """Publish the checkpoint of ``step`` when :meth:`should_save` says so (module
        notes; collective over the world) and return its folder, else None (nothing runs).
        ``state``: JSON values kept in ``trainer.json`` (a loss history, a scheduler).
        ``after_write`` runs on every rank once its own part is on disk, before the ranks
        agree that every part is (fault-injection tests kill a rank there).
        :class:`CheckpointWriteError` on every rank when some rank failed; nothing is
        published then."""
        check_int("step", step, minimum=0)
        if not self.should_save(step, last=last):
            return None
        if self.folder is None:
            raise InputStateError("this Checkpointer has no folder: it only loads; give it one")
        run_state = RunState(
            step=step,
            run=self.run,
            state=json.loads(json.dumps(dict(state or {}))),
            layout=self._layout(),
            world_size=mg.group_size(self._world()),
        )
        return self._save(run_state, self.folder, after_write)

    def _save(
        self, run_state: RunState, folder: Path, after_write: Callable[[], None] | None
    ) -> Path:
        world = self._world()
        rank = mg.group_rank(world)
        tmp = folders.partial_dir(folder, run_state.step)
        final = folders.checkpoint_dir(folder, run_state.step)
        prepared = _attempt(lambda: folders.empty(tmp)) if rank == 0 else None
        _agree_or_raise(prepared, world, f"preparing {tmp}")
        written = _attempt(lambda: self._write_part(tmp, rank))
        if after_write is not None:
            after_write()
        _agree_or_raise(written, world, f"writing {tmp}")
        published = _attempt(lambda: self._publish(tmp, final, run_state)) if rank == 0 else None
        _agree_or_raise(published, world, f"publishing {final}")
        return final

    def _write_part(self, tmp: Path, rank: int) -> None:
        save_state(str(tmp), self.chunks, self.optimizer, self.pg_collection)
        save_rng(tmp / folders.RNG / f"rank-{rank:05d}.pt", self.device, self.rng_tracker)

    def _publish(self, tmp: Path, final: Path, run_state: RunState) -> None:
        folders.publish(tmp, final, run_state)
        if self.keep is not None:
            folders.prune(final.parent, self.keep, final)

    def load(self, resume: str | Path | Found = "auto") -> Resumed:
        """Resume from ``resume`` (``"auto"``: the newest intact checkpoint in the folder,
        if any; a path: that checkpoint; a :class:`~mc_train.checkpoint.Found` from
        :func:`~mc_train.checkpoint.find_checkpoint`), collective over the world (module
        notes). ``ResumeError`` on every rank, before anything is loaded, when it cannot be
        resumed."""
        world = self._world()
        found = (
            resume
            if isinstance(resume, Found)
            else find_checkpoint(resume, self.folder, run=self.run, group=world)
        )
        removed: list[str] = []
        if mg.group_rank(world) == 0 and self.folder is not None:
            removed = folders.remove_partial(self.folder)
        if found.path is None:
            return Resumed(None, 0, {}, found.ignored, tuple(removed), found.damaged)
        path = found.path
        saved = RunState.from_json((path / STATE_FILE).read_text(encoding="utf-8"))
        from torch.distributed.checkpoint.api import CheckpointException  # noqa: PLC0415

        try:
            load_state(str(path), self.chunks, self.optimizer, self.pg_collection)
        except CheckpointException as err:  # DCP raises it on every rank
            raise ResumeError(
                f"checkpoint {path}: loading the model and optimizer failed: {err}"
            ) from err
        # A rank whose RNG file became unreadable since the verdict stops every rank here.
        with mg.fail_together(world, f"checkpoint {path}: restoring the RNG states"):
            if mg.group_size(world) == saved.world_size:
                rng = path / folders.RNG / f"rank-{mg.group_rank(world):05d}.pt"
                restore_rng(rng, self.device, self.rng_tracker)
        return Resumed(path, saved.step, saved.state, found.ignored, tuple(removed), found.damaged)


def _agree_or_raise(error: str | None, world: dist.ProcessGroup, what: str) -> None:
    """Every rank learns whether any rank failed ``what`` (also the barrier that orders
    the steps of a save)."""
    errors = mg.all_gather_objects(error, world, label=f"checkpoint: {what}")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        raise CheckpointWriteError(f"{what} failed on rank(s) {ranks}: {failed[0][1]}")
