"""Data-parallel training step: mc DDP against torch DDP, in one run, on 2 gloo ranks.

Model: an MLP of 3 blocks ``Linear(1024 → 4096) → ReLU → Linear(4096 → 1024)`` (25.2 M fp32
params), batch 64 per rank, one thread per rank. One step = zero grads, forward, MSE loss,
backward, gradient synchronisation, SGD step. Variants, built side by side with the same
init and timed step by step in rounds (each round times every variant once, after a
barrier) so load from other processes on the machine hits them alike:

- ``torch DDP (bucket view)``: ``torch.nn.parallel.DistributedDataParallel`` with
  ``gradient_as_bucket_view=True`` (25 MiB buckets, its default): the reference;
- ``torch DDP (no bucket view)``: the same with ``gradient_as_bucket_view=False``;
- ``mc DDP (overlap)``: ``overlap_grad_reduce=True`` with 25 MiB buckets (6 553 600 fp32
  elements, torch's cap, so both overlap the same way), all-reduce, ``ShardedOptimizer``
  (fp32: steps the params in place, like Megatron);
- ``mc DDP (no overlap)``: one bucket, all-reduced in ``finish_grad_sync``;
- ``mc DDP (distributed optimizer)``: reduce-scatter from the hooks, SGD on this rank's half,
  then every param all-gather dispatched asynchronously by the optimizer step
  (``overlap_param_gather_with_optimizer_step``) and waited for by the forward pre-hooks;
- ``mc DDP (dist. opt., gather from pre-hooks)``: the same, but each forward pre-hook
  dispatches the next group's gather (``overlap_param_gather`` alone);
- ``no communication (floor)``: the plain model and SGD on each rank, no DDP at all: what
  the step costs without gradient synchronisation, so the table shows how much of each
  variant is communication.

Reported: median step time over ``--iters`` rounds after ``--warmup``, its ratio to torch
DDP with bucket views (the slower rank's median counts), gradient memory per rank (torch:
its reducer buckets plus ``param.grad`` storages that are not bucket views; mc: the grad
buffers, any fp32 local-accumulation tensors and any ``param.grad`` left) and the
reduce-scatter buffers the bucket groups' ``mc_groups.comm.communicator.Communicator`` s keep on
gloo (see
mc_ddp). Targets:
mc DDP (overlap) ≤ 0.95 × and the distributed optimizer ≤ 1.0 × torch DDP (bucket view).
Prints a Markdown table; exits 1 when a target is missed. From the repository root::

    python -m benchmarks.ddp_step [--iters N] [--warmup N]
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from benchmarks._common import Step

HIDDEN, FFN, BLOCKS, BATCH = 1024, 4096, 3, 64
BUCKET_ELEMENTS = 25 * 2**20 // 4  # torch DDP's default bucket_cap_mb=25, in fp32 elements
LR = 1e-4
REFERENCE = "torch DDP (bucket view)"
TARGETS = {"mc DDP (overlap)": 0.95, "mc DDP (distributed optimizer)": 1.0}

Memory = Callable[[], tuple[int, int]]  # (grad bytes, all-to-all scratch bytes)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(BLOCKS):
        layers += [nn.Linear(HIDDEN, FFN), nn.ReLU(), nn.Linear(FFN, HIDDEN)]
    return nn.Sequential(*layers)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)


def _torch_variant(bucket_view: bool) -> tuple[Step, Memory]:
    model = nn.parallel.DistributedDataParallel(_model(), gradient_as_bucket_view=bucket_view)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batch()

    def step() -> None:
        opt.zero_grad(set_to_none=not bucket_view)  # keep the bucket views when there are
        torch.autograd.backward((model(x) - y).pow(2).mean())
        opt.step()

    def memory() -> tuple[int, int]:
        logged: dict[str, Any] = model._get_ddp_logging_data()  # type: ignore[no-untyped-call]
        buckets = sum(int(n) for n in str(logged["bucket_sizes"]).split(","))
        own = {
            p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
            for p in model.parameters()
            if p.grad is not None
        }
        return buckets + (0 if bucket_view else sum(own.values())), 0

    return step, memory


def _floor_variant() -> tuple[Step, Memory]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = _batch()

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        torch.autograd.backward((model(x) - y).pow(2).mean())
        opt.step()

    def memory() -> tuple[int, int]:
        return sum(p.grad.nbytes for p in model.parameters() if p.grad is not None), 0

    return step, memory


def _mc_variant(
    pgc: mg.ProcessGroupCollection, step_dispatch: bool = False, **fields: Any
) -> tuple[Step, Memory]:
    config = DistributedDataParallelConfig(**fields)
    ddp = DistributedDataParallel(mg.ModelParallelConfig(), config, _model(), pg_collection=pgc)
    opt = ShardedOptimizer(
        torch.optim.SGD(ddp.parameters(), lr=LR),
        ddp,
        overlap_param_gather_with_optimizer_step=step_dispatch,
    )
    x, y = _batch()

    def step() -> None:
        ddp.zero_grad_buffer()
        torch.autograd.backward((ddp(x) - y).pow(2).mean())
        ddp.finish_grad_sync()
        opt.step()

    def memory() -> tuple[int, int]:
        buffers = ddp.buffers + ddp.expert_parallel_buffers
        owned = sum(b.grad_data.nbytes + sum(g.nbytes for g in b.extra_main_grads) for b in buffers)
        left = sum(p.grad.nbytes for p in ddp.parameters() if p.grad is not None)
        scratch = sum(g.communicator.nbytes for g in ddp.bucket_groups)
        return owned + left, scratch

    return step, memory


def _measure(warmup: int, iters: int) -> dict[str, Any]:
    """On every rank: build every variant, time them, report medians and grad bytes."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel()
    try:
        variants = {
            REFERENCE: _torch_variant(bucket_view=True),
            "torch DDP (no bucket view)": _torch_variant(bucket_view=False),
            "mc DDP (overlap)": _mc_variant(
                pgc, overlap_grad_reduce=True, bucket_size=BUCKET_ELEMENTS
            ),
            "mc DDP (no overlap)": _mc_variant(pgc),
            "mc DDP (distributed optimizer)": _mc_variant(
                pgc,
                step_dispatch=True,
                overlap_grad_reduce=True,
                overlap_param_gather=True,
                use_distributed_optimizer=True,
                bucket_size=BUCKET_ELEMENTS,
            ),
            "mc DDP (dist. opt., gather from pre-hooks)": _mc_variant(
                pgc,
                overlap_grad_reduce=True,
                overlap_param_gather=True,
                use_distributed_optimizer=True,
                bucket_size=BUCKET_ELEMENTS,
            ),
            "no communication (floor)": _floor_variant(),
        }
        medians = _common.interleaved_medians({k: v[0] for k, v in variants.items()}, warmup, iters)
        params = sum(p.numel() for p in _model().parameters())
        return {
            "medians": medians,
            "memory": {k: v[1]() for k, v in variants.items()},
            "params": params,
        }
    finally:
        mg.destroy_model_parallel(pgc)


