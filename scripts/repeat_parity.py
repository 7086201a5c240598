"""Run the integration parity tests many times in a row and report how often they pass.

Each run is a fresh ``python -m pytest`` process (fresh rank pools, fresh process groups,
as in CI), so a flake that depends on start-up, ports, timing or leftover state shows up.
Manual, not part of CI::

    python scripts/repeat_parity.py                       # 20 runs of the parity tests
    python scripts/repeat_parity.py --runs 5 integration_tests   # any pytest paths

Prints one line per run (exit status, tests passed / failed / skipped, wall time, the
failing test ids) and a summary (runs passed, wall time min / median / max); each failing
run's full output is kept under ``--log-dir``. Exits 1 if any run failed.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARITY_TESTS = (
    "integration_tests/test_parity.py",
    "integration_tests/test_bf16.py",
    "integration_tests/test_pipeline.py",
)
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?)\b")


@dataclass
class RunResult:
    """One pytest run: its exit status, test counts, wall time and failing test ids."""

    index: int
    returncode: int
    seconds: float
    counts: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The run exited 0 and ran at least one test."""
        return self.returncode == 0 and self.counts.get("passed", 0) > 0


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("paths", nargs="*", default=list(PARITY_TESTS), help="pytest paths")
    parser.add_argument("--runs", type=int, default=20, help="how many runs (default 20)")
    parser.add_argument(
        "--timeout", type=float, default=900.0, help="seconds one run may take (default 900)"
    )
    parser.add_argument(
        "--log-dir",
        type=Path,
        default=ROOT / "out" / "repeat_parity",
        help="where failing runs' output and summary.json go",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error(f"--runs={args.runs} must be >= 1")
    if not args.timeout > 0:
        parser.error(f"--timeout={args.timeout} must be > 0")
    return args


def _counts(output: str) -> dict[str, int]:
    lines = [line for line in output.splitlines() if " in " in line and "passed" in line]
    found: dict[str, int] = {}
    for number, kind in _COUNT.findall(lines[-1] if lines else ""):
        found["errors" if kind.startswith("error") else kind] = int(number)
    return found


def _run_once(index: int, paths: list[str], timeout: float, log_dir: Path) -> RunResult:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False
        )
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as err:
        code = -1
        output = f"timed out after {timeout} s\n{err.stdout or ''!s}{err.stderr or ''!s}"
    result = RunResult(index, code, time.perf_counter() - start, _counts(output))
    result.failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    if not result.ok:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / f"run-{index:02d}.log").write_text(output)
    return result


def _line(result: RunResult, total: int) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.counts.items())) or "no summary"
    status = "pass" if result.ok else f"FAIL (exit {result.returncode})"
    failures = "".join(f"\n    {f}" for f in result.failures)
    head = f"run {result.index:2d}/{total}: {status:16s} {counts:30s}"
    return f"{head} {result.seconds:6.1f} s{failures}"


def _summary(results: list[RunResult]) -> str:
    seconds = [r.seconds for r in results]
    passed = sum(r.ok for r in results)
    return (
        f"{passed}/{len(results)} runs passed, {len(results) - passed} failed; wall time per "
        f"run min {min(seconds):.1f} s, median {statistics.median(seconds):.1f} s, max "
        f"{max(seconds):.1f} s, total {sum(seconds) / 60:.1f} min"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the tests ``--runs`` times; print each run and the summary; 1 if any failed."""
    args = _parse_args(argv)
    print(f"{args.runs} runs of: pytest -q {' '.join(args.paths)}", flush=True)
    results = []
    for index in range(1, args.runs + 1):
        results.append(_run_once(index, args.paths, args.timeout, args.log_dir))
        print(_line(results[-1], args.runs), flush=True)
    print(_summary(results))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    summary = {"paths": args.paths, "runs": [asdict(r) | {"ok": r.ok} for r in results]}
    (args.log_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
