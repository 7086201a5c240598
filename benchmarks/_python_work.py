"""How much Python a step runs: bytecode instructions and Python-level calls per step,
counted with ``sys.settrace`` (opcode events). Unlike a timing it does not move with the
machine's load or the CPU caches' state, so two versions of a layer (or mc against
Megatron-Core) compare exactly; it does not see C++ work (torch's ops, the autograd engine),
which both sides share when they issue the same ops. The tracer slows the step down ~50×:
count a few steps only, never time under it.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any


def per_step(step: Callable[[], None], steps: int = 10) -> tuple[float, float]:
    """``(opcodes, calls)`` per call of ``step``, averaged over ``steps`` calls (after one
    untraced warm-up call)."""
    step()
    counts = [0, 0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Callable[..., Any]:
        del arg
        if event == "call":
            frame.f_trace_opcodes = True
            counts[1] += 1
        elif event == "opcode":
            counts[0] += 1
        return tracer

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        for _ in range(steps):
            step()
    finally:
        sys.settrace(previous)
    return counts[0] / steps, counts[1] / steps