def _table(per_rank: list[dict[str, Any]]) -> tuple[list[str], bool]:
    slowest = _common.slowest_medians(per_rank)
    memory = per_rank[0]["memory"]
    param_bytes = per_rank[0]["params"] * 4
    base = slowest[REFERENCE]
    lines = [
        f"| variant | median step (ms) | ratio to {REFERENCE} | target | grad memory per rank "
        "(MiB, × param bytes) | all-to-all scratch (MiB) |",
        "|---|---:|---:|---|---:|---:|",
    ]
    ok = True
    for name, seconds in slowest.items():
        ratio = seconds / base
        target = TARGETS.get(name)
        met = target is None or ratio <= target
        ok &= met
        goal = "" if target is None else f"≤ {target} ({'met' if met else 'MISSED'})"
        grads, scratch = memory[name]
        lines.append(
            f"| {name} | {seconds * 1e3:.1f} | {ratio:.3f} | {goal} | "
            f"{grads / 2**20:.1f} ({grads / param_bytes:.2f}) | {scratch / 2**20:.1f} |"
        )
    return lines, ok


def main() -> int:
    args = _common.parse_arguments(__doc__, iters=20, iters_help="timed rounds (>= 10)", warmup=2)
    with _common.rank_pool(2) as pool:
        per_rank = pool.run(_common.rank_worker("benchmarks.ddp_step"), args.warmup, args.iters)
    print(f"{per_rank[0]['params']:,} params, batch {BATCH} per rank, 2 gloo ranks, 1 thread each")
    lines, ok = _table(per_rank)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
