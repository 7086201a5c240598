"""Tensor-parallel MLP block: mc-tp-layers against torch's DTensor TP and the ideal.

The block is ``Column(h → 4h) → GELU → Row(4h → h)`` on 2 gloo ranks (TP = 2), one thread
per rank, input ``[seq, batch, h]`` with ``requires_grad``. One step is forward + backward
(output gradient of ones); each variant's median step time is measured in the same run,
variants interleaved step by step so load from other processes hits them alike:

- ``mc``: :class:`mc_tp_layers.ColumnParallelLinear` + :class:`RowParallelLinear`
  (sequence parallelism off: input replicated; on: input and output split along dim 0);
- ``torch``: the same block as ``nn.Sequential`` parallelised with
  ``torch.distributed.tensor.parallel`` (``ColwiseParallel`` / ``RowwiseParallel`` on a
  ``DeviceMesh`` of the gloo world; with SP, ``Shard(0)`` input and output layouts);
- ``ideal``: the full unsharded block, run on every rank at the same time (no
  communication, same CPU contention as the TP runs), its step time divided by the TP size;
- ``floor`` (sequence parallelism off): the TP=2 block written out by hand with raw
  ``torch.distributed`` calls and nothing else (forward all-reduce; backward dgrad
  all-reduce issued asynchronously and overlapped with the wgrad GEMM): the least any
  implementation on gloo pays, which tells how far the targets are from reachable here.

Two sizes: h=1024, seq 256, batch 4 (compute-bound; targets mc ≤ 1.0 × torch and
≤ 1.05 × ideal) and h=256, seq 128, batch 4 (overhead-bound; targets mc ≤ 0.75 × torch and
≤ 1.2 × ideal). Prints a Markdown table; exits 1 when a target is missed. Run from the
repository root::

    python -m benchmarks.tp_mlp [--iters N]
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import mc_groups as mg
import mc_tp_layers as tpl

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common
from benchmarks._common import Step

SIZES: dict[str, tuple[int, int, int]] = {
    "compute-bound": (1024, 256, 4),
    "overhead-bound": (256, 128, 4),
}
ITERS: dict[str, int] = {"compute-bound": 15, "overhead-bound": 150}  # ~1.5 min in all
TARGETS: dict[str, tuple[float, float]] = {  # (max mc/torch, max mc/ideal)
    "compute-bound": (1.0, 1.05),
    "overhead-bound": (0.75, 1.2),
}
TP = 2


def _reference_block(h: int) -> torch.nn.Sequential:
    """The unsharded block, with the weights mc's CPU init draws (same seed, same order)."""
    fc1, fc2 = torch.nn.Linear(h, 4 * h), torch.nn.Linear(4 * h, h)
    torch.manual_seed(0)
    with torch.no_grad():
        for layer in (fc1, fc2):
            master = torch.empty(layer.weight.shape)
            _common.normal_init(master)
            layer.weight.copy_(master)
            layer.bias.zero_()
    return torch.nn.Sequential(fc1, torch.nn.GELU(), fc2)


def _step(
    block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor]
) -> Step:
    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        y = block(x)
        y.backward(torch.ones_like(y))  # type: ignore[no-untyped-call]

    return step


def _inputs(h: int, seq: int, batch: int, sp: bool) -> torch.Tensor:
    full = torch.randn(seq, batch, h, generator=torch.Generator().manual_seed(1))
    if sp:
        full = full.chunk(TP, dim=0)[dist.get_rank()]
    return full.contiguous().requires_grad_()


def _mc_step(h: int, seq: int, batch: int, sp: bool) -> tuple[Step, Callable[[], torch.Tensor]]:
    pgc_default = mg.get_default_collection()
    assert pgc_default is not None
    cfg = mg.ModelParallelConfig(
        tensor_model_parallel_size=TP, sequence_parallel=sp, use_cpu_initialization=True
    )
    block, params = _common.column_row_block(tpl, h, cfg, pg_collection=pgc_default)

    x = _inputs(h, seq, batch, sp)
    return _step(block, x, params), lambda: block(x).detach()


def _torch_step(h: int, seq: int, batch: int, sp: bool) -> tuple[Step, Callable[[], torch.Tensor]]:
    mesh = init_device_mesh("cpu", (TP,))
    block = _reference_block(h)
    if sp:
        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        }
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(block, mesh, plan)
    x = _inputs(h, seq, batch, sp)
    return _step(block, x, list(block.parameters())), lambda: block(x).detach()


def _ideal_step(h: int, seq: int, batch: int) -> Step:
    block = _reference_block(h)
    x = torch.randn(seq, batch, h, generator=torch.Generator().manual_seed(1)).requires_grad_()
    return _step(block, x, list(block.parameters()))


