"""Sweep the public API of the five packages with generated bad inputs and misuse sequences.

Every case of :mod:`integration_tests._sweep_cases` runs in a worker process (one-process
cases in a reused worker, two-rank cases in a fresh pair of ranks that disagree) and is
classified clear / raw / silent / crash / hang (see :mod:`integration_tests._sweep_runner`).
Prints the summary table (per package) and writes every non-clear case as JSON.

    python scripts/sweep_bad_inputs.py                       # the whole sweep
    python scripts/sweep_bad_inputs.py --json out/sweep.json --jobs 2
    python scripts/sweep_bad_inputs.py --controls            # every slot's good value passes
    python scripts/sweep_bad_inputs.py --filter all_reduce   # cases whose id contains it

To measure another checkout's packages, put its ``src`` folders first on ``PYTHONPATH``
(the script prints where ``mc_groups`` was imported from).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.append(str(ROOT))

import mc_groups  # noqa: E402
from integration_tests import _sweep_runner as runner  # noqa: E402
from integration_tests._sweep_cases import Case, all_cases, control_cases  # noqa: E402

PACKAGES = ("mc-groups", "mc-buffers", "mc-ddp", "mc-tp-layers", "mc-finalize", "mc-moe")


def _run_one_process(cases: Sequence[Case], jobs: int, progress: bool) -> list[runner.Result]:
    results: list[runner.Result | None] = [None] * len(cases)
    next_index = [0]
    lock = threading.Lock()

    def drive() -> None:
        with runner.OneProcessRunner() as one:
            while True:
                with lock:
                    i = next_index[0]
                    next_index[0] += 1
                if i >= len(cases):
                    return
                case = cases[i]
                results[i] = one.run(("case", i, case.id), case.id, case.package)
                if progress and (i + 1) % 100 == 0:
                    print(f"  {i + 1}/{len(cases)} one-process cases", file=sys.stderr)

    threads = [threading.Thread(target=drive) for _ in range(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [r for r in results if r is not None]


def _run_two_rank(cases: Sequence[Case]) -> list[runner.Result]:
    return [runner.run_two_rank(c.id, c.package) for c in cases]


def sweep(
    cases: Sequence[Case], jobs: int = 2, progress: bool = True
) -> tuple[list[runner.Result], float]:
    """Run every case; (results in case order, seconds)."""
    started = time.monotonic()
    one = [c for c in cases if c.world == 1]
    two = [c for c in cases if c.world == 2]
    two_results: list[runner.Result] = []
    pair = threading.Thread(target=lambda: two_results.extend(_run_two_rank(two)))
    pair.start()
    one_results = _run_one_process(one, jobs, progress)
    pair.join()
    by_id = {r.case_id: r for r in [*one_results, *two_results]}
    return [by_id[c.id] for c in cases], time.monotonic() - started


def table(results: Sequence[runner.Result]) -> str:
    """The summary as a markdown table (per package, then all)."""
    rows = runner.summarise(results)
    head = "| package | cases | clear | raw | silent | crash | hang | clear % | silent % |"
    lines = [head, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name in (*PACKAGES, "all"):
        row = rows.get(name)
        if row is None:
            continue
        n = row["cases"]
        label = f"**{name}**" if name == "all" else name
        lines.append(
            f"| {label} | {n} | {row['clear']} | {row['raw']} | {row['silent']} | "
            f"{row['crash']} | {row['hang']} | {100 * row['clear'] / n:.1f} | "
            f"{100 * row['silent'] / n:.1f} |"
        )
    return "\n".join(lines)


def two_rank_table(results: Sequence[runner.Result], cases: Sequence[Case]) -> str:
    """The two-rank cases' outcomes (a sub-table)."""
    worlds = {c.id: c.world for c in cases}
    two = [r for r in results if worlds.get(r.case_id) == 2]
    if not two:
        return ""
    rows = runner.summarise(two)["all"]
    return (
        f"two-rank cases: {rows['cases']} (clear {rows['clear']}, raw {rows['raw']}, silent "
        f"{rows['silent']}, crash {rows['crash']}, hang {rows['hang']})"
    )


def findings(results: Sequence[runner.Result], cases: Sequence[Case]) -> str:
    """Every non-clear case as markdown, grouped by package and slot: the outcome and bad
    value of each, and what the first of them raised."""
    slot_of = {c.id: c.slot.key for c in cases}
    value_of = {c.id: c.id.split(" <- ", 1)[1] if " <- " in c.id else "" for c in cases}
    lines: list[str] = []
    for package in PACKAGES:
        bad = [r for r in results if r.package == package and r.outcome != "clear"]
        if not bad:
            continue
        lines.append(f"\n#### {package} ({len(bad)} non-clear)\n")
        by_slot: dict[str, list[runner.Result]] = {}
        for r in bad:
            by_slot.setdefault(slot_of[r.case_id], []).append(r)
        for key, rs in by_slot.items():
            shown = ", ".join(
                f"{r.outcome}" + (f" `{value_of[r.case_id]}`" if value_of[r.case_id] else "")
                for r in rs
            )
            raised = [r for r in rs if r.outcome != "silent"] or rs
            example = raised[0].detail.splitlines()[0] if raised[0].detail else ""
            example = example.replace("`", "'").replace("|", "/")[:160]
            lines.append(f"- `{key}`: {shown} — e.g. {example}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write every non-clear case here")
    parser.add_argument("--jobs", type=int, default=2, help="one-process workers in parallel")
    parser.add_argument("--filter", default="", help="only cases whose id contains this")
    parser.add_argument("--package", choices=PACKAGES, help="only this package's cases")
    parser.add_argument("--controls", action="store_true", help="run every slot's good value")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    parser.add_argument("--show", action="store_true", help="print every non-clear case")
    parser.add_argument("--markdown", type=Path, help="write the table and the findings here")
    args = parser.parse_args(argv)
    print(f"mc_groups from {Path(mc_groups.__file__).parent.parent}", file=sys.stderr)
    cases = control_cases() if args.controls else all_cases()
    cases = [c for c in cases if args.filter in c.id]
    if args.package:
        cases = [c for c in cases if c.package == args.package]
    if args.list:
        for c in cases:
            print(f"{c.package}\t{c.id}")
        return 0
    if args.controls:
        return _controls(cases, args.jobs)
    results, seconds = sweep(cases, args.jobs)
    print(table(results))
    line = two_rank_table(results, cases)
    if line:
        print(line)
    print(f"{len(results)} cases in {seconds:.0f} s")
    bad = [r for r in results if r.outcome != "clear"]
    if args.show:
        for r in bad:
            print(f"[{r.outcome}] {r.package} | {r.case_id} | {r.detail[:300]}")
    if args.markdown:
        text = f"{table(results)}\n\n{line}\n{findings(results, cases)}\n"
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in bad], indent=1) + "\n")
        print(f"wrote {len(bad)} non-clear cases to {args.json}")
    return 0


def _controls(cases: Sequence[Case], jobs: int) -> int:
    """Good values must be accepted: the runner calls that "silent"; anything else is a
    broken case."""
    results = _run_one_process(cases, jobs, progress=False)
    broken = [r for r in results if r.outcome != "silent"]
    for r in broken:
        print(f"[{r.outcome}] {r.case_id}: {r.detail[:300]}")
    print(f"{len(results) - len(broken)}/{len(results)} controls accepted")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
