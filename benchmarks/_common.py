"""Shared helpers for the benchmarks: median timings and a ratio table.

Every benchmark times mc and its peer (torch DDP, torch DTensor TP, ...) in the same run on
the same ranks and reports ``mc / peer``: absolute seconds on a shared 2-core machine vary
run to run, ratios measured side by side are what we compare against targets.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def median_seconds(step: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``step()`` over ``iters`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ratio_table(
    rows: Sequence[tuple[str, float]], reference: str, *, unit: str = "ms", scale: float = 1e3
) -> str:
    """A Markdown table of ``(name, seconds)`` rows with each row's ratio to ``reference``."""
    base = dict(rows)[reference]
    lines = [f"| variant | median ({unit}) | ratio to {reference} |", "|---|---:|---:|"]
    lines += [f"| {name} | {sec * scale:.2f} | {sec / base:.3f} |" for name, sec in rows]
    return "\n".join(lines)
