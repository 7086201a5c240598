"""Checkpoint folders of a training run: written so that a crash at any moment leaves either
a complete checkpoint or one that is never loaded, and found again when the run restarts.

A save folder (the demo's ``--save-dir``) holds one folder per checkpoint::

    step-00000020/               published, hence complete
        .metadata, __R_0.distcp      model and optimizer, every rank's part (DCP, through
                                     examples.gpt.checkpoint: reshardable to any layout)
        rng/rank-00000.pt ...        each rank's RNG states (torch's CPU generator, and its
                                     CUDA device's under NCCL)
        trainer.json                 the step (also the data position: step t trains on
                                     global_batch(t)), every loss so far, the run's
                                     settings, the layout and world it was saved from
        COMPLETE                     written last: size and SHA-256 of every other file
    .step-00000030.partial/      being written, or left by a crash: never loaded

Saving step N (collective over the world): rank 0 empties ``.step-N.partial``; every rank
writes its DCP part and its RNG file there; the ranks agree that all of them finished (a
rank that failed stops the others here; one that died leaves them failing in this
collective), so nothing is published unless every part is on disk; rank 0 writes
``trainer.json`` and ``COMPLETE`` and renames the folder to ``step-N`` (``rename`` is atomic
within one file system); the ranks agree it is published. A folder named ``step-N`` is
therefore complete whenever a crash comes, and ``COMPLETE`` also catches files truncated or
changed afterwards.

Resuming (collective): every rank inspects the folder on its own (``auto``: the newest
``step-N`` holding its ``COMPLETE`` whose files all still match it, passing over and naming
damaged ones: a file truncated, missing or altered after publication; a path: that folder,
an error naming the file and the rank that wrote it when damaged), checks every file against
``COMPLETE`` and the run's settings against ``trainer.json``, and the ranks exchange their
verdicts, so every rank gets the same answer (this checkpoint, none, or the error) before
anything is built or written: a bad checkpoint stops all ranks with one message instead of
some ranks training while the others wait in a collective. The save folder must be on a file
system every node sees (DCP needs that anyway to reshard); ranks that see different
checkpoints are an error too.

A checkpoint is continued by a run with the same settings (model sizes, optimizer and its
hyperparameters, global batch, data seed: ``trainer.json``'s ``run``); the layout (TP, DP,
sequence parallelism, the distributed optimizer, micro-batches, the world size) may change,
since the model and optimizer state are stored at full-parameter shape. RNG states are
restored when the world size is the saved one (rank r gets rank r's); at another world size
there is no rank to take them from and they are left as they are (the demo draws no random
numbers after initialisation, so its losses do not depend on them).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch
from torch.distributed.checkpoint.api import CheckpointException

import mc_groups as mg
from examples.gpt.checkpoint import load_checkpoint, save_checkpoint
from examples.gpt.pipeline import PipelineTrainer
from examples.gpt.train import Trainer

__all__ = [
    "COMPLETE",
    "TRAINER_STATE",
    "CheckpointWriteError",
    "ResumeError",
    "RunState",
    "Verdict",
    "agree",
    "checkpoint_dir",
    "inspect",
    "load_run",
    "partial_dir",
    "remove_partial",
    "save_run",
]

FORMAT = 1
"""Version of the folder layout; a checkpoint of another version is refused."""
COMPLETE = "COMPLETE"
TRAINER_STATE = "trainer.json"
_RNG = "rng"
_STEP = re.compile(r"step-(\d{8})")
_LEFTOVER = re.compile(r"\.step-\d{8}\.(partial|replaced)")
_HASH_CHUNK = 1 << 20


class ResumeError(ValueError):
    """A checkpoint that cannot be resumed; every rank raises the same one."""


class CheckpointWriteError(RuntimeError):
    """A save that failed on some rank; every rank raises it and nothing is published."""


@dataclass(frozen=True)
class RunState:
    """What a checkpoint records besides the tensors (``trainer.json``).

    Attributes:
        step: optimizer steps done; also the data position (the next step trains on
            ``global_batch(step)``).
        losses: the loss of every step so far (``losses[t]`` is step ``t + 1``'s).
        run: the settings a continuing run must share (model, optimizer, global batch,
            data seed), as JSON values.
        layout: how the saving run was split (informational: any layout may resume).
        world_size: ranks of the saving run (RNG states are per rank).
    """

    step: int
    losses: list[float]
    run: dict[str, Any]
    layout: dict[str, Any]
    world_size: int

    def to_json(self) -> str:
        """``trainer.json``'s text (floats written exactly: JSON keeps Python's repr)."""
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunState:
        """Parse ``trainer.json``; ``ValueError`` when a field is missing or mistyped."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a format-{FORMAT} {TRAINER_STATE}")
        try:
            state = cls(
                step=data["step"],
                losses=data["losses"],
                run=data["run"],
                layout=data["layout"],
                world_size=data["world_size"],
            )
        except KeyError as err:
            raise ValueError(f"{TRAINER_STATE} has no {err}") from err
        if not (isinstance(state.step, int) and len(state.losses) == state.step):
            raise ValueError(f"step {state.step!r} with {len(state.losses)} losses")
        return state


