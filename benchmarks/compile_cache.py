"""Inductor's FX graph cache on mc's compiled graphs: a warm start with the cache against
the same warm start with the FX graph cache off, TP = 2 on 2 gloo ranks.

Each measurement is a fresh pair of processes (``torch.multiprocessing.spawn``) that builds
the tiny ``transformers`` Llama of ``examples/hf_llama.py``, converts it with
``mc_tp_layers.parallelize(model, sequence_parallel_plan(model))`` (SP on), compiles the
whole model (``torch.compile(model, fullgraph=True)``, Inductor) and times its first
forward and backward: trace, compile (or load) and one run. Per round, in a new cache
directory (``TORCHINDUCTOR_CACHE_DIR``):

- ``cold``: the first compile, every cache empty;
- ``warm, FX cache``: the same again, Inductor's FX graph cache filled by ``cold``;
- ``warm, no FX cache``: the same with ``TORCHINDUCTOR_FX_GRAPH_CACHE=0`` (Inductor's other
  caches, its compiled C++ kernels included, still warm): what every warm start cost while
  mc's graphs held the ``with_effects`` record op, which that cache refuses.

Each round prints the slower rank's seconds and ``warm, FX cache / warm, no FX cache``
(target ≤ 0.75), and Inductor's FX cache counters (a hit per graph: forward and backward).
mc's collective-record op is traced only while a recorder is open or the schedule check is
on (:mod:`mc_groups.comm.traceable`), so neither is here. Run from the repository root::

    python -m benchmarks.compile_cache [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.75


def _rank(rank: int, store: str, out: str) -> None:
    """One rank: build, parallelize, compile the Llama; time its first step."""
    torch.set_num_threads(1)
    import torch._inductor.config as inductor_config  # noqa: PLC0415 (in the rank)

    inductor_config.compile_threads = 1
    file_store = dist.FileStore(store, 2)  # type: ignore[attr-defined]
    dist.init_process_group("gloo", store=file_store, rank=rank, world_size=2)
    from torch._dynamo.utils import counters  # noqa: PLC0415 (the launcher imports none)

    import mc_groups as mg  # noqa: PLC0415
    from examples.hf_llama import build_model  # noqa: PLC0415
    from mc_tp_layers import parallelize, sequence_parallel_plan  # noqa: PLC0415

    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    model: Any = build_model("llama")
    model.config.use_cache = False
    parallelize(model, sequence_parallel_plan(model), config=cfg, pg_collection=pgc)
    compiled = torch.compile(model, fullgraph=True)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    dist.barrier()
    started = time.perf_counter()
    compiled(input_ids=ids, labels=ids).loss.backward()  # type: ignore[no-untyped-call]
    seconds = time.perf_counter() - started
    stats = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph")}
    Path(f"{out}.{rank}").write_text(json.dumps({"seconds": seconds, "fx": stats}))
    mg.destroy_model_parallel(pgc)
    dist.destroy_process_group()


def _worker(out: str) -> None:
    import torch.multiprocessing as mp  # noqa: PLC0415

    store = tempfile.mktemp()
    mp.spawn(_rank, args=(store, out), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]


def _measure(cache_dir: str, fx_cache: bool) -> tuple[float, dict[str, int]]:
    """A fresh 2-rank job in ``cache_dir``: the slower rank's seconds, rank 0's counters."""
    out = tempfile.mktemp()
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir)
    env["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "1" if fx_cache else "0"
    command = [sys.executable, "-m", "benchmarks.compile_cache", "--worker", out]
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=900)
    ranks = [json.loads(Path(f"{out}.{r}").read_text()) for r in range(2)]
    return max(r["seconds"] for r in ranks), ranks[0]["fx"]


def main() -> None:
    """Run ``--rounds`` rounds and print each round's seconds and ratio."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker)
        return
    print("| round | cold s | warm, FX cache s | warm, no FX cache s | ratio | FX cache (warm) |")
    print("|---:|---:|---:|---:|---:|---|")
    ratios = []
    for round_ in range(1, args.rounds + 1):
        with tempfile.TemporaryDirectory() as cache:
            cold, _ = _measure(cache, fx_cache=True)
            warm, stats = _measure(cache, fx_cache=True)
            uncached, _ = _measure(cache, fx_cache=False)
        ratios.append(warm / uncached)
        print(
            f"| {round_} | {cold:.1f} | {warm:.1f} | {uncached:.1f} | {warm / uncached:.2f} "
            f"| {stats} |"
        )
    worst = max(ratios)
    verdict = "met" if worst <= TARGET else "missed"
    print(f"\nwarm, FX cache / warm, no FX cache: worst {worst:.2f} (target ≤ {TARGET}: {verdict})")
    print(f"load average: {os.getloadavg()}")


if __name__ == "__main__":
    main()
