"""Host cost per parameter (DDP) and per layer call (TP): mc against torch and Megatron-Core.

On a GPU the host only launches work; what the Python side spends per parameter (backward
hooks, readiness counting, accumulation into ``main_grad``) and per layer call (checks,
recorder bookkeeping, agreement) decides whether the GPU waits. This benchmark makes the
compute negligible so that host cost is what is timed, on 2 gloo ranks, one thread each.

DDP: a stack of ``Linear(8 → 8)`` layers with 100, 1,000 and 5,000 parameters (two per
layer), batch 4 per rank. One step: zero the grads, forward, ``mean(y²)``, backward,
finish the gradient sync. Host cost per parameter = (step time − the same model's step
without DDP) / parameters. Variants, same init:

- ``local``: the plain model (``param.grad = None``, forward, backward): the baseline;
- ``torch DDP``: ``DistributedDataParallel(gradient_as_bucket_view=True)`` (C++ reducer;
  grads zeroed in place by ``SGD.zero_grad(set_to_none=False)``, one fused call);
- ``Megatron DDP``: Megatron-Core's ``DistributedDataParallel(overlap_grad_reduce=True)``,
  ``zero_grad_buffer`` / ``finish_grad_sync`` (only when ``megatron.core`` imports; see
  :mod:`benchmarks._host_peers`);
- ``mc DDP``: mc's, same config and calls.

Every model fits one bucket (torch's first bucket is 1 MiB, Megatron's and mc's 40 M
elements), so each step issues one all-reduce and the rest is per-parameter work.

TP: ``Column(h → 4h) → GELU → Row(4h → h)`` at h = 32, seq 16, batch 2, TP = 2, forward +
backward (output gradient of ones), sequence parallelism off and on; mc against Megatron-Core
and DTensor (``torch.distributed.tensor.parallel``). Per-call time in ms.

TP host time alone (``--part tp-host``): the same block in one process, rank 0 of 2 over
torch's fake process group (its collectives return at once), so what is timed is the
Python and dispatch work (checks, autograd functions, collective wrappers, GEMM calls) and
not gloo's latency, whose run-to-run spread on 2 ranks (±5 %) is larger than the
differences between the libraries. ``--rounds`` × 6 rounds of ``--steps`` × 2 passes,
order shuffled per pass, CPU clock, a round's fastest pass; the ratio is that of the
medians, shown with the quartiles of the per-round ratios. Target: mc ≤ Megatron (median
ratio ≤ 1). ``--no-dtensor`` leaves DTensor's blocks out, so mc's and Megatron's steps run
after each other (warm caches) rather than after DTensor's 2–3 ms steps. Then
the Python each block runs per step, counted (:mod:`benchmarks._python_work`): a figure that
does not move with the load.

DDP host cost alone (``--part ddp-host``): the DDP models of ``--sizes`` in one process,
the only rank of a gloo world, so no peer is waited for (on 2 ranks that wait, and gloo's
latency, move from run to run by more than the libraries' hooks differ) while every
library's DDP runs its per-param work as on more ranks (hooks, accumulation, readiness,
one collective per bucket, here a local copy). A step of 1,000 params takes ~25 ms,
5,000 ~120 ms: the fastest of a few such steps moves by more than the libraries differ on
a shared machine, so this part times ``--rounds`` × ``--steps`` passes (each variant once
per pass, order shuffled per pass, CPU clock) and takes medians over all passes: host
cost per param = (median DDP step − median local step) / params; also the paired per-pass
difference mc − Megatron (median and quartiles) and the Python mc's and Megatron's DDP
run per param per step, counted. Targets as for ``--part ddp``; "≤ Megatron" is judged on
the paired differences (median ≤ 0): the two DDP steps of a pass run the same model and
batch back to back, so their difference is the difference of the two host costs, without
the local step's own spread, which the ratio of the medians carries twice.

Timing: ``--rounds`` rounds (≥ 3) of ``--steps`` passes; a pass times every variant once,
each after a barrier, in an order that rotates from pass to pass; two clocks: wall time and
the process's CPU time (which load from other processes on a shared machine disturbs far
less). A round's value is a variant's fastest step (other processes only ever add time),
the slower rank's; a variant's value is the median over rounds, shown with the rounds'
range. Ratios are taken within the run. Then where mc's (and Megatron's) time goes: a
``cProfile`` of the step on rank 0, its time attributed to phases, less the profiler's own
cost per call (:mod:`benchmarks._phase_profile`). Targets: per-param DDP cost of mc ≤ Megatron's and
≤ 1.2 × torch DDP's at 1,000 and 5,000 params; the TP block ≤ Megatron's, SP off and on.
Exits 1 when a target that could be measured is missed. From the repository root::

    python -m benchmarks.host_cost [--rounds N] [--steps N] [--part ddp|ddp-host|tp|tp-host|both]
    MC_MEGATRON_SHIM=<dir with cpu_shim.py> <python with megatron-core> -m benchmarks.host_cost
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
import mc_tp_layers as tpl
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig

if not __package__:  # run as a file: the ranks import this module by its package name
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import _common, _host_peers, _phase_profile, _python_work
from benchmarks._common import Step

WIDTH, BATCH = 8, 4
SIZES = (100, 1000, 5000)
TARGET_SIZES = (1000, 5000)
TORCH_LIMIT = 1.2  # mc's per-param cost ≤ 1.2 × torch DDP's
H, SEQ, TP_BATCH, TP = 32, 16, 2, 2
PROFILE_ROUNDS, PROFILE_CALLS, TP_PROFILE_CALLS = 5, 3, 40  # profiles: rounds × steps
LOCAL, TORCH, MEGATRON, MC = "local", "torch DDP", "Megatron DDP", "mc DDP"
CPU = torch.device("cpu")

DDP_PHASES = _phase_profile.rules(
    by_name={
        "hooks.py:__call__": "hook entry",
        "distributed_data_parallel.py:hook": "hook entry",  # Megatron's closure
        "distributed_data_parallel.py:_graph_capturing": "capture probe",
        "device.py:is_graph_capturing": "capture probe",
        "cuda_graphs.py:is_graph_capturing": "capture probe",
        "~:'add_'": "accumulate",
        "distributed_data_parallel.py:_on_grad_ready": "accumulate",
        "param_attrs.py:main_grad_of": "accumulate",
        "param_attrs.py:bool_attr": "checks",
        "bucket_group.py:_refuse_late_grad": "checks",
        "bucket_group.py:register_grad_ready": "readiness",
        "param_and_grad_buffer.py:register_grad_ready": "readiness",
        "bucket_group.py:_dispatches_from_hooks": "readiness",
        "bucket_group.py:start_grad_sync": "dispatch",
        "param_and_grad_buffer.py:start_grad_sync": "dispatch",
        "distributed_data_parallel.py:zero_grad_buffer": "zero_grad_buffer",
        "distributed_data_parallel.py:finish_grad_sync": "finish_grad_sync",
        "~:run_backward": "autograd engine (C++)",
        "module.py:_call_impl": "forward",
        "distributed_data_parallel.py:forward": "forward",
    },
    by_file={"mc_groups/argcheck.py": "checks"},
)

TP_PHASES = _phase_profile.rules(
    by_name={
        "~:_distributed_c10d": "collective (issue + wait for the peer)",
        "~:run_backward": "autograd engine (C++)",
        **{f"~:{op}": "compute" for op in ("linear", "matmul", "gelu", "'mm'", "addmm", "'sum'")},
        "_core.py:describe": "bookkeeping (recorder, labels)",
        "_layer_base.py:_checked": "checks",
        "linear.py:check_operands": "checks",
        "linear.py:_check_common": "checks",
        "_core.py:check_options": "checks",
        "_core.py:check_op": "checks",
        "_core.py:check_contiguous": "checks",
    },
    by_file={
        "mc_groups/argcheck.py": "checks",
        "mc_tp_layers/_validate.py": "checks",
        "mc_groups/recorder.py": "bookkeeping (recorder, labels)",
        "mc_groups/schedule_check.py": "bookkeeping (recorder, labels)",
        "mc_tp_layers/agreement.py": "agreement",
        "mc_groups/together.py": "agreement",
        "torch/distributed/": "collective (issue + wait for the peer)",
        "mc_groups/": "mc_groups glue",
        "mc_tp_layers/": "layer glue",
        "megatron/core/": "layer glue",
    },
)


# -- DDP ---------------------------------------------------------------------------------


def _model(params: int, device: torch.device = CPU) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(params // 2)]).to(device)


def _batch(device: torch.device = CPU) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    return torch.randn(BATCH, WIDTH, generator=gen).to(device)


def _local(params: int, device: torch.device = CPU) -> tuple[Step, nn.Module]:
    model, x = _model(params, device), _batch(device)
    weights = list(model.parameters())

    def step() -> None:
        for p in weights:
            p.grad = None
        model(x).square().mean().backward()

    return step, model


def _torch_ddp(params: int, device: torch.device = CPU) -> tuple[Step, nn.Module]:
    model = nn.parallel.DistributedDataParallel(
        _model(params, device), gradient_as_bucket_view=True
    )
    opt, x = torch.optim.SGD(model.parameters(), lr=0.0), _batch(device)

    def step() -> None:
        opt.zero_grad(set_to_none=False)
        model(x).square().mean().backward()

    return step, model


def _wrapped(ddp: Any, device: torch.device = CPU) -> Step:
    x = _batch(device)

    def step() -> None:
        ddp.zero_grad_buffer()
        ddp(x).square().mean().backward()
        ddp.finish_grad_sync()

    return step


def _mc_ddp(
    params: int, pgc: mg.ProcessGroupCollection, device: torch.device = CPU
) -> tuple[Step, nn.Module]:
    config = DistributedDataParallelConfig(overlap_grad_reduce=True)
    ddp = DistributedDataParallel(
        mg.ModelParallelConfig(), config, _model(params, device), pg_collection=pgc
    )
    return _wrapped(ddp, device), ddp


def _first_grad(name: str, model: nn.Module) -> torch.Tensor:
    param = next(model.parameters())
    grad = param.grad if name in (LOCAL, TORCH) else getattr(param, "main_grad", None)
    assert grad is not None
    return grad.detach().clone()


def _ddp_variants(
    params: int, pgc: mg.ProcessGroupCollection, device: torch.device = CPU
) -> tuple[dict[str, tuple[Step, nn.Module]], str]:
    """The local model and every library's DDP of ``params`` params (Megatron-Core's when it
    imports), each as (step, module), and the line saying which Megatron-Core ran."""
    core, why = _host_peers.import_megatron()
    variants = {
        LOCAL: _local(params, device),
        TORCH: _torch_ddp(params, device),
        MC: _mc_ddp(params, pgc, device),
    }
    if core is not None:
        model = _model(params, device)
        ddp = _host_peers.megatron_ddp(core, pgc, model, overlap_grad_reduce=True)
        variants[MEGATRON] = (_wrapped(ddp, device), ddp)
    return variants, why


def _measure_ddp(params: int, rounds: int, steps: int, warmup: int, prof: bool) -> dict[str, Any]:
    """On every rank: build the variants of one size, check their grads agree, time them."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel()
    try:
        variants, why = _ddp_variants(params, pgc)
        for step, _ in variants.values():
            step()
        # the local grad is this rank's; the DDP ones are averaged over both ranks
        local = _first_grad(LOCAL, variants[LOCAL][1])
        mean = local.clone()
        dist.all_reduce(mean)
        mean /= dist.get_world_size()
        diffs = {n: float((_first_grad(n, m) - mean).abs().max()) for n, (_, m) in variants.items()}
        diffs.pop(LOCAL)
        bests = _common.round_bests(
            {n: s for n, (s, _) in variants.items()},
            warmup=warmup,
            rounds=rounds,
            steps_per_round=steps,
        )
        profiles: dict[str, dict[str, float]] = {}
        if prof:  # on every rank: the steps communicate
            for name in (MC, MEGATRON):
                if name in variants:
                    profiles[name] = _phase_profile.median_phases(
                        variants[name][0], DDP_PHASES, rounds=PROFILE_ROUNDS, calls=PROFILE_CALLS
                    )
        return {"bests": bests, "diffs": diffs, "megatron": why, "profiles": profiles}
    finally:
        mg.destroy_model_parallel(pgc)


