r"""Checkpoint folders on disk: publishing one atomically (``trainer.json``, then the
``COMPLETE`` manifest, each fsynced, then the rename and an fsync of the parent), checking one
against its manifest, leftovers and retention (layout: :mod:`mc_train.checkpoint`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, cast

from mc_groups.errors import InputValueError
from mc_train.checkpoint._run_state import FORMAT, STATE_FILE, RunState

__all__ = [
    "COMPLETE",
    "Damaged",
    "checkpoint_dir",
    "partial_dir",
    "prune",
    "publish",
    "published_steps",
    "remove_partial",
    "verify",
]

COMPLETE = "COMPLETE"
"""The manifest written last: the size and SHA-256 of every other file of the checkpoint."""
STEP = re.compile(r"step-(\d{8})")
LEFTOVER = re.compile(r"\.step-\d{8}\.(partial|replaced)")
RNG = "rng"
_HASH_CHUNK = 1 << 20


class Damaged(ValueError):
    """A published checkpoint whose files no longer match its ``COMPLETE``; ``args[0]`` is
    ``"<file> <how it differs> (written by rank R; ...)"``."""


def checkpoint_dir(folder: Path, step: int) -> Path:
    """The published checkpoint of ``step``: ``folder/step-NNNNNNNN``."""
    return folder / f"step-{step:08d}"


def partial_dir(folder: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` is written before it is published."""
    return folder / f".step-{step:08d}.partial"


def published_steps(folder: Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step-N`` folder in ``folder``, newest first."""
    if not folder.is_dir():
        return []
    found = [(int(m[1]), p) for p in folder.iterdir() if (m := STEP.fullmatch(p.name))]
    return sorted((s, p) for s, p in found if p.is_dir())[::-1]


def empty(folder: Path) -> None:
    """``folder`` made (or emptied)."""
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def write_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it."""
    with path.open("wb") as f:
        f.write(data)
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


def publish(tmp: Path, final: Path, state: RunState) -> None:
    """Rank 0: write ``trainer.json`` and ``COMPLETE`` into ``tmp`` and rename it to
    ``final`` (package notes). A ``final`` already there (a resume from an older checkpoint
    trains these steps again) is replaced: a crash between the two renames leaves no
    ``step-N``, so the newest intact older one is found instead."""
    write_synced(tmp / STATE_FILE, state.to_json().encode())
    files = {rel: _describe(tmp / rel) for rel in _files(tmp) if rel != COMPLETE}
    manifest = {"format": FORMAT, "step": state.step, "files": files}
    write_synced(tmp / COMPLETE, (json.dumps(manifest, indent=1) + "\n").encode())
    if final.exists():
        old = final.with_name(f".{final.name}.replaced")
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
    _fsync_dir(final.parent)


def writer(rel: str) -> str:
    """Which rank wrote ``rel`` of a checkpoint (DCP's ``__R_0.distcp`` and
    ``rng/rank-R.pt`` are rank R's; the rest rank 0's)."""
    match = re.fullmatch(r"__(\d+)_\d+\.distcp|rng/rank-(\d+)\.pt", rel)
    return f"rank {int(next(g for g in match.groups() if g))}" if match else "rank 0"


def _damage(found: dict[str, Any] | None, expected: dict[str, Any]) -> str:
    if found is None:
        return "is missing"
    if found["bytes"] != expected["bytes"]:
        return f"differs from what was written: {found['bytes']} bytes now (truncated or grown)"
    return "differs from what was written: same size, other content"


def verify(path: Path) -> RunState:
    """The run state of the published checkpoint ``path`` after checking every file
    against ``COMPLETE`` (reads all of them). :class:`Damaged` when one differs or the
    manifest or ``trainer.json`` cannot be read; ``FileNotFoundError`` without
    ``COMPLETE``."""
    try:
        manifest = json.loads((path / COMPLETE).read_text(encoding="utf-8"))
        if manifest["format"] != FORMAT:
            raise InputValueError(f"format {manifest['format']!r}, this version reads {FORMAT}")
        files = cast(dict[str, dict[str, Any]], manifest["files"])
        if not all({"bytes", "sha256"} <= set(entry) for entry in files.values()):
            raise InputValueError("a file entry without bytes and sha256")
    except FileNotFoundError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise Damaged(f"unreadable {COMPLETE} ({err})") from err
    for rel, expected in files.items():
        found = _describe(path / rel) if (path / rel).is_file() else None
        if found != expected:
            raise Damaged(
                f"{rel} {_damage(found, expected)} (written by {writer(rel)}; {COMPLETE} "
                f"records {expected['bytes']} bytes, SHA-256 {expected['sha256'][:12]}...)"
            )
    try:
        return RunState.from_json((path / STATE_FILE).read_text(encoding="utf-8"))
    except (ValueError, TypeError) as err:
        raise Damaged(f"bad {STATE_FILE} ({err})") from err


def remove_partial(folder: Path) -> list[str]:
    """Delete what interrupted saves left in ``folder`` (``.step-N.partial`` and
    ``.step-N.replaced``; never a ``step-N``) and return their names. One rank, after the
    ranks agreed on what to resume and before the next save."""
    if not folder.is_dir():
        return []
    removed = sorted(p.name for p in folder.iterdir() if LEFTOVER.fullmatch(p.name))
    for name in removed:
        shutil.rmtree(folder / name)
    return removed


def prune(folder: Path, keep: int, newest: Path) -> list[str]:
    """Delete all but the ``keep`` newest published checkpoints of ``folder`` (by step;
    ``newest``, the one just published, always stays) and return their names. One rank."""
    steps = [p for _, p in published_steps(folder) if p != newest]
    removed = [p.name for p in steps[max(0, keep - 1) :]]
    for name in removed:
        shutil.rmtree(folder / name, ignore_errors=True)
    return removed
