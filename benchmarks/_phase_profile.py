"""Where a step's host time goes: a ``cProfile`` of the step, each function's own time
(``tottime``) attributed to a phase, less the profiler's own cost.

A classifier names the phase of the functions it recognises (by file and name); every other
function inherits the phase of its callers, its own time split between them in proportion
to the time each call edge took (``pstats`` keeps per-caller totals). So a builtin such as
``Tensor.add_`` counts as "accumulate" when the DDP hook calls it and as "model" when a
layer does, and a helper shared by several phases is split between them. The profiler adds
a fixed cost to every Python call, so the absolute numbers run high (more so for phases
made of many small calls). :func:`calibrate` measures that cost per call in the same
process (an empty Python function and a builtin, called in a loop with and without the
profiler) and :func:`phases` takes it off: half of each call's cost from the callee, half
from its caller (cProfile reads its clock in the middle of each event, so the enter event's
work lands on the callee and the exit's on the caller). What remains is close to the
unprofiled time; compare shares, and one version against another, rather than trusting a
single small number.
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import time
from collections.abc import Callable, Mapping
from typing import Any

FuncKey = tuple[str, int, str]  # (file, line, function name), pstats' key
Classifier = Callable[[FuncKey], str | None]

ROOT = "other"
"""The phase of time whose call chain no classifier rule recognises."""


def profile(step: Callable[[], None], calls: int) -> pstats.Stats:
    """``step()`` ``calls`` times under ``cProfile``."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        step()
    profiler.disable()
    return pstats.Stats(profiler)


def _empty() -> None:
    pass


def _python_calls(n: int) -> None:
    for _ in range(n):
        _empty()


def _builtin_calls(n: int) -> None:
    empty: tuple[()] = ()
    for _ in range(n):
        len(empty)


def calibrate(calls: int = 20_000, repeats: int = 5) -> tuple[float, float]:
    """The profiler's own cost per call (seconds): (Python function, builtin), each the
    best of ``repeats`` loops of ``calls`` calls with the profiler minus the best without."""
    costs = []
    for loop in (_python_calls, _builtin_calls):
        plain = profiled = float("inf")
        for _ in range(repeats):
            started = time.perf_counter()
            loop(calls)
            plain = min(plain, time.perf_counter() - started)
            profiler = cProfile.Profile()
            started = time.perf_counter()
            profiler.enable()
            loop(calls)
            profiler.disable()
            profiled = min(profiled, time.perf_counter() - started)
        costs.append(max(0.0, (profiled - plain) / calls))
    return costs[0], costs[1]


def _own_times(table: Mapping[FuncKey, Any], cost: tuple[float, float]) -> dict[FuncKey, float]:
    """Each function's ``tottime`` less the profiler's cost of its calls and of the calls
    it made (half of each call's cost on either side), never below zero."""
    own = {func: float(row[2]) for func, row in table.items()}
    for func, row in table.items():
        per_call = cost[1] if func[0] == "~" else cost[0]
        own[func] -= per_call / 2 * float(row[1])
        for caller, edge in row[4].items():
            if caller in own:
                own[caller] -= per_call / 2 * float(edge[1])
    return {func: max(0.0, value) for func, value in own.items()}


def phases(
    stats: pstats.Stats, classify: Classifier, cost: tuple[float, float] = (0.0, 0.0)
) -> dict[str, float]:
    """Seconds of own time per phase, less the profiler's ``cost`` per call (see
    :func:`calibrate`; zero: the raw profile, whose sum is the profiled wall time)."""
    table: Mapping[FuncKey, Any] = stats.stats  # type: ignore[attr-defined]
    own = _own_times(table, cost)
    shares: dict[FuncKey, dict[str, float]] = {}

    def share_of(func: FuncKey, visiting: frozenset[FuncKey]) -> dict[str, float]:
        """The fractions of ``func``'s own time that belong to each phase."""
        known = shares.get(func)
        if known is not None:
            return known
        named = classify(func)
        if named is not None:
            result = {named: 1.0}
        else:
            callers: Mapping[FuncKey, tuple[Any, ...]] = table[func][4] if func in table else {}
            weights = {c: float(edge[3]) for c, edge in callers.items() if c not in visiting}
            total = sum(weights.values())
            result = {}
            if total <= 0.0:
                result[ROOT] = 1.0
            for caller, weight in weights.items() if total > 0.0 else ():
                for phase, part in share_of(caller, visiting | {func}).items():
                    result[phase] = result.get(phase, 0.0) + part * weight / total
        shares[func] = result  # (a recursive cycle is cut where it closes)
        return result

    seconds: dict[str, float] = {}
    for func in table:
        for phase, part in share_of(func, frozenset()).items():
            seconds[phase] = seconds.get(phase, 0.0) + own[func] * part
    return seconds


def rules(by_name: Mapping[str, str], by_file: Mapping[str, str]) -> Classifier:
    """A classifier: ``by_name`` maps ``"file_suffix:function"`` (or ``"~:builtin text"``,
    matched as a substring of the builtin's name) to a phase; ``by_file`` maps a path
    fragment to the phase of every function defined in a matching file. Names win."""

    def classify(func: FuncKey) -> str | None:
        path, _, name = func
        path = path.replace("\\", "/")
        for key, phase in by_name.items():
            where, _, what = key.partition(":")
            if where == "~":
                if path == "~" and what in name:
                    return phase
            elif path.endswith(where) and name == what:
                return phase
        for fragment, phase in by_file.items():
            if fragment in path:
                return phase
        return None

    return classify


def median_phases(
    step: Callable[[], None], classify: Classifier, *, rounds: int, calls: int
) -> dict[str, float]:
    """Per phase, the median over ``rounds`` profiles of ``calls`` steps each (seconds per
    ``calls`` steps): one profile on a loaded machine can catch a stall in any phase."""
    cost = calibrate()
    runs = [phases(profile(step, calls), classify, cost) for _ in range(rounds)]
    names = {phase for run in runs for phase in run}
    return {phase: statistics.median(run.get(phase, 0.0) for run in runs) for phase in names}


def table(seconds: Mapping[str, float], calls: int, per: int, unit: str) -> list[str]:
    """Markdown rows: phase, µs per ``unit`` (seconds / calls / per), share of the total."""
    total = sum(seconds.values()) or 1.0
    lines = [f"| phase | µs per {unit} (profiled) | share |", "|---|---:|---:|"]
    for phase, value in sorted(seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {phase} | {value / calls / per * 1e6:.2f} | {value / total:.1%} |")
    return lines