def _floor_step(h: int, seq: int, batch: int) -> Step:
    """The TP=2 block (SP off) by hand: this rank's halves of fc1 (column) and fc2 (row).

    Forward: ``y = all_reduce(gelu(x W1ᵀ + b1) W2ᵀ) + b2``. Backward (dy = ones):
    ``dW2 = dyᵀ g``, ``dg = dy W2``, ``dh = gelu'(h1) dg``, ``dx = dh W1`` all-reduced
    asynchronously while ``dW1 = dhᵀ x`` runs. Two collectives per step, as in mc.
    """
    gen = torch.Generator().manual_seed(2)
    w1 = torch.randn(4 * h // TP, h, generator=gen) * 0.02
    b1 = torch.zeros(4 * h // TP)
    w2 = torch.randn(h, 4 * h // TP, generator=gen) * 0.02
    b2 = torch.zeros(h)
    x = torch.randn(seq * batch, h, generator=gen)

    def step() -> None:
        h1 = torch.addmm(b1, x, w1.t())
        g = F.gelu(h1)
        y = g @ w2.t()
        dist.all_reduce(y)
        y += b2
        dy = torch.ones_like(y)
        grads = [dy.t() @ g, dy.sum(0)]  # dW2, db2 (computed, as in a real backward)
        dh = torch.ops.aten.gelu_backward(dy @ w2, h1)
        dx = dh @ w1
        work = dist.all_reduce(dx, async_op=True)
        grads += [dh.t() @ x, dh.sum(0)]  # dW1, db1, while dx travels
        assert work is not None
        work.wait()

    return step


def _measure(size: str, warmup: int, iters: int) -> dict[str, Any]:
    """On every rank: build every variant of one size, check agreement, time them."""
    h, seq, batch = SIZES[size]
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=TP, set_default=True)
    try:
        steps: dict[str, Step] = {}
        max_diff: dict[str, float] = {}
        for sp in (False, True):
            mc_step, mc_out = _mc_step(h, seq, batch, sp)
            torch_step, torch_out = _torch_step(h, seq, batch, sp)
            max_diff[f"sp={sp}"] = float((mc_out() - torch_out()).abs().max())
            steps[f"mc sp={sp}"], steps[f"torch sp={sp}"] = mc_step, torch_step
        steps["ideal"] = _ideal_step(h, seq, batch)
        steps["floor"] = _floor_step(h, seq, batch)
        medians = _common.interleaved_medians(steps, warmup, iters)
        return {"medians": medians, "max_diff": max_diff}
    finally:
        mg.destroy_model_parallel(pgc)


def _rows(size: str, per_rank: list[dict[str, Any]]) -> tuple[list[str], bool]:
    slowest = _common.slowest_medians(per_rank)
    ideal = slowest["ideal"] / TP
    max_torch, max_ideal = TARGETS[size]
    h, seq, batch = SIZES[size]
    lines, ok = [], True
    for sp in (False, True):
        mc, peer = slowest[f"mc sp={sp}"], slowest[f"torch sp={sp}"]
        met = mc / peer <= max_torch and mc / ideal <= max_ideal
        ok &= met
        floor = "—" if sp else f"{slowest['floor'] * 1e3:.2f} ({slowest['floor'] / ideal:.3f})"
        lines.append(
            f"| {size} (h={h}, seq {seq}, batch {batch}) | {'on' if sp else 'off'} | "
            f"{mc * 1e3:.2f} | {peer * 1e3:.2f} | {ideal * 1e3:.2f} | {floor} | "
            f"{mc / peer:.3f} (≤ {max_torch}) | {mc / ideal:.3f} (≤ {max_ideal}) | "
            f"{'yes' if met else 'NO'} |"
        )
    return lines, ok


def main() -> int:
    args = _common.parse_arguments(
        __doc__, iters=None, iters_help="timed steps per variant (default: per size)", warmup=3
    )
    measure = _common.rank_worker("benchmarks.tp_mlp")
    header = [
        "| size | SP | mc (ms) | torch DTensor (ms) | ideal (ms) | floor (ms, ÷ ideal) | "
        "mc / torch | mc / ideal | met |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    lines, ok = list(header), True
    with _common.rank_pool(TP) as pool:
        for size in SIZES:
            iters = args.iters or ITERS[size]
            per_rank = pool.run(measure, size, args.warmup, iters)
            diffs = per_rank[0]["max_diff"]
            print(f"{size}: max |mc - torch| output difference {diffs}", flush=True)
            rows, met = _rows(size, per_rank)
            lines += rows
            ok &= met
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