def checkpoint_dir(save_dir: Path, step: int) -> Path:
    """The published checkpoint of ``step``: ``save_dir/step-NNNNNNNN``."""
    return save_dir / f"step-{step:08d}"


def partial_dir(save_dir: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is published."""
    return save_dir / f".step-{step:08d}.partial"


# -- saving ---------------------------------------------------------------------------


def save_run(
    trainer: Trainer | PipelineTrainer,
    save_dir: Path,
    state: RunState,
    *,
    after_write: Callable[[], None] | None = None,
) -> Path:
    """Write the checkpoint of ``state.step`` and publish it as ``step-N`` (collective over
    the world; see the module notes for the order). ``after_write`` runs on every rank once
    its own part is on disk, before the ranks agree that every part is (the elastic tests
    kill a rank there; the others then fail in that agreement and publish nothing).
    Returns the published folder; ``CheckpointWriteError`` on every rank when some rank
    failed, with nothing published."""
    world = trainer.pgc.require("world", "save_run")
    rank = mg.group_rank(world)
    tmp, final = partial_dir(save_dir, state.step), checkpoint_dir(save_dir, state.step)
    _agree_or_raise(_attempt(lambda: _empty(tmp)) if rank == 0 else None, world, f"preparing {tmp}")
    written = _attempt(lambda: _write_part(trainer, tmp, rank))
    if after_write is not None:
        after_write()
    _agree_or_raise(written, world, f"writing {tmp}")
    published = _attempt(lambda: _publish(tmp, final, state)) if rank == 0 else None
    _agree_or_raise(published, world, f"publishing {final}")
    return final


def _attempt(action: Callable[[], None]) -> str | None:
    """``None`` when ``action`` ran, else its error as text (sent to the other ranks)."""
    try:
        action()
    except (OSError, RuntimeError, ValueError, CheckpointException) as err:
        return f"{type(err).__name__}: {err}"
    return None


def _agree_or_raise(error: str | None, world: Any, what: str) -> None:
    """Every rank learns whether any rank failed ``what`` (this is also the barrier that
    orders the steps of a save)."""
    errors = mg.all_gather_objects(error, world, label=f"checkpoint: {what}")
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        ranks = ", ".join(str(r) for r, _ in failed)
        raise CheckpointWriteError(f"{what} failed on rank(s) {ranks}: {failed[0][1]}")


def _empty(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _write_part(trainer: Trainer | PipelineTrainer, tmp: Path, rank: int) -> None:
    save_checkpoint(trainer, str(tmp))
    rng = {"cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    (tmp / _RNG).mkdir(exist_ok=True)
    with (tmp / _RNG / f"rank-{rank:05d}.pt").open("wb") as f:
        torch.save(rng, f)
        f.flush()
        os.fsync(f.fileno())


def _publish(tmp: Path, final: Path, state: RunState) -> None:
    _write_synced(tmp / TRAINER_STATE, state.to_json())
    files = {rel: _describe(tmp / rel) for rel in _files(tmp) if rel != COMPLETE}
    manifest = {"format": FORMAT, "step": state.step, "files": files}
    _write_synced(tmp / COMPLETE, json.dumps(manifest, indent=1) + "\n")
    if final.exists():
        # A resume from an older checkpoint re-trains these steps: replace the old copy
        # (a crash between the two renames leaves no step-N, so auto takes an older one).
        old = final.with_name(f".{final.name}.replaced")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)


def _write_synced(path: Path, text: str) -> None:
    with path.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def _describe(path: Path) -> dict[str, Any]:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            digest.update(chunk)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


# -- resuming ---------------------------------------------------------------------------


class Verdict(NamedTuple):
    """One rank's answer to "what do we resume from?" (exchanged between the ranks).

    ``path`` None and ``error`` None: start fresh. ``ignored``: incomplete folders passed
    over by ``auto``; ``damaged``: complete ones it passed over because a file no longer
    matches ``COMPLETE`` (``"step-N: why"``, newest first)."""

    path: str | None
    step: int
    ignored: tuple[str, ...]
    error: str | None
    damaged: tuple[str, ...] = ()


def inspect(resume: str, save_dir: Path | None, run: Mapping[str, Any], steps: int) -> Verdict:
    """This rank's verdict on ``resume`` (``"auto"``: the newest complete checkpoint in
    ``save_dir``, or none; else the checkpoint folder at that path) for a run with the
    settings ``run`` that trains to ``steps``. Reads every file of the chosen checkpoint
    (sizes and SHA-256 against ``COMPLETE``). No communication."""
    try:
        if resume == "auto":
            if save_dir is None:
                raise ResumeError("--resume auto looks in --save-dir: pass --save-dir DIR")
            return _newest_intact(save_dir, run, steps)
        path = Path(resume)
        state = _verify(path)
        _check_run(path, state, run, steps)
        return Verdict(str(path), state.step, (), None)
    except ResumeError as err:
        return Verdict(None, 0, (), str(err))
    except OSError as err:  # unreadable: still a verdict, so no rank is left waiting
        return Verdict(None, 0, (), f"--resume {resume}: cannot read the checkpoint ({err})")


_ELSEWHERE = "; resume from another checkpoint"


class _Damaged(ResumeError):
    """A published checkpoint whose files no longer match its ``COMPLETE``."""


def _newest_intact(save_dir: Path, run: Mapping[str, Any], steps: int) -> Verdict:
    """``auto``: the newest published checkpoint whose files all match ``COMPLETE``
    (damaged ones are passed over and named), or none."""
    if not save_dir.is_dir():
        return Verdict(None, 0, (), None)
    entries = sorted(save_dir.iterdir(), key=lambda p: p.name, reverse=True)
    ignored = [p.name for p in entries if _LEFTOVER.fullmatch(p.name)]
    damaged: list[str] = []
    for entry in entries:
        if not (_STEP.fullmatch(entry.name) and entry.is_dir()):
            continue
        if not (entry / COMPLETE).is_file():
            ignored.append(entry.name)
            continue
        try:
            state = _verify(entry)
        except _Damaged as err:
            why = err.args[0].split(" is corrupted: ", 1)[-1].removesuffix(_ELSEWHERE)
            damaged.append(f"{entry.name}: {why}")
            continue
        _check_run(entry, state, run, steps)
        return Verdict(str(entry), state.step, tuple(sorted(ignored)), None, tuple(damaged))
    return Verdict(None, 0, tuple(sorted(ignored)), None, tuple(damaged))


def _writer(rel: str) -> str:
    """Which rank wrote ``rel`` of a checkpoint (DCP's ``__R_0.distcp`` and ``rng/rank-R.pt``
    are rank R's; the rest rank 0's)."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp|rng/rank-(\d+)\.pt", rel)
    return f"rank {int(next(g for g in match.groups() if g))}" if match else "rank 0"


