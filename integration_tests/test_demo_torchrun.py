"""The demo trainer launched the way users launch it, by torchrun: a rank lost mid-run and
torchrun restarting the group from the last complete checkpoint, and one job spread over
two torchrun agents ("nodes") on this machine.

Localizes what the in-process pool tests (``test_demo_resume.py``) cannot: torchrun's
restart (``--max-restarts 1``) after a worker is SIGKILLed, the trainer's ``--resume auto``
finding the newest complete checkpoint in the new processes, and the c10d rendezvous of
``--nnodes 2``.

Both restarts run under plain torchrun: torch's default rendezvous store, shared by the
agent with its workers, and no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE`` (each attempt joins
its process groups in a key space of its own, ``mc_groups.elastic``; before, the restarted
group read the dead one's gloo addresses: ``connectFullMesh failed ... Connection
refused``).

Checks, all exact (``==`` on the losses of ``metrics.json``: the same layout reduces the
same numbers in the same order, whatever launched the ranks):
- SIGKILL after step 10 of 16 (save every 4; rank 1 kills itself, first attempt only, via
  the trainer's ``MC_DEMO_SIGKILL_AT`` hook): torchrun reports exit code -9, the restarted
  group resumes from step 8, and its 16 losses equal the uninterrupted run's. That run is
  the same demo on the session's 2-rank pool (no torchrun, no checkpoint).
- SIGKILL while the step-8 checkpoint is being written (rank 1's part on disk, nothing
  published), on two agents of one process each over a c10d rendezvous (multi-node
  restart: the agents count their restarts apart): the half-written
  ``.step-00000008.partial`` (DCP's ``.metadata`` and every shard are in it) is ignored
  and removed, the group resumes from step 4, the losses are again the uninterrupted
  run's, and the folder ends with steps 4, 8, 12 and 16.
- ``--nnodes 2 --nproc-per-node 2`` over a c10d rendezvous on 127.0.0.1 (a free port), 20
  steps at the default layout (TP=2 × DP=2, SP, distributed optimizer): the 20 losses of
  the same demo on one node's 4 processes. That run is the session's 4-rank pool rather
  than a ``--standalone --nproc-per-node 4`` torchrun job: the same ranks and reductions,
  without 5 more torch start-ups (about 25 s of CPU); the elastic tests cover
  ``--standalone``.

The issue's example runs 40 steps saving every 10; 16 steps saving every 4 exercise the
same path at less than half the cost. Cost: each torchrun agent and worker imports torch
(about 4-6 s of CPU each), and the three tests start 17 such processes; the three jobs run
in the background, one after the other, from the end of collection on (``PREFETCH``).
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch.distributed as dist

from examples import train_gpt
from integration_tests import _prefetch
from mc_groups.testing import RankPools

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--hidden-size", "32", "--seq-length", "16", "--global-batch", "8", "--parity-steps", "0"]
TWO_RANKS = ["--tp", "1", "--dp", "2", "--no-sequence-parallel"]
TIMEOUT_S = 240.0  # per torchrun job; a normal one takes 10-40 s here


def pool_demo(argv: list[str]) -> list[float]:
    """Runs on every rank of a pool: the demo's ``run`` (the uninterrupted reference)."""
    plan = train_gpt.plan(train_gpt.parse_args([*SMALL, *argv]), dist.get_world_size())
    return train_gpt.run(plan, io.StringIO()).losses


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    return env


