"""A chaos run: the demo trainer under ``torchrun --max-restarts N`` meets N faults, at
steps drawn from a seed, and must end with the losses of a run that met none, bit for bit.

Faults (one per torchrun attempt, at increasing steps; :mod:`examples.gpt.faults` injects
them from inside the ranks):

- ``kill``: a random worker is SIGKILLed after a step (preemption, the OOM killer);
- ``save``: a random worker is SIGKILLed while a checkpoint is half written;
- ``stall``: a random worker stops answering; its peers wait for the group's timeout
  (``--timeout``), fail, and torchrun restarts the group;
- ``damage``: right after a checkpoint is published, a worker truncates its shard in it and
  is SIGKILLed: the restart must pass over the damaged newest checkpoint.

Then the same demo runs without faults (no checkpoints, no restarts), and the two
``metrics.json`` must hold the same losses. The report lists every fault (attempt, rank,
kind, the step it hit), the step the next attempt resumed from, the steps trained twice,
and the recovery time (from the fault to the next attempt's first step: torchrun noticing,
stopping the group, restarting it, loading the checkpoint)::

    python scripts/chaos.py --faults 10 --seed 1 --out out/chaos
    python scripts/chaos.py --faults 4 --kinds kill,save,stall,damage --nproc 2

Writes ``OUT/report.json`` and prints a table; exits 1 unless every fault struck, the run
finished and its losses equal the reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.gpt.faults import FAULTS_ENV, KINDS, LOG_ENV, Fault  # noqa: E402

SMALL = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8", "--parity-steps", "0"]
_SAVING_KINDS = ("save", "damage")


@dataclass(frozen=True)
class ChaosPlan:
    """The faults of a run and the run's length: fault k strikes in attempt k."""

    faults: tuple[Fault, ...]
    steps: int
    save_every: int
    nproc: int


@dataclass
class FaultReport:
    """What one fault did."""

    attempt: int
    rank: int
    kind: str
    step: int
    resumed_from: int | None = None
    redone_steps: int | None = None
    recovery_s: float | None = None
    passed_over: list[str] = field(default_factory=list)


