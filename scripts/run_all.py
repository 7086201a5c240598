"""``hatch run all``: every check of the project, the slow independent ones side by side.

Order: lint and the package checks first (a second each, and the cheapest failures to
read), then the test suite in the foreground while ``mypy``, the install-alone check and the
documentation build run one after the other in the background, at a lower CPU priority
(``nice -n 10`` where ``nice`` exists): the suite's ranks wait on each other under short
timeouts and get the cores first, and the background checks fill what the suite leaves
idle. Their output is printed whole, after the suite's, never interleaved.
Exits non-zero if any step failed; every step runs even after a failure, so one run shows
all of them. Extra arguments go to pytest. The background steps share one bound
(``BACKGROUND_BOUND_S``): a step still running then is killed and reported as failed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BACKGROUND_BOUND_S = 900.0
# the background steps' command prefix: a lower CPU priority than the suite's
NICE = ["nice", "-n", "10"] if shutil.which("nice") else []
PY = sys.executable

FIRST = [
    ("lint: ruff check", [PY, "-m", "ruff", "check", "."]),
    ("lint: ruff format --check", [PY, "-m", "ruff", "format", "--check", "."]),
    ("check-packages", [PY, "scripts/check_packages.py"]),
]
TESTS = [PY, "-m", "pytest", "packages", "integration_tests"]
# The documentation site, warnings as errors (as `hatch run docs`; about 15 s of CPU)
DOCS = [PY, "-m", "sphinx", "-E", "-W", "--keep-going", "-n", "-q", "-b", "html"]
BACKGROUND = [
    ("types: mypy --strict", [PY, "-m", "mypy"]),
    ("install-check", [PY, "scripts/check_install_alone.py"]),
    ("docs: sphinx -W", [*DOCS, "docs", "docs/_build/html"]),
]


@dataclass
class _Step:
    name: str
    status: int
    seconds: float


def _run(name: str, cmd: list[str], env: dict[str, str] | None = None) -> _Step:
    print(f"+ {name}: {' '.join(cmd[1:] if cmd[0] == PY else cmd)}", flush=True)
    started = time.monotonic()
    status = subprocess.run(cmd, cwd=ROOT, env=env, check=False).returncode
    return _Step(name, status, time.monotonic() - started)


def _run_background(log: Path, steps: list[_Step], deadline: float) -> None:
    """The background steps one after the other, output into ``log`` (run in a thread)."""
    with log.open("wb") as out:
        for name, cmd in BACKGROUND:
            out.write(f"+ {name}\n".encode())
            out.flush()
            started = time.monotonic()
            try:
                status = subprocess.run(
                    [*NICE, *cmd],
                    cwd=ROOT,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    timeout=max(deadline - started, 1.0),
                    check=False,
                ).returncode
            except subprocess.TimeoutExpired:
                out.write(f"killed: over the {BACKGROUND_BOUND_S:.0f} s bound\n".encode())
                status = -9
            steps.append(_Step(name, status, time.monotonic() - started))


def main(pytest_args: list[str]) -> int:
    steps = [_run(name, cmd) for name, cmd in FIRST]
    background: list[_Step] = []
    with tempfile.TemporaryDirectory(prefix="mc-all-") as tmp:
        log = Path(tmp) / "background.log"
        worker = threading.Thread(
            target=_run_background,
            args=(log, background, time.monotonic() + BACKGROUND_BOUND_S),
            daemon=True,
        )
        worker.start()
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}  # the tests' ranks use loopback
        steps.append(_run("tests: pytest", [*TESTS, *pytest_args], env))
        worker.join(BACKGROUND_BOUND_S + 30.0)  # the steps share the bound; a backstop
        text = log.read_text(encoding="utf-8", errors="replace")
    print(f"--- background steps (ran during the tests) ---\n{text}", end="", flush=True)
    ran = {s.name for s in background}
    steps += background + [_Step(name, 1, 0.0) for name, _ in BACKGROUND if name not in ran]
    print("--- summary ---")
    for step in steps:
        verdict = "ok" if step.status == 0 else f"FAILED (exit {step.status})"
        print(f"{step.name:<28} {verdict:<18} {step.seconds:6.0f} s")
    return 0 if all(s.status == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