def _verify(path: Path) -> RunState:
    """The checkpoint's ``RunState`` after checking it is complete and intact."""
    if not path.is_dir():
        raise ResumeError(f"--resume {path}: no such checkpoint folder")
    if not (path / COMPLETE).is_file():
        if any(_STEP.fullmatch(p.name) for p in path.iterdir()):
            raise ResumeError(
                f"--resume {path} is a folder of checkpoints; pass one of them (e.g. "
                f"{max(p for p in path.iterdir() if _STEP.fullmatch(p.name))}) or "
                f"--resume auto --save-dir {path}"
            )
        raise ResumeError(
            f"--resume {path} is incomplete: it has no {COMPLETE} file, so its save did not "
            "finish on every rank; resume from an earlier checkpoint"
        )
    try:
        manifest = json.loads((path / COMPLETE).read_text(encoding="utf-8"))
        if manifest["format"] != FORMAT:
            raise ValueError(f"format {manifest['format']!r}, this trainer reads {FORMAT}")
        files = cast(dict[str, dict[str, Any]], manifest["files"])
        if not all({"bytes", "sha256"} <= set(entry) for entry in files.values()):
            raise ValueError("a file entry without bytes and sha256")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise _Damaged(f"--resume {path} is corrupted: unreadable {COMPLETE} ({err})") from err
    for rel, expected in files.items():
        found = _describe(path / rel) if (path / rel).is_file() else None
        if found != expected:
            raise _Damaged(
                f"--resume {path} is corrupted: {rel} {_damage(found, expected)} (written by "
                f"{_writer(rel)}; {COMPLETE} records {expected['bytes']} bytes, SHA-256 "
                f"{expected['sha256'][:12]}...){_ELSEWHERE}"
            )
    try:
        return RunState.from_json((path / TRAINER_STATE).read_text(encoding="utf-8"))
    except (ValueError, TypeError) as err:
        raise _Damaged(f"--resume {path} is corrupted: bad {TRAINER_STATE} ({err})") from err


