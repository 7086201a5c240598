"""How the dry run's time and memory grow with the world: the 70B-shaped GPT at TP=8 × PP=8
over 64 … 8192 ranks (DP = 1 … 128), rank 0 (pipeline stage 0: the embedding and 10
blocks).

Each world size runs ``python -m examples.dry_run`` as a fresh subprocess ``--runs`` times
(default 3) and reports min / median / max of:

- ``wall``: the whole process, torch's import included (what a user waits for), and
  ``cpu``, its user + system seconds (less sensitive to other load on a shared machine);
- ``sim``: the dry run itself (the JSON's ``seconds``: joining the fake world, creating the
  groups, building the stage on meta, two steps, the report), with the median of its parts
  (``groups``, ``build``, ``steps``: warm-up + recorded, ``teardown``);
- ``peak RSS``: the child's maximum resident set size (``os.wait4``'s own accounting).

Targets (issue 14): the 4096-rank run (TP=8 × PP=8 × DP=64) in ≤ 30 s and ≤ 2 GiB peak RSS
on this machine. Exits 1 when a measured median misses one.

    python -m benchmarks.dry_run_scale [--worlds 64,512,4096] [--runs 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

WORLDS = (64, 128, 256, 512, 1024, 2048, 4096, 8192)
TARGET_WORLD, TARGET_SECONDS, TARGET_BYTES = 4096, 30.0, 2 * 2**30


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--worlds", default=",".join(map(str, WORLDS)), help="comma-separated")
    p.add_argument("--runs", type=int, default=3, help="runs per world size (default 3)")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--pp", type=int, default=8)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    p.add_argument("--json", help="write every run's figures here")
    return p.parse_args()


def run_once(world: int, tp: int, pp: int, timeout: float) -> dict[str, Any]:
    """One dry run in a fresh process: wall seconds, peak RSS bytes, the dry run's own
    seconds and its parts."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "dry_run.json"
        argv = [sys.executable, "-m", "examples.dry_run", "--world-size", str(world)]
        argv += ["--tp", str(tp), "--pp", str(pp), "--json", str(out)]
        started = time.perf_counter()
        child = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                child.kill()
                raise TimeoutError(f"dry run of {world} ranks ran past {timeout} s")
            time.sleep(0.01)
        wall = time.perf_counter() - started
        child.returncode = os.waitstatus_to_exitcode(status)
        err = child.stderr.read().decode() if child.stderr else ""
        if child.returncode != 0:
            raise RuntimeError(f"dry run of {world} ranks failed ({child.returncode}):\n{err}")
        data = json.loads(out.read_text())
    parts = data["ranks"][0]["timings"]
    return {
        "wall": wall,
        "cpu": usage.ru_utime + usage.ru_stime,
        "sim": data["seconds"],
        "peak_rss": usage.ru_maxrss * 1024,  # KiB on Linux
        "groups": parts["groups"],
        "build": parts["build"],
        "steps": parts["warm-up step"] + parts["recorded step"],
        "teardown": parts["teardown"],
        "collectives": len(data["ranks"][0]["collectives"]),
    }


def _spread(values: list[float], fmt: str) -> str:
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return f"{fmt.format(mid)} ({fmt.format(lo)} – {fmt.format(hi)})"


def main() -> int:
    args = _parse()
    worlds = [int(w) for w in args.worlds.split(",")]
    print(
        f"dry run of the 70B-shaped GPT, rank 0, TP={args.tp} × PP={args.pp}; {args.runs} "
        "fresh processes per size; median (min – max)\n"
    )
    print(
        "| ranks | DP | wall (s) | cpu (s) | sim (s) | groups (s) | build (s) | steps (s) "
        "| peak RSS (MiB) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    results: dict[int, list[dict[str, Any]]] = {}
    for world in worlds:
        runs = [run_once(world, args.tp, args.pp, args.timeout) for _ in range(args.runs)]
        results[world] = runs

        def col(key: str, runs: list[dict[str, Any]] = runs) -> list[float]:
            return [float(r[key]) for r in runs]

        mib = [v / 2**20 for v in col("peak_rss")]
        cells = [f"{world:,}", str(world // (args.tp * args.pp))]
        cells += [_spread(col(k), "{:.1f}") for k in ("wall", "cpu", "sim")]
        cells += [f"{statistics.median(col(k)):.2f}" for k in ("groups", "build", "steps")]
        cells.append(_spread(mib, "{:,.0f}"))
        print("| " + " | ".join(cells) + " |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    if TARGET_WORLD in results:
        runs = results[TARGET_WORLD]
        wall = statistics.median(r["wall"] for r in runs)
        rss = statistics.median(r["peak_rss"] for r in runs)
        ok = wall <= TARGET_SECONDS and rss <= TARGET_BYTES
        print(
            f"\n{TARGET_WORLD} ranks: median wall {wall:.1f} s (target ≤ {TARGET_SECONDS:.0f} s), "
            f"median peak RSS {rss / 2**30:.2f} GiB (target ≤ 2 GiB): "
            + ("met" if ok else "MISSED")
        )
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