def _start(
    launcher: list[str], argv: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "examples.train_gpt"]
    with log.open("wb") as out:
        # A session of its own: on a timeout the agent and its workers are killed together.
        return subprocess.Popen(
            [*cmd, *SMALL, *argv],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _finish(procs: list[subprocess.Popen[bytes]], logs: list[Path]) -> str:
    """Wait for every job (bounded), fail with the logs unless each exited 0; the logs."""
    deadline = time.monotonic() + TIMEOUT_S
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            codes.append(None)
    text = "\n".join(log.read_text(encoding="utf-8", errors="replace") for log in logs)
    assert codes == [0] * len(procs), (codes, text[-6000:])
    return text


def _torchrun(launcher: list[str], argv: list[str], env: dict[str, str], log: Path) -> str:
    start = time.perf_counter()
    text = _finish([_start(launcher, argv, env, log)], [log])
    print(f"torchrun {' '.join(launcher)}: {time.perf_counter() - start:.1f} s")
    return text


def _losses(folder: Path) -> list[float]:
    losses: list[float] = json.loads((folder / "metrics.json").read_text(encoding="utf-8"))[
        "losses"
    ]
    return losses


def _elastic_run(tmp_path: Path, kill_at: str, *, nodes: int = 1) -> tuple[str, Path]:
    """16 steps on 2 ranks under ``torchrun --max-restarts 1`` (plain: torch's shared
    rendezvous store, no ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``) with rank 1 SIGKILLing
    itself at ``kill_at`` (``STEP:WHERE``) in the first attempt; ``--standalone``, or with
    ``nodes=2`` two agents of one process each over a c10d rendezvous. The log and the
    save folder."""
    save_dir = tmp_path / "ckpt"
    argv = [*TWO_RANKS, "--steps", "16", "--save-dir", str(save_dir), "--save-every", "4"]
    argv += ["--resume", "auto", "--output", str(tmp_path / "out")]
    restarts = ["--max-restarts", "1", "--monitor-interval", "0.1"]
    env = _env(MC_DEMO_SIGKILL_AT=f"1:{kill_at}")
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    if nodes == 1:
        launcher = ["--standalone", "--nproc-per-node", "2", *restarts]
        log = _torchrun(launcher, argv, env, tmp_path / "torchrun.log")
    else:
        launcher = [*_c10d(nodes, 1), *restarts]
        logs = [tmp_path / f"node{i}.log" for i in range(nodes)]
        log = _finish([_start(launcher, argv, env, path) for path in logs], logs)
    assert "exitcode: -9" in log, log[-4000:]  # torchrun saw the SIGKILLed worker
    return log, save_dir


def _c10d(nodes: int, per_node: int) -> list[str]:
    """torchrun flags of one of ``nodes`` agents meeting at a c10d rendezvous here."""
    rdzv = ["--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d"]
    rdzv += ["--rdzv-endpoint", f"127.0.0.1:{_free_port()}"]
    return [
        *rdzv,
        "--rdzv-id",
        f"mc-test-{uuid.uuid4().hex[:8]}",
        "--rdzv-conf",
        "join_timeout=120",
    ]


def _sigkill_mid_run(out: Path) -> tuple[str, Path]:
    return _elastic_run(out, "10:step")


def _sigkill_while_saving(out: Path) -> tuple[str, Path]:
    return _elastic_run(out, "8:save", nodes=2)


def _two_nodes(out: Path) -> str:
    """``--nnodes 2 --nproc-per-node 2``: two agents, 20 steps; their logs."""
    rdzv = _c10d(2, 2)
    logs = [out / f"node{i}.log" for i in range(2)]
    start = time.perf_counter()
    argv = ["--steps", "20", "--output", str(out / "two_nodes")]
    agents = [_start(rdzv, argv, _env(), log) for log in logs]
    text = _finish(agents, logs)
    seconds = time.perf_counter() - start
    print(f"torchrun --nnodes 2 --nproc-per-node 2 (two agents): {seconds:.1f} s")
    return text


# The three torchrun jobs start in the background, one after the other, when the session
# has collected this module (integration_tests/_prefetch.py); each test asserts on its own.
PREFETCH = {
    "sigkill mid run": _sigkill_mid_run,
    "sigkill while saving on two nodes": _sigkill_while_saving,
    "two nodes": _two_nodes,
}


@pytest.fixture(scope="module")
def uninterrupted(rank_pools: RankPools, tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """The 16 losses of the same demo run through without a stop (the 2-rank pool)."""
    out = tmp_path_factory.mktemp("uninterrupted")
    argv = [*TWO_RANKS, "--steps", "16", "--output", str(out)]
    losses = rank_pools.get(2).run(pool_demo, argv)[0]
    assert losses == _losses(out)
    return losses


def test_sigkill_mid_run_restarts_from_the_last_checkpoint(
    uninterrupted: list[float], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    out, (log, save_dir) = _prefetch.take(request, "sigkill mid run", tmp_path)
    assert f"resumed from {save_dir / 'step-00000008'} at step 8" in log, log[-4000:]
    assert _losses(out / "out") == uninterrupted


def test_sigkill_while_saving_on_two_nodes_ignores_the_partial_checkpoint(
    uninterrupted: list[float], request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    out, (log, save_dir) = _prefetch.take(request, "sigkill while saving on two nodes", tmp_path)
    assert (
        "ignored .step-00000008.partial: incomplete, never loaded (removed: an interrupted save)"
        in log
    ), log[-4000:]
    assert f"resumed from {save_dir / 'step-00000004'} at step 4" in log, log[-4000:]
    assert _losses(out / "out") == uninterrupted
    assert sorted(p.name for p in save_dir.iterdir()) == [f"step-{s:08d}" for s in (4, 8, 12, 16)]


def test_two_nodes_train_as_one(
    rank_pools: RankPools, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    out, text = _prefetch.take(request, "two nodes", tmp_path)
    assert "on 4 gloo ranks" in text, text[-4000:]
    assert "groups:  r0: tp[0, 1] dp[0, 2]  r1: tp[0, 1] dp[1, 3]" in text

    # One node: the same demo on one 4-process world (the session's pool; a --standalone
    # torchrun job would add 5 more torch start-ups to the suite for the same numbers).
    one = tmp_path / "one_node"
    losses = rank_pools.get(4).run(pool_demo, ["--steps", "20", "--output", str(one)])[0]
    assert _losses(one) == losses
    assert len(_losses(out / "two_nodes")) == 20
    assert _losses(out / "two_nodes") == losses