def plan_faults(
    seed: int, count: int, nproc: int, save_every: int, kinds: Sequence[str] = KINDS
) -> ChaosPlan:
    """``count`` faults drawn from ``seed``: kind and rank at random, steps increasing (a
    ``save`` or ``damage`` fault on a step that saves), so every attempt gets past the
    checkpoint it resumed from before its fault strikes."""
    rng = random.Random(seed)
    faults, step = [], 0
    for attempt in range(count):
        kind = rng.choice(list(kinds))
        if kind in _SAVING_KINDS:
            step = (step // save_every + rng.randint(1, 2)) * save_every
        else:
            step += rng.randint(1, save_every)
        faults.append(Fault(attempt, rng.randrange(nproc), step, kind))
    return ChaosPlan(tuple(faults), step + save_every, save_every, nproc)


def demo_argv(plan: ChaosPlan) -> list[str]:
    """The demo's flags of both runs: the tests' small GPT, TP=1 × DP=nproc."""
    layout = ["--tp", "1", "--dp", str(plan.nproc), "--no-sequence-parallel"]
    return [*SMALL, *layout, "--steps", str(plan.steps)]


def _torchrun(
    plan: ChaosPlan, argv: list[str], env: dict[str, str], log: Path, restarts: int
) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(plan.nproc), "--max-restarts", str(restarts)]
    cmd += ["--monitor-interval", "0.1", "-m", "examples.train_gpt", *argv]
    with log.open("wb") as out:
        return subprocess.call(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for name in (FAULTS_ENV, LOG_ENV, "MC_DEMO_SIGKILL_AT", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"):
        if name not in extra:
            env.pop(name, None)
    return env


def run_chaos(plan: ChaosPlan, out: Path, timeout_s: float) -> tuple[int, list[float]]:
    """The chaos run under torchrun: its exit status and its losses (empty when it wrote no
    ``metrics.json``). Logs: ``out/chaos.log``, ``out/events.jsonl``."""
    out.mkdir(parents=True, exist_ok=True)
    events = out / "events.jsonl"
    events.unlink(missing_ok=True)
    argv = [*demo_argv(plan), "--save-dir", str(out / "ckpt"), "--save-every"]
    argv += [str(plan.save_every), "--resume", "auto", "--timeout", str(timeout_s)]
    argv += ["--output", str(out / "chaos")]
    env = _env(**{FAULTS_ENV: ",".join(f.spec() for f in plan.faults), LOG_ENV: str(events)})
    code = _torchrun(plan, argv, env, out / "chaos.log", restarts=len(plan.faults))
    return code, _losses(out / "chaos")


def run_reference(plan: ChaosPlan, out: Path) -> tuple[int, list[float]]:
    """The same demo without faults, checkpoints or restarts."""
    argv = [*demo_argv(plan), "--output", str(out / "reference")]
    code = _torchrun(plan, argv, _env(), out / "reference.log", restarts=0)
    return code, _losses(out / "reference")


def _losses(folder: Path) -> list[float]:
    path = folder / "metrics.json"
    if not path.is_file():
        return []
    losses: list[float] = json.loads(path.read_text(encoding="utf-8"))["losses"]
    return losses


def fault_reports(events: Path) -> list[FaultReport]:
    """Pair each fault with the start of the attempt after it."""
    lines = events.read_text(encoding="utf-8").splitlines() if events.is_file() else []
    records = [json.loads(line) for line in lines]
    starts = {r["attempt"]: r for r in records if r["event"] == "start"}
    reports = []
    for r in sorted((r for r in records if r["event"] == "fault"), key=lambda r: r["attempt"]):
        report = FaultReport(r["attempt"], r["rank"], r["kind"], r["step"])
        nxt = starts.get(r["attempt"] + 1)
        if nxt is not None:
            report.resumed_from = nxt["step"]
            report.redone_steps = r["step"] - nxt["step"]
            report.recovery_s = round(nxt["time"] - r["time"], 2)
            report.passed_over = list(nxt["damaged"])
        reports.append(report)
    return reports


def table(reports: Sequence[FaultReport]) -> str:
    """The faults as a Markdown table."""
    rows = [
        "| # | fault | rank | step | resumed from | steps redone | recovery (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in reports:
        damaged = [entry.split(":", 1)[0] for entry in r.passed_over]
        hit = r.kind + (f" ({', '.join(damaged)} damaged: passed over)" if damaged else "")
        rows.append(
            f"| {r.attempt + 1} | {hit} | {r.rank} | {r.step} | {r.resumed_from} | "
            f"{r.redone_steps} | {r.recovery_s} |"
        )
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    """Plan, run with faults, run the reference, compare, report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--faults", type=int, default=10, help="faults to inject (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--nproc", type=int, default=2, help="ranks (TP=1 × DP=nproc; default 2)")
    p.add_argument("--save-every", type=int, default=4)
    p.add_argument("--timeout", type=float, default=10.0, help="group timeout (s) for stalls")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"subset of {','.join(KINDS)}")
    p.add_argument("--out", default="out/chaos")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    if args.faults < 1 or not set(kinds) <= set(KINDS):
        p.error(f"--faults must be >= 1 and --kinds a subset of {','.join(KINDS)}")
    out = Path(args.out).resolve()
    plan = plan_faults(args.seed, args.faults, args.nproc, args.save_every, kinds)
    print(f"chaos: {plan.steps} steps on {plan.nproc} ranks, {len(plan.faults)} faults:")
    print("  " + ", ".join(f"{f.kind}@{f.step}(rank {f.rank})" for f in plan.faults))
    start = time.perf_counter()
    code, losses = run_chaos(plan, out, args.timeout)
    chaos_s = time.perf_counter() - start
    start = time.perf_counter()
    ref_code, reference = run_reference(plan, out)
    ref_s = time.perf_counter() - start
    reports = fault_reports(out / "events.jsonl")
    identical = code == 0 and ref_code == 0 and losses == reference and len(losses) == plan.steps
    struck = [(r.attempt, r.step, r.kind) for r in reports]
    planned = [(f.attempt, f.step, f.kind) for f in plan.faults]
    summary = {
        "plan": asdict(plan),
        "faults": [asdict(r) for r in reports],
        "all_faults_struck": struck == planned,
        "chaos_exit": code,
        "reference_exit": ref_code,
        "losses_identical": identical,
        "chaos_wall_s": round(chaos_s, 1),
        "reference_wall_s": round(ref_s, 1),
    }
    (out / "report.json").write_text(json.dumps(summary, indent=1) + "\n", encoding="utf-8")
    print(table(reports))
    print(
        f"chaos run {chaos_s:.1f} s (exit {code}), reference {ref_s:.1f} s (exit {ref_code}); "
        f"{len(reports)}/{len(plan.faults)} faults struck; {len(losses)} losses "
        f"{'identical to' if identical else 'DIFFERENT from'} the reference's"
    )
    return 0 if identical and struck == planned else 1


if __name__ == "__main__":
    sys.exit(main())