def _ddp_host_only(params: int, passes: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """In a one-rank world (module notes): the local model and every library's DDP of one
    size, time per pass (:func:`_clock`), and the Python mc's and Megatron-Core's DDP run
    per step."""
    torch.set_num_threads(1)  # as on the ranks (the CPU clock counts every thread)
    pgc = mg.initialize_model_parallel()
    try:
        variants, why = _ddp_variants(params, pgc, device)
        steps = {n: _synced(s, device) for n, (s, _) in variants.items()}
        times = _common.pass_times(steps, warmup=warmup, passes=passes, clock=_clock(device))
        work = {n: _python_work.per_step(steps[n], steps=2) for n in (MC, MEGATRON) if n in steps}
        return {"times": times, "megatron": why, "work": work}
    finally:
        mg.destroy_model_parallel(pgc)


def _clock(device: torch.device) -> Callable[[], float]:
    """CPU time on CPU; on a GPU wall time of a step that ends synchronised (a CUDA sync
    spins on the CPU, so CPU time would count the GPU's work as host work)."""
    return time.perf_counter if device.type == "cuda" else time.process_time


def _synced(step: Step, device: torch.device) -> Step:
    """``step``, followed on a GPU by a device synchronisation (the GPU's work counted)."""
    if device.type != "cuda":
        return step

    def synced() -> None:
        step()
        torch.cuda.synchronize(device)

    return synced


def _ddp_host_rows(
    sizes: Sequence[int], passes: int, warmup: int, device: torch.device
) -> tuple[list[str], bool]:
    """DDP's host cost per param alone (``--part ddp-host``): table and verdicts."""
    with _host_peers.one_rank_world(device):
        results = {n: _ddp_host_only(n, passes, warmup, device) for n in sizes}
    lines = [
        f"{next(iter(results.values()))['megatron']}; {device.type}, {_clock(device).__name__}",
        "| params | local step (ms) | torch DDP µs/param | Megatron µs/param | mc µs/param | "
        "mc / torch | mc / Megatron | mc − Megatron per pass, µs/param (quartiles) | "
        "Python per param: instructions / calls, mc; Megatron | targets |",
        "|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    ok = True
    for params, result in results.items():
        times, work = result["times"], result["work"]
        med = {n: statistics.median(v) for n, v in times.items()}
        cost = {n: (med[n] - med[LOCAL]) / params * 1e6 for n in med if n != LOCAL}
        python = _per_param(work[MC], params)
        verdicts = []
        if params in TARGET_SIZES:
            met = cost[MC] <= TORCH_LIMIT * cost[TORCH]
            verdicts.append(f"≤ {TORCH_LIMIT}× torch: {'met' if met else 'MISSED'}")
            ok &= met
        ratio = paired = meg = "—"
        if MEGATRON in cost:
            diffs = [
                (a - b) / params * 1e6 for a, b in zip(times[MC], times[MEGATRON], strict=True)
            ]
            q = statistics.quantiles(diffs, n=4, method="inclusive")
            paired = f"{q[1]:+.2f} ({q[0]:+.2f} – {q[2]:+.2f})"
            ratio, meg = f"{cost[MC] / cost[MEGATRON]:.3f}", f"{cost[MEGATRON]:.2f}"
            python += f"; {_per_param(work[MEGATRON], params)}"
            if params in TARGET_SIZES:  # judged on the pairs: the local baseline cancels
                met = q[1] <= 0.0
                verdicts.append(f"≤ Megatron (paired): {'met' if met else 'MISSED'}")
                ok &= met
        lines.append(
            f"| {params:,} | {med[LOCAL] * 1e3:.1f} | {cost[TORCH]:.2f} | {meg} | {cost[MC]:.2f} "
            f"| {cost[MC] / cost[TORCH]:.3f} | {ratio} | {paired} | {python} | "
            f"{'; '.join(verdicts)} |"
        )
    return lines, ok


def _per_param(work: tuple[float, float], params: int) -> str:
    """Counted Python per step as instructions / calls per param."""
    return f"{work[0] / params:.0f} / {work[1] / params:.1f}"


def _per_round_slowest(per_rank: Sequence[dict[str, Any]], clock: str) -> dict[str, list[float]]:
    """Per variant and round, the slower rank's round median on ``clock``."""
    names = per_rank[0]["bests"][clock]
    return {
        n: [max(v) for v in zip(*(r["bests"][clock][n] for r in per_rank), strict=True)]
        for n in names
    }


def _ddp_rows(params: int, per_rank: Sequence[dict[str, Any]]) -> tuple[list[str], bool]:
    """One row per clock; the targets are judged on wall time (the step time)."""
    rows, ok = [], True
    for clock in ("wall", "cpu"):
        slow = _per_round_slowest(per_rank, clock)
        local = slow[LOCAL]
        cost = {  # µs per param, per round
            n: [(v - b) / params * 1e6 for v, b in zip(vals, local, strict=True)]
            for n, vals in slow.items()
            if n != LOCAL
        }
        med = {n: statistics.median(v) for n, v in cost.items()}
        shown = {n: f"{med[n]:.1f} ({min(v):.1f} – {max(v):.1f})" for n, v in cost.items()}
        verdicts = []
        if params in TARGET_SIZES and clock == "wall":
            met = med[MC] <= TORCH_LIMIT * med[TORCH]
            verdicts.append(f"≤ {TORCH_LIMIT}× torch: {'met' if met else 'MISSED'}")
            ok &= met
            if MEGATRON in med:
                met = med[MC] <= med[MEGATRON]
                verdicts.append(f"≤ Megatron: {'met' if met else 'MISSED'}")
                ok &= met
        vs_megatron = f"{med[MC] / med[MEGATRON]:.2f}" if MEGATRON in med else "—"
        rows.append(
            f"| {params:,} | {clock} | {statistics.median(local) * 1e3:.1f} | {shown[TORCH]} | "
            f"{shown.get(MEGATRON, '—')} | {shown[MC]} | {med[MC] / med[TORCH]:.2f} | "
            f"{vs_megatron} | {'; '.join(verdicts)} |"
        )
    return rows, ok


DDP_HEADER = [
    "| params | clock | local step (ms) | torch DDP µs/param | Megatron µs/param | mc µs/param | "
    "mc / torch | mc / Megatron | targets (wall) |",
    "|---:|---|---:|---:|---:|---:|---:|---:|---|",
]


# -- TP ----------------------------------------------------------------------------------


def _mc_block(
    sp: bool, pgc: mg.ProcessGroupCollection, device: torch.device = CPU
) -> tuple[_host_peers.Block, list[Any]]:
    config = mg.ModelParallelConfig(
        tensor_model_parallel_size=TP, sequence_parallel=sp, use_cpu_initialization=True
    )
    return _common.column_row_block(tpl, H, config, device, pg_collection=pgc)


def _tp_step(
    block: _host_peers.Block,
    params: Sequence[torch.Tensor],
    sp: bool,
    device: torch.device = CPU,
) -> Step:
    full = torch.randn(SEQ, TP_BATCH, H, generator=torch.Generator().manual_seed(1))
    x = (full.chunk(TP, dim=0)[dist.get_rank()] if sp else full).contiguous().to(device)
    x.requires_grad_()

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        y = block(x)
        y.backward(torch.ones_like(y))  # type: ignore[no-untyped-call]

    return step


def _tp_blocks(
    sp: bool, pgc: mg.ProcessGroupCollection, core: Any, dtensor: bool, device: torch.device
) -> dict[str, Step]:
    """The TP block of mc, Megatron-Core (when ``core`` imported) and DTensor (when
    ``dtensor``) for one SP setting, as steps named ``"<library> SP on|off"``."""
    tag = f"SP {'on' if sp else 'off'}"
    blocks = {f"mc {tag}": _mc_block(sp, pgc, device)}
    if core is not None:
        blocks[f"Megatron {tag}"] = _host_peers.megatron_block(core, H, TP, sp, pgc.tp, device)
    if dtensor:
        blocks[f"DTensor {tag}"] = _host_peers.dtensor_block(H, TP, sp, device)
    return {name: _synced(_tp_step(*b, sp, device), device) for name, b in blocks.items()}


def _measure_tp(
    rounds: int,
    steps: int,
    warmup: int,
    prof: bool,
    dtensor: bool = True,
    device: torch.device = CPU,
    count: bool = False,
) -> dict[str, Any]:
    """On every rank: the TP block of every library, SP off and on, timed in rounds; with
    ``count``, the Python mc's and Megatron-Core's blocks run per step (``"work"``,
    :mod:`benchmarks._python_work`)."""
    torch.set_num_threads(1)
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        core, why = _host_peers.import_megatron()
        variants: dict[str, Step] = {}
        for sp in (False, True):
            variants |= _tp_blocks(sp, pgc, core, dtensor, device)
        bests = _common.round_bests(variants, warmup=warmup, rounds=rounds, steps_per_round=steps)
        profiles: dict[str, dict[str, float]] = {}
        if prof:  # on every rank: the steps communicate
            for name, step in variants.items():
                if not name.startswith("DTensor"):
                    profiles[name] = _phase_profile.median_phases(
                        step, TP_PHASES, rounds=PROFILE_ROUNDS, calls=TP_PROFILE_CALLS
                    )
        work = {
            name: _python_work.per_step(step)
            for name, step in variants.items()
            if count and not name.startswith("DTensor")
        }
        return {"bests": bests, "megatron": why, "profiles": profiles, "work": work}
    finally:
        mg.destroy_model_parallel(pgc)


def _tp_rows(per_rank: Sequence[dict[str, Any]]) -> tuple[list[str], bool]:
    """One row per SP setting and clock; the target is judged on wall time."""
    lines = [
        "| SP | clock | mc (ms) | Megatron (ms) | DTensor (ms) | mc / Megatron | mc / DTensor "
        "| target (wall) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    ok = True
    for tag in ("SP off", "SP on"):
        for clock in ("wall", "cpu"):
            slow = {n: statistics.median(v) for n, v in _per_round_slowest(per_rank, clock).items()}
            mc, dt = slow[f"mc {tag}"], slow[f"DTensor {tag}"]
            meg = slow.get(f"Megatron {tag}")
            verdict = ""
            if meg is not None and clock == "wall":
                met = mc <= meg
                ok &= met
                verdict = f"≤ Megatron: {'met' if met else 'MISSED'}"
            meg_ms = "—" if meg is None else f"{meg * 1e3:.2f}"
            ratio = "—" if meg is None else f"{mc / meg:.2f}"
            lines.append(
                f"| {tag[3:]} | {clock} | {mc * 1e3:.2f} | {meg_ms} | {dt * 1e3:.2f} | {ratio} "
                f"| {mc / dt:.2f} | {verdict} |"
            )
    return lines, ok


def _host_only_rows(
    rounds: int, steps: int, warmup: int, dtensor: bool, device: torch.device
) -> tuple[list[str], bool]:
    """The TP block's host time alone (module notes), in this process; table and verdict."""
    with _host_peers.fake_world(TP) as why_not:
        if why_not is not None:
            return [f"TP host time alone: skipped ({why_not})"], True
        if device.type == "cuda":
            torch.cuda.set_device(device)
        result = _measure_tp(rounds * 6, steps * 2, warmup, False, dtensor, device, count=True)
        work = result["work"]
    cpu = result["bests"]["wall" if device.type == "cuda" else "cpu"]  # see _clock
    lines = [
        "| SP | mc (µs) | Megatron (µs) | DTensor (µs) | mc / Megatron (quartiles) | "
        "mc / DTensor | target |",
        "|---|---:|---:|---:|---|---:|---|",
    ]
    ok = True
    for tag in ("SP off", "SP on"):
        mc, dt = cpu[f"mc {tag}"], cpu.get(f"DTensor {tag}")
        meg = cpu.get(f"Megatron {tag}")
        shown, verdict = "—", ""
        if meg is not None:
            ratio = statistics.median(mc) / statistics.median(meg)
            per_round = statistics.quantiles(
                [a / b for a, b in zip(mc, meg, strict=True)], n=4, method="inclusive"
            )
            shown = f"{ratio:.3f} ({per_round[0]:.3f} – {per_round[2]:.3f})"
            verdict = f"≤ Megatron: {'met' if ratio <= 1.0 else 'MISSED'}"
            ok &= ratio <= 1.0
        meg_us = "—" if meg is None else f"{statistics.median(meg) * 1e6:.0f}"
        dt_us = "—" if dt is None else f"{statistics.median(dt) * 1e6:.0f}"
        vs_dt = "—" if dt is None else f"{statistics.median(mc) / statistics.median(dt):.3f}"
        lines.append(
            f"| {tag[3:]} | {statistics.median(mc) * 1e6:.0f} | {meg_us} | {dt_us} | {shown} "
            f"| {vs_dt} | {verdict} |"
        )
    lines += ["", "Python run per step (bytecode instructions / Python-level calls, counted):"]
    lines += [f"- {name}: {ops:,.0f} / {calls:,.0f}" for name, (ops, calls) in work.items()]
    return [f"{result['megatron']}; {device.type}, {_clock(device).__name__}", *lines], ok


# -- main --------------------------------------------------------------------------------


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (>= 3)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant")
    parser.add_argument(
        "--part", choices=("ddp", "ddp-host", "tp", "tp-host", "both"), default="both"
    )
    parser.add_argument(
        "--sizes", type=int, nargs="+", default=list(SIZES), help="DDP params per model"
    )
    parser.add_argument("--no-profile", action="store_true", help="skip the phase profiles")
    parser.add_argument(
        "--no-dtensor",
        action="store_true",
        help="tp-host: time mc and Megatron only (each right after the other or itself)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="ddp-host / tp-host: where the models run (cuda: the current GPU, wall clock)",
    )
    parser.add_argument(
        "--json", type=Path, help="ddp-host / tp-host: also write the table and verdict here"
    )
    args = parser.parse_args(argv)
    if args.rounds < 3:
        parser.error("--rounds must be >= 3 (a ratio from fewer rounds is noise)")
    host_only = args.part in ("ddp-host", "tp-host")
    if not host_only and (args.device != "cpu" or args.json is not None):
        parser.error("--device and --json go with --part ddp-host or tp-host (one process)")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    return args


def _print_profiles(profiles: dict[str, dict[str, float]], calls: int, per: int, unit: str) -> None:
    for name, seconds in profiles.items():
        print(
            f"\nwhere {name}'s time goes (cProfile less its own cost per call; median of "
            f"{PROFILE_ROUNDS} profiles of {calls} steps, rank 0):"
        )
        print("\n".join(_phase_profile.table(seconds, calls, per, unit)))


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    if args.part in ("ddp-host", "tp-host"):
        device = torch.device(args.device, 0) if args.device == "cuda" else CPU
        if args.part == "ddp-host":
            lines, ok = _ddp_host_rows(args.sizes, args.rounds * args.steps, args.warmup, device)
        else:
            dtensor = not args.no_dtensor
            lines, ok = _host_only_rows(args.rounds, args.steps, args.warmup, dtensor, device)
        print("\n".join(lines))
        if args.json is not None:
            record = {"part": args.part, "device": str(device), "lines": lines, "targets_met": ok}
            args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        return 0 if ok else 1
    ok = True
    module = importlib.import_module("benchmarks.host_cost")  # the ranks import it by name
    with _common.rank_pool(2) as pool:
        if args.part in ("ddp", "both"):
            lines = list(DDP_HEADER)
            for params in args.sizes:
                per_rank = pool.run(
                    module._measure_ddp,
                    params,
                    args.rounds,
                    args.steps,
                    args.warmup,
                    not args.no_profile,
                )
                if params == args.sizes[0]:
                    print(per_rank[0]["megatron"], flush=True)
                print(
                    f"{params:,} params: max |grad - mean of local grads| {per_rank[0]['diffs']}",
                    flush=True,
                )
                rows, met = _ddp_rows(params, per_rank)
                lines += rows
                ok &= met
                _print_profiles(per_rank[0]["profiles"], PROFILE_CALLS, params, "param")
            print("\n".join(lines), flush=True)
        if args.part in ("tp", "both"):
            per_rank = pool.run(
                module._measure_tp, args.rounds, args.steps * 5, args.warmup, not args.no_profile
            )
            print(per_rank[0]["megatron"])
            _print_profiles(per_rank[0]["profiles"], TP_PROFILE_CALLS, 1, "call")
            lines, met = _tp_rows(per_rank)
            ok &= met
            print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
