"""What a checkpoint records besides the tensors (``trainer.json``)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from mc_groups.errors import InputValueError

__all__ = ["FORMAT", "STATE_FILE", "RunState"]

FORMAT = 2
"""Version of the folder layout; a checkpoint of another version is refused."""
STATE_FILE = "trainer.json"
"""The run state's file in a checkpoint folder."""


@dataclass(frozen=True)
class RunState:
    """The run state of a checkpoint (JSON; floats keep Python's repr, so they round-trip
    exactly).

    Attributes:
        step: optimizer steps done (also the data position of a deterministic loader).
        run: the settings a continuing run must share (model sizes, optimizer, batch, data
            seed: the ``run`` a :class:`~mc_train.checkpoint.Checkpointer` is given).
        state: anything else the trainer keeps (its loss history, a scheduler's state), as
            JSON values.
        layout: how the saving run was split (``tp``, ``pp``, ``dp``, ``cp``, ``chunks``);
            informational: any layout resumes.
        world_size: ranks of the saving run (RNG states are per rank).
    """

    step: int
    run: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)
    world_size: int = 1

    def to_json(self) -> str:
        """``trainer.json``'s text."""
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=1) + "\n"

    @classmethod
    def from_json(cls, text: str) -> RunState:
        """Parse ``trainer.json``; ``ValueError`` when a field is missing or mistyped."""
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise InputValueError(f"not a format-{FORMAT} {STATE_FILE}")
        try:
            state = cls(
                step=data["step"],
                run=data["run"],
                state=data["state"],
                layout=data["layout"],
                world_size=data["world_size"],
            )
        except KeyError as err:
            raise InputValueError(f"{STATE_FILE} has no {err}") from err
        ok = isinstance(state.step, int) and state.step >= 0 and isinstance(state.world_size, int)
        if not ok or not all(isinstance(x, dict) for x in (state.run, state.state, state.layout)):
            raise InputValueError(f"{STATE_FILE} has a field of the wrong type")
        return state
