"""Fault injection for the restart tests and ``scripts/chaos.py`` (not a user feature): the
demo's ranks hurt themselves at chosen steps of chosen torchrun attempts, and note when and
where, so a chaos run can list every fault and how long recovery took.

``MC_DEMO_FAULTS="ATTEMPT:RANK:STEP:KIND[,...]"``, ``ATTEMPT`` counted like torchrun's
``TORCHELASTIC_RESTART_COUNT`` (0: the first attempt), ``KIND`` one of:

- ``kill``: rank RANK SIGKILLs itself after step STEP (a preempted or OOM-killed worker);
- ``save``: SIGKILL while the step-STEP checkpoint is half written (its own part on disk,
  nothing published);
- ``stall``: after step STEP the rank stops answering (sleeps): its peers wait in their
  next collective until the group's timeout (the demo's ``--timeout``), then fail;
- ``damage``: after the step-STEP checkpoint is published, the rank truncates its own DCP
  shard in it (a disk or an operator damaging the newest checkpoint), then SIGKILLs itself.

``MC_DEMO_SIGKILL_AT=RANK:STEP:{step,save}`` (the older form) is ``0:RANK:STEP:{kill,save}``.
With ``MC_DEMO_FAULT_LOG=PATH`` each fault appends a JSON line (attempt, rank, step, kind,
wall time) to PATH just before it strikes, and rank 0 of every attempt appends one when it
starts training (the step it resumed from, the damaged checkpoints it passed over).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = [
    "FAULTS_ENV",
    "KINDS",
    "LOG_ENV",
    "Fault",
    "after_save",
    "after_step",
    "during_save",
    "faults_from_env",
    "note_start",
    "parse_faults",
]

FAULTS_ENV = "MC_DEMO_FAULTS"
LOG_ENV = "MC_DEMO_FAULT_LOG"
_LEGACY_ENV = "MC_DEMO_SIGKILL_AT"
KINDS = ("kill", "save", "stall", "damage")
"""The faults a rank can inject (module notes)."""


@dataclass(frozen=True)
class Fault:
    """One fault: in torchrun attempt ``attempt``, rank ``rank`` does ``kind`` at ``step``."""

    attempt: int
    rank: int
    step: int
    kind: str

    def spec(self) -> str:
        """``ATTEMPT:RANK:STEP:KIND``, as ``MC_DEMO_FAULTS`` lists it."""
        return f"{self.attempt}:{self.rank}:{self.step}:{self.kind}"


def parse_faults(text: str) -> tuple[Fault, ...]:
    """The faults of an ``MC_DEMO_FAULTS`` value; ``ValueError`` naming a bad entry."""
    faults = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        parts = entry.split(":")
        if len(parts) != 4 or not all(p.isdigit() for p in parts[:3]) or parts[3] not in KINDS:
            raise ValueError(
                f"{FAULTS_ENV} entry {entry!r} must be ATTEMPT:RANK:STEP:KIND with KIND one of "
                f"{', '.join(KINDS)}"
            )
        faults.append(Fault(int(parts[0]), int(parts[1]), int(parts[2]), parts[3]))
    return tuple(faults)


def faults_from_env(env: Mapping[str, str]) -> tuple[Fault, ...]:
    """Every fault ``env`` asks for (``MC_DEMO_FAULTS`` and the older ``MC_DEMO_SIGKILL_AT``)."""
    faults = parse_faults(env.get(FAULTS_ENV, ""))
    if legacy := env.get(_LEGACY_ENV):
        rank, step, where = legacy.split(":")
        faults += (Fault(0, int(rank), int(step), "kill" if where == "step" else "save"),)
    return faults


def _mine(rank: int, step: int, kind: str) -> Fault | None:
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    wanted = Fault(attempt, rank, step, kind)
    return wanted if wanted in faults_from_env(os.environ) else None


def _log(record: dict[str, object]) -> None:
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps({**record, "time": time.time()}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())  # one write of a short line: appends do not interleave
        os.fsync(fd)
    finally:
        os.close(fd)


def _strike(fault: Fault) -> None:
    _log({"event": "fault", **asdict(fault)})
    if fault.kind == "stall":
        while True:  # stop answering; torchrun ends this process once the peers failed
            time.sleep(3600)
    os.kill(os.getpid(), signal.SIGKILL)


def after_step(rank: int, step: int) -> None:
    """Called by every rank after step ``step`` (1-based): a ``kill`` or ``stall`` strikes."""
    for kind in ("kill", "stall"):
        if (fault := _mine(rank, step, kind)) is not None:
            _strike(fault)


def during_save(rank: int, step: int) -> Callable[[], None] | None:
    """The hook a save runs once this rank's part is on disk: a ``save`` fault strikes."""
    fault = _mine(rank, step, "save")
    return None if fault is None else (lambda: _strike(fault))


def after_save(rank: int, step: int, folder: Path) -> None:
    """Called by every rank after the step-``step`` checkpoint was published as ``folder``:
    a ``damage`` fault truncates this rank's DCP shard there to half, then strikes."""
    if (fault := _mine(rank, step, "damage")) is None:
        return
    shard = folder / f"__{rank}_0.distcp"
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    _strike(fault)


def note_start(rank: int, resumed_step: int, damaged: tuple[str, ...]) -> None:
    """Rank 0 notes that this attempt starts training at ``resumed_step`` (0: fresh)."""
    if rank == 0:
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        _log({"event": "start", "attempt": attempt, "step": resumed_step, "damaged": damaged})
