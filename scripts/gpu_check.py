"""The GPU check: mc's one-GPU test tier and the GPU benchmark, one command, a bare machine.

Usage, from the repository root of a checkout (nothing installed but torch)::

    python3 scripts/gpu_check.py OUT_DIR                 # on a machine with a CUDA GPU
    python3 scripts/gpu_check.py --cpu-dry-run OUT_DIR   # the same on CPU, tiny sizes

Needs only ``python3`` with torch (2.11 or later on the GPU machine); no hatch, no pip, no
network, mc not installed. It:

1. puts the repository root and ``packages/*/src`` on the path (``PYTHONPATH`` of the two
   child processes), so mc and the tests import from the checkout;
2. runs the one-GPU tier: every test marked ``gpu`` in the test files that define such
   tests (``pytest -m gpu``), with mc's pytest plugin loaded explicitly (``-p
   mc_groups_pytest``: without an installed mc-groups its entry point does
   not exist; plugin autoloading is switched off so an installed one cannot register
   twice). Without pytest it says so and goes on;
3. runs ``benchmarks.gpu_step`` (mc DDP + TP layers against torch DDP, interleaved);
4. runs ``benchmarks.host_cost --part ddp-host`` and ``--part tp-host`` on the GPU
   (``--device cuda``: DDP's host cost per param at 1,000 and 5,000 params against torch
   DDP, and the tiny TP block against DTensor; Megatron-Core too where it imports);
5. writes ``OUT_DIR/gpu_check.json`` (environment, test counts and failures, benchmark
   and host-cost results, overall ``ok``) and ``OUT_DIR/gpu_check.log`` (everything
   printed), and prints progress as it goes.

Each child has a deadline (tests 240 s, benchmark 100 s, the host-cost parts 60 s each by
default), so the check ends in under 8 minutes whatever hangs. Exit status: 0 when every
selected test passed (skips allowed: a one-GPU machine skips the two-GPU NCCL tests), the
benchmark ran and its sanity checks held, and both host-cost parts finished (a missed
speed target is reported, not a failure), else 1.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from importlib.machinery import ModuleSpec
from pathlib import Path
from typing import Any, TextIO

__all__ = [
    "HOST_COST_PARTS",
    "Outcome",
    "TestCounts",
    "gpu_test_files",
    "host_cost_command",
    "main",
    "parse_junit",
    "pytest_command",
    "source_paths",
]

ROOT = Path(__file__).resolve().parents[1]
GPU_MARK = "pytest.mark.gpu"
PLUGIN = "mc_groups_pytest"
SCHEMA = 1


def source_paths(root: Path) -> list[Path]:
    """The repository root (``examples``, ``integration_tests``, ``benchmarks``) and every
    package's ``src`` folder, in a fixed order."""
    return [root, *sorted((root / "packages").glob("*/src"))]


def gpu_test_files(root: Path) -> list[Path]:
    """Test modules that mark tests ``gpu`` (each marks its own: a file that only gets
    marks through a helper needs more GPUs than one; see the module notes)."""
    candidates = sorted((root / "packages").glob("*/tests/**/test_*.py"))
    candidates += sorted((root / "integration_tests").glob("test_*.py"))
    return [p for p in candidates if GPU_MARK in p.read_text(encoding="utf-8")]


def pytest_command(files: Sequence[Path], junit: Path, *, with_timeout: bool) -> list[str]:
    """``python -m pytest`` over ``files``, gpu-marked tests only, mc's plugin loaded
    explicitly (autoloading off: see :func:`child_env`), results also as JUnit XML."""
    command = [sys.executable, "-m", "pytest", *map(str, files), "-m", "gpu", "-p", PLUGIN]
    command += ["-p", "no:cacheprovider", "-q", "-rs", f"--junitxml={junit}"]
    if with_timeout:
        command += ["-p", "pytest_timeout", "--timeout=150"]
    return command