def _damage(found: dict[str, Any] | None, expected: dict[str, Any]) -> str:
    if found is None:
        return "is missing"
    if found["bytes"] != expected["bytes"]:
        return f"differs from what was written: {found['bytes']} bytes now (truncated or grown)"
    return "differs from what was written: same size, other content"


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def _check_run(path: Path, state: RunState, run: Mapping[str, Any], steps: int) -> None:
    saved, here = _flatten(state.run), _flatten(json.loads(json.dumps(run)))
    differ = [k for k in sorted(saved.keys() | here.keys()) if saved.get(k) != here.get(k)]
    if differ:
        listed = "; ".join(f"{k}: {saved.get(k)!r} there, {here.get(k)!r} here" for k in differ)
        raise ResumeError(
            f"--resume {path} was saved by another run ({listed}); resume with the settings "
            "it was saved with, or start afresh with another --save-dir"
        )
    if state.step > steps:
        raise ResumeError(
            f"--resume {path} is at step {state.step}, past --steps {steps}; pass --steps "
            f">= {state.step}"
        )


def agree(verdict: Verdict, world: Any) -> Verdict:
    """The verdict every rank resumes with (collective over ``world``): the common one, or
    ``ResumeError`` on every rank when any rank found an error or the ranks disagree."""
    verdicts = cast(list[Verdict], mg.all_gather_objects(verdict, world, label="resume verdict"))
    for rank, v in enumerate(verdicts):
        if v.error is not None:
            same = all(o.error == v.error for o in verdicts)
            raise ResumeError(v.error if same else f"rank {rank}: {v.error}")
    if any(v != verdicts[0] for v in verdicts):
        seen = "; ".join(f"rank {r}: {v.path or 'none'}" for r, v in enumerate(verdicts))
        raise ResumeError(
            f"the ranks see different checkpoints to resume ({seen}); --save-dir must be "
            "on a file system every node sees"
        )
    return verdicts[0]


def load_run(trainer: Trainer | PipelineTrainer, verdict: Verdict) -> RunState:
    """Load the checkpoint ``verdict`` names into ``trainer`` (collective): model and
    optimizer through DCP at this run's layout, then this rank's RNG states when the world
    size is the saved one. Returns the run state to continue from."""
    if verdict.path is None:
        raise ValueError("load_run needs a verdict naming a checkpoint")
    path = Path(verdict.path)
    state = RunState.from_json((path / TRAINER_STATE).read_text(encoding="utf-8"))
    try:
        load_checkpoint(trainer, str(path))
    except CheckpointException as err:  # DCP raises it on every rank
        raise ResumeError(
            f"--resume {path}: loading the model and optimizer failed: {err}"
        ) from err
    world = trainer.pgc.require("world", "load_run")
    # A rank whose RNG file became unreadable since the verdict stops every rank here.
    with mg.fail_together(world, f"--resume {path}: restoring the RNG states"):
        if mg.group_size(world) == state.world_size:
            _restore_rng(path / _RNG / f"rank-{mg.group_rank(world):05d}.pt", trainer.device)
    return state


def _restore_rng(path: Path, device: torch.device) -> None:
    saved = torch.load(path, weights_only=True)
    torch.set_rng_state(saved["cpu"])
    if device.type == "cuda" and "cuda" in saved:
        torch.cuda.set_rng_state(saved["cuda"], device)


def remove_partial(save_dir: Path) -> list[str]:
    """Delete what interrupted saves left in ``save_dir`` (``.step-N.partial`` and
    ``.step-N.replaced`` folders; never a ``step-N``) and return their names. Call on one
    rank, after the ranks agreed to resume and before the next save."""
    if not save_dir.is_dir():
        return []
    removed = sorted(p.name for p in save_dir.iterdir() if _LEFTOVER.fullmatch(p.name))
    for name in removed:
        shutil.rmtree(save_dir / name)
    return removed
