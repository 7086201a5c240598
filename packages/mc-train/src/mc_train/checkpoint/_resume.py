r"""Which checkpoint a run resumes from, decided by every rank together.

:func:`find_checkpoint` (collective over ``group``, the world by default): every rank
inspects the folder on its own (``"auto"``: the newest ``step-N`` holding its ``COMPLETE``
whose files all still match it, passing over and naming damaged ones; a path: that
checkpoint, an error naming the damaged file and the rank that wrote it), checks every file
against ``COMPLETE`` and the run's settings against ``trainer.json``; then the ranks
exchange their verdicts (one all-gather of small objects), so every rank gets the same
answer (this checkpoint, none, or one :class:`ResumeError`) before anything is built or
written. A bad checkpoint stops all ranks with one message instead of some ranks training
while the others wait in a collective; ranks that see different checkpoints (a folder not
shared by every node) are an error too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple, cast

import torch.distributed as dist

import mc_groups as mg
from mc_groups.argcheck import check_optional_group, type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_train.checkpoint._folders import (
    COMPLETE,
    LEFTOVER,
    Damaged,
    published_steps,
    verify,
)
from mc_train.checkpoint._run_state import RunState

__all__ = [
    "Found",
    "ResumeError",
    "agree_on_checkpoint",
    "find_checkpoint",
    "inspect_checkpoint",
]


class ResumeError(InputValueError):
    """A checkpoint that cannot be resumed; every rank raises the same one."""


class Found(NamedTuple):
    """The checkpoint a run resumes from (the ranks' common verdict): its folder ``path``
    (None: start fresh) and ``step`` (0 then); ``ignored``: incomplete folders passed over
    (``step-N`` without ``COMPLETE``, leftovers of interrupted saves), by name;
    ``damaged``: complete ones passed over because a file no longer matches ``COMPLETE``
    (``"step-N: why"``, newest first)."""

    path: Path | None
    step: int
    ignored: tuple[str, ...] = ()
    damaged: tuple[str, ...] = ()


class _Verdict(NamedTuple):
    """One rank's answer, exchanged between the ranks (plain values only)."""

    path: str | None
    step: int
    ignored: tuple[str, ...]
    damaged: tuple[str, ...]
    error: str | None


def _flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out |= _flatten(value, f"{prefix}{key}.")
        else:
            out[prefix + key] = value
    return out


def _check_run(path: Path, state: RunState, run: Mapping[str, Any]) -> None:
    saved, here = _flatten(state.run), _flatten(json.loads(json.dumps(dict(run))))
    differ = [k for k in sorted(saved.keys() | here.keys()) if saved.get(k) != here.get(k)]
    if differ:
        listed = "; ".join(f"{k}: {saved.get(k)!r} there, {here.get(k)!r} here" for k in differ)
        raise ResumeError(
            f"checkpoint {path} was saved by another run ({listed}); resume with the settings "
            "it was saved with, or start afresh in another folder"
        )


def _one(path: Path, run: Mapping[str, Any]) -> RunState:
    """The run state of the checkpoint ``path``, checked (``ResumeError`` naming why not)."""
    if not path.is_dir():
        raise ResumeError(f"checkpoint {path}: no such checkpoint folder")
    if not (path / COMPLETE).is_file():
        newest = published_steps(path)
        if newest:
            raise ResumeError(
                f"checkpoint {path} is a folder of checkpoints; pass one of them (e.g. "
                f"{newest[0][1]}) or resume 'auto' from that folder"
            )
        raise ResumeError(
            f"checkpoint {path} is incomplete: it has no {COMPLETE} file, so its save did not "
            "finish on every rank; resume from an earlier checkpoint"
        )
    try:
        state = verify(path)
    except Damaged as err:
        raise ResumeError(
            f"checkpoint {path} is corrupted: {err.args[0]}; resume from another checkpoint"
        ) from err
    _check_run(path, state, run)
    return state


def _newest_intact(folder: Path, run: Mapping[str, Any]) -> _Verdict:
    if not folder.is_dir():
        return _Verdict(None, 0, (), (), None)
    ignored = [p.name for p in folder.iterdir() if LEFTOVER.fullmatch(p.name)]
    damaged: list[str] = []
    for _, entry in published_steps(folder):
        if not (entry / COMPLETE).is_file():
            ignored.append(entry.name)
            continue
        try:
            state = verify(entry)
        except Damaged as err:
            damaged.append(f"{entry.name}: {err.args[0]}")
            continue
        _check_run(entry, state, run)
        return _Verdict(str(entry), state.step, tuple(sorted(ignored)), tuple(damaged), None)
    return _Verdict(None, 0, tuple(sorted(ignored)), tuple(damaged), None)


def inspect_checkpoint(resume: str | Path, folder: Path | None, run: Mapping[str, Any]) -> Found:
    """This rank's verdict on ``resume`` (``"auto"``: the newest intact checkpoint in
    ``folder``, or none; else the checkpoint folder at that path) for a run with the
    settings ``run``; ``ResumeError`` when it cannot be resumed. Reads every file of the
    chosen checkpoint. No communication (:func:`find_checkpoint` is the collective one)."""
    verdict = _inspect(resume, folder, run)
    if verdict.error is not None:
        raise ResumeError(verdict.error)
    return _found(verdict)


def _inspect(resume: str | Path, folder: Path | None, run: Mapping[str, Any]) -> _Verdict:
    try:
        if resume == "auto":
            if folder is None:
                raise ResumeError(
                    "resume 'auto' looks for the newest checkpoint in the checkpoint folder, "
                    "and none was given"
                )
            return _newest_intact(folder, run)
        path = Path(resume)
        state = _one(path, run)
        return _Verdict(str(path), state.step, (), (), None)
    except ResumeError as err:
        return _Verdict(None, 0, (), (), str(err))
    except OSError as err:  # unreadable: still a verdict, so no rank is left waiting
        return _Verdict(None, 0, (), (), f"checkpoint {resume}: cannot read it ({err})")


def _found(v: _Verdict) -> Found:
    return Found(None if v.path is None else Path(v.path), v.step, v.ignored, v.damaged)


def _agree(verdict: _Verdict, group: dist.ProcessGroup | None) -> Found:
    group = group if group is not None else dist.group.WORLD
    if group is None or not dist.is_initialized():
        verdicts = [verdict]
    else:
        verdicts = cast(list[_Verdict], mg.all_gather_objects(verdict, group, label="resume"))
    for rank, v in enumerate(verdicts):
        if v.error is not None:
            same = all(o.error == v.error for o in verdicts)
            raise ResumeError(v.error if same else f"rank {rank}: {v.error}")
    if any(v != verdicts[0] for v in verdicts):
        seen = "; ".join(f"rank {r}: {v.path or 'none'}" for r, v in enumerate(verdicts))
        raise ResumeError(
            f"the ranks see different checkpoints to resume ({seen}); the checkpoint folder "
            "must be on a file system every node sees"
        )
    return _found(verdicts[0])


def find_checkpoint(
    resume: str | Path,
    folder: str | Path | None = None,
    *,
    run: Mapping[str, Any] | None = None,
    group: dist.ProcessGroup | None = None,
) -> Found:
    """The checkpoint every rank resumes from (package notes): ``resume="auto"`` picks the
    newest intact one in ``folder`` (``Found(None, 0, ...)`` when there is none), a path
    names one. ``run``: the settings the checkpoint must have been saved with (None: any).
    Collective over ``group`` (None: the world); ``ResumeError`` on every rank when it
    cannot be resumed or the ranks disagree."""
    if not isinstance(resume, (str, Path)) or resume == "":
        raise InputTypeError(
            f"resume must be 'auto' or the path of a checkpoint folder, got {resume!r}"
        )
    if folder is not None and not isinstance(folder, (str, Path)):
        raise InputTypeError(f"folder must be a path or None, got {type_name(folder)}")
    if run is not None and not isinstance(run, Mapping):
        raise InputTypeError(f"run must be a mapping of settings, got {type_name(run)}")
    check_optional_group("group", group, what="find_checkpoint")
    where = None if folder is None else Path(folder)
    return _agree(_inspect(resume, where, run or {}), group)


def agree_on_checkpoint(
    found: Found | None, error: str | None, group: dist.ProcessGroup | None
) -> Found:
    """Exchange one rank's verdict (``found``, or ``error``) over ``group`` (None: the
    world): the common one, or ``ResumeError`` on every rank (:func:`find_checkpoint`'s
    exchange, alone)."""
    f = found if found is not None else Found(None, 0)
    verdict = _Verdict(None if f.path is None else str(f.path), f.step, f.ignored, f.damaged, error)
    return _agree(verdict, group)