def child_env(root: Path, *, disable_autoload: bool) -> dict[str, str]:
    """This environment plus the checkout on ``PYTHONPATH`` (and plugin autoload off for
    pytest: an installed mc-groups would otherwise register the plugin a second time)."""
    env = dict(os.environ)
    paths = [str(p) for p in source_paths(root)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("PYTHONUNBUFFERED", "1")
    if sys.platform.startswith("linux"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if disable_autoload:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    return env


@dataclass
class TestCounts:
    """What a JUnit XML report says."""

    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    skip_reasons: dict[str, int] = field(default_factory=dict)


def parse_junit(path: Path) -> TestCounts:
    """Counts, failing test ids (with the first line of their message) and skip reasons
    (with how many tests gave each) from pytest's ``--junitxml`` file."""
    counts = TestCounts()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        failure = case.find("failure")
        error = case.find("error")
        skipped = case.find("skipped")
        if failure is not None or error is not None:
            node = failure if failure is not None else error
            assert node is not None
            message = (node.get("message") or "").splitlines()
            counts.failures.append(f"{name}: {message[0] if message else ''}".rstrip(": "))
            if failure is not None:
                counts.failed += 1
            else:
                counts.errors += 1
        elif skipped is not None:
            counts.skipped += 1
            reason = skipped.get("message", "")
            counts.skip_reasons[reason] = counts.skip_reasons.get(reason, 0) + 1
        else:
            counts.passed += 1
    return counts


@dataclass
class Outcome:
    """How a child process ended."""

    returncode: int | None
    seconds: float
    timed_out: bool


class Reporter:
    """Prints progress with the elapsed time and copies every line into the log."""

    def __init__(self, log: TextIO) -> None:
        self.log = log
        self.started = time.monotonic()

    def elapsed(self) -> float:
        """Seconds since the check started."""
        return time.monotonic() - self.started

    def say(self, message: str) -> None:
        """A progress line, on the terminal and in the log."""
        line = f"[gpu_check {self.elapsed():6.1f}s] {message}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def echo(self, line: str) -> None:
        """A child's output line, passed through."""
        sys.stdout.write(line)
        sys.stdout.flush()
        self.log.write(line)


def run_child(
    command: Sequence[str], env: dict[str, str], timeout_s: float, report: Reporter
) -> Outcome:
    """Run ``command`` from the repository root, streaming its output; kill it (and the
    rank processes it started: its whole process group) at the deadline."""
    started = time.monotonic()
    proc = subprocess.Popen(
        list(command),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    expired = threading.Event()

    def kill() -> None:
        expired.set()
        with contextlib.suppress(ProcessLookupError):  # it ended on its own meanwhile
            os.killpg(proc.pid, signal.SIGKILL)

    timer = threading.Timer(timeout_s, kill)
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            report.echo(line)
        returncode = proc.wait()
    finally:
        timer.cancel()
    return Outcome(returncode, time.monotonic() - started, expired.is_set())


def check_tests(
    out: Path,
    timeout_s: float,
    report: Reporter,
    find_spec: Callable[[str], ModuleSpec | None] = importlib.util.find_spec,
) -> dict[str, Any]:
    """Run the one-GPU tier (or explain why it cannot run); the ``tests`` record."""
    files = gpu_test_files(ROOT)
    record: dict[str, Any] = {"files": [str(f.relative_to(ROOT)) for f in files]}
    if find_spec("pytest") is None:
        reason = f"pytest is not importable by {sys.executable}: the one-GPU tier did not run"
        report.say(f"SKIPPING TESTS: {reason}")
        return {**record, "ran": False, "reason": reason}
    with_timeout = find_spec("pytest_timeout") is not None
    junit = out / "pytest.xml"
    command = pytest_command(files, junit, with_timeout=with_timeout)
    report.say(f"one-GPU tier: pytest -m gpu over {len(files)} files (deadline {timeout_s:.0f} s)")
    outcome = run_child(command, child_env(ROOT, disable_autoload=True), timeout_s, report)
    record |= {"ran": True, "command": command, "per_test_timeout": with_timeout}
    record |= {"exit_code": outcome.returncode, "seconds": round(outcome.seconds, 1)}
    record["timed_out"] = outcome.timed_out
    if junit.is_file():
        record |= vars(parse_junit(junit))
    else:
        record["reason"] = "pytest wrote no JUnit report (killed or crashed before the end)"
    report.say(
        f"one-GPU tier: exit {outcome.returncode}, {record.get('passed', 0)} passed, "
        f"{record.get('failed', 0)} failed, {record.get('errors', 0)} errors, "
        f"{record.get('skipped', 0)} skipped in {outcome.seconds:.1f} s"
        + (" (DEADLINE: killed)" if outcome.timed_out else "")
    )
    return record


def check_benchmark(out: Path, dry_run: bool, timeout_s: float, report: Reporter) -> dict[str, Any]:
    """Run ``benchmarks.gpu_step``; the ``benchmark`` record (its JSON, or why none)."""
    result_path = out / "benchmark.json"
    command = [sys.executable, "-m", "benchmarks.gpu_step", "--json", str(result_path)]
    if dry_run:
        command.append("--cpu-dry-run")
    report.say(f"benchmark: benchmarks.gpu_step (deadline {timeout_s:.0f} s)")
    outcome = run_child(command, child_env(ROOT, disable_autoload=False), timeout_s, report)
    record: dict[str, Any] = {"command": command, "exit_code": outcome.returncode}
    record |= {"seconds": round(outcome.seconds, 1), "timed_out": outcome.timed_out}
    if result_path.is_file() and not outcome.timed_out:
        record["ran"] = True
        record["result"] = json.loads(result_path.read_text(encoding="utf-8"))
    else:
        record["ran"] = False
    report.say(f"benchmark: exit {outcome.returncode} in {outcome.seconds:.1f} s")
    return record


HOST_COST_PARTS = (  # part, its flags on a GPU, its flags in the CPU dry run (tiny, fast)
    ("ddp-host", ("--sizes", "1000", "5000"), ("--sizes", "100", "--steps", "2")),
    ("tp-host", (), ("--steps", "2")),
)


def host_cost_command(part: str, dry_run: bool, json_path: Path) -> list[str]:
    """``benchmarks.host_cost --part PART`` on this machine's GPU (the CPU in a dry run)."""
    gpu_flags, dry_flags = next(flags for name, *flags in HOST_COST_PARTS if name == part)
    command = [sys.executable, "-m", "benchmarks.host_cost", "--part", part, "--rounds", "3"]
    command += ["--device", "cpu" if dry_run else "cuda", "--json", str(json_path)]
    return command + list(dry_flags if dry_run else gpu_flags)


def check_host_cost(out: Path, dry_run: bool, timeout_s: float, report: Reporter) -> dict[str, Any]:
    """Run issue 30's host-cost parts on the device (DDP per param, the tiny TP block; see
    ``benchmarks.host_cost``); the ``host_cost`` record, one entry per part. A missed
    target is exit code 1 and reported; only a part that did not finish fails the check."""
    record: dict[str, Any] = {}
    for part, *_ in HOST_COST_PARTS:
        result_path = out / f"host_cost_{part}.json"
        command = host_cost_command(part, dry_run, result_path)
        deadline = timeout_s / len(HOST_COST_PARTS)
        report.say(f"host cost: benchmarks.host_cost --part {part} (deadline {deadline:.0f} s)")
        outcome = run_child(command, child_env(ROOT, disable_autoload=False), deadline, report)
        entry: dict[str, Any] = {"command": command, "exit_code": outcome.returncode}
        entry |= {"seconds": round(outcome.seconds, 1), "timed_out": outcome.timed_out}
        finished = result_path.is_file() and not outcome.timed_out
        entry["ran"] = finished and outcome.returncode in (0, 1)
        if finished:
            entry["result"] = json.loads(result_path.read_text(encoding="utf-8"))
        report.say(f"host cost {part}: exit {outcome.returncode} in {outcome.seconds:.1f} s")
        record[part] = entry
    return record


def overall_ok(
    tests: dict[str, Any],
    bench: dict[str, Any],
    dry_run: bool,
    host_cost: dict[str, Any] | None = None,
) -> bool:
    """Tests ran without failures or errors (on a GPU: and some passed), the benchmark
    ran with its sanity checks holding, and every host-cost part (when given) finished."""
    tests_ok = bool(
        tests.get("ran")
        and not tests.get("timed_out")
        and tests.get("failed", 1) == 0
        and tests.get("errors", 1) == 0
        and (dry_run or tests.get("passed", 0) > 0)
    )
    bench_ok = bool(bench.get("ran") and bench.get("exit_code") == 0)
    host_ok = all(entry.get("ran") for entry in (host_cost or {}).values())
    return tests_ok and bench_ok and host_ok


def environment(dry_run: bool) -> dict[str, Any]:
    """Where the check ran (torch and the device are in the benchmark's record)."""
    return {
        # timezone.utc, not datetime.UTC: the GPU machine's python3 may be 3.10
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017
        "mode": "cpu-dry-run" if dry_run else "gpu",
        "python": platform.python_version(),
        "executable": sys.executable,
        "host": platform.node(),
        "pythonpath": [str(p) for p in source_paths(ROOT)],
    }


def _summary(result: dict[str, Any], report: Reporter) -> None:
    bench = result["benchmark"].get("result")
    if bench is not None:
        ratio = bench["ratio_mc_to_torch_median"]
        flops = {name: v["tflops_median"] for name, v in bench["variants"].items()}
        report.say(
            f"benchmark on {bench['device']} (torch {bench['torch']}): mc / torch = {ratio:.3f} "
            f"(target ≤ {bench['target']}: {'met' if bench['target_met'] else 'MISSED'}); "
            + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in flops.items())
        )
    for part, entry in result["host_cost"].items():
        lines = entry.get("result", {}).get(
            "lines", [f"did not finish (exit {entry['exit_code']})"]
        )
        report.say(f"host cost {part}:\n" + "\n".join(lines))
    for failure in result["tests"].get("failures", []):
        report.say(f"FAILED {failure}")
    report.say(f"{'OK' if result['ok'] else 'NOT OK'}: wrote {result['json']}")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``OUT_DIR``, ``--cpu-dry-run`` and the two deadlines."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("out_dir", type=Path, help="folder for gpu_check.json and gpu_check.log")
    p.add_argument("--cpu-dry-run", action="store_true", help="run on CPU with tiny sizes")
    p.add_argument("--tests-timeout", type=float, default=240.0, help="seconds (default 240)")
    p.add_argument("--bench-timeout", type=float, default=100.0, help="seconds (default 100)")
    p.add_argument(
        "--host-timeout", type=float, default=120.0, help="seconds, both parts (default 120)"
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the check; 0 when ``ok`` (see the module notes)."""
    args = parse_args(argv)
    out: Path = args.out_dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    with (out / "gpu_check.log").open("w", encoding="utf-8") as log:
        report = Reporter(log)
        report.say(f"mc GPU check ({'CPU dry run' if args.cpu_dry_run else 'GPU'}), out: {out}")
        result: dict[str, Any] = {"schema": SCHEMA, **environment(args.cpu_dry_run)}
        result["tests"] = check_tests(out, args.tests_timeout, report)
        result["benchmark"] = check_benchmark(out, args.cpu_dry_run, args.bench_timeout, report)
        result["host_cost"] = check_host_cost(out, args.cpu_dry_run, args.host_timeout, report)
        result["ok"] = overall_ok(
            result["tests"], result["benchmark"], args.cpu_dry_run, result["host_cost"]
        )
        result["seconds"] = round(report.elapsed(), 1)
        result["json"] = str(out / "gpu_check.json")
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        _summary(result, report)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
