"""Shared helpers for the benchmarks: timings, the ratio table, and the rank launch.

Every benchmark times mc and its peer (torch DDP, torch DTensor TP, ...) in the same run on
the same ranks and reports ``mc / peer``: absolute seconds on a shared 2-core machine vary
run to run, ratios measured side by side are what we compare against targets.
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mc_groups.testing import RankPool

Step = Callable[[], None]


def median_seconds(step: Callable[[], object], *, warmup: int = 3, iters: int = 10) -> float:
    """Median wall time of ``step()`` over ``iters`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(iters):
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ratio_table(
    rows: Sequence[tuple[str, float]], reference: str, *, unit: str = "ms", scale: float = 1e3
) -> str:
    """A Markdown table of ``(name, seconds)`` rows with each row's ratio to ``reference``."""
    base = dict(rows)[reference]
    lines = [f"| variant | median ({unit}) | ratio to {reference} |", "|---|---:|---:|"]
    lines += [f"| {name} | {sec * scale:.2f} | {sec / base:.3f} |" for name, sec in rows]
    return "\n".join(lines)


def interleaved_medians(steps: Mapping[str, Step], warmup: int, iters: int) -> dict[str, float]:
    """Each step's median time on this rank; every round times each step once, in order.

    Run on every rank at once: a barrier before each timed step makes the ranks start it
    together, whatever ran before, so load from other processes hits every step alike.
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(iters):
        for name, step in steps.items():
            dist.barrier()
            started = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) for name, values in times.items()}


def round_bests(
    steps: Mapping[str, Step], *, warmup: int, rounds: int, steps_per_round: int
) -> dict[str, dict[str, list[float]]]:
    """Each step's best time per round on this rank, by clock: ``"wall"``
    (``perf_counter``) and ``"cpu"`` (``process_time``: this process's CPU time, every
    thread, which load from other processes inflates far less than wall time).

    Run on every rank at once. A round runs ``steps_per_round`` passes; a pass times every
    step once, each after a barrier, in an order shuffled from pass to pass (seeded by the
    pass, so the same on every rank), so a burst of load from other processes falls on all
    of them alike and no step always follows the same other one: the step before leaves
    the CPU caches holding its own code and data, and the rotation used before (a fixed
    cyclic order) charged the step that always ran after DTensor's 10–15 % more (measured
    on the TP block, issue 30). A round's value is the best of its samples (other
    processes only ever add time: the fastest is the least disturbed measure of what a
    step costs).
    """
    for step in steps.values():
        for _ in range(warmup):
            step()
    names = list(steps)
    bests: dict[str, dict[str, list[float]]] = {"wall": {}, "cpu": {}}
    for clock in bests.values():
        clock.update({name: [] for name in names})
    turn = 0
    for _ in range(rounds):
        wall: dict[str, float] = dict.fromkeys(names, float("inf"))
        cpu: dict[str, float] = dict.fromkeys(names, float("inf"))
        for _ in range(steps_per_round):
            turn += 1
            order = list(names)
            random.Random(turn).shuffle(order)
            for name in order:
                dist.barrier()
                started, started_cpu = time.perf_counter(), time.process_time()
                steps[name]()
                wall[name] = min(wall[name], time.perf_counter() - started)
                cpu[name] = min(cpu[name], time.process_time() - started_cpu)
        for name in names:
            bests["wall"][name].append(wall[name])
            bests["cpu"][name].append(cpu[name])
    return bests


def pass_times(
    steps: Mapping[str, Step],
    *,
    warmup: int,
    passes: int,
    clock: Callable[[], float] = time.process_time,
) -> dict[str, list[float]]:
    """Each step's time on ``clock`` (default: this process's CPU time) in every pass, on
    this process alone (no barrier: for one process as the only rank, or over torch's fake
    process group). A pass times every step once, in an order shuffled from pass to pass
    as in :func:`round_bests`. For steps long enough (tens of ms) that the fastest of a few
    samples is itself noisy on a shared machine: the caller takes medians over many passes,
    or pairs the steps of one pass."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for turn in range(passes):
        order = list(steps)
        random.Random(turn).shuffle(order)
        for name in order:
            started = clock()
            steps[name]()
            times[name].append(clock() - started)
    return times


def slowest_medians(per_rank: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Per step, the slower rank's median (``per_rank[r]["medians"]``): what the step costs."""
    return {k: max(r["medians"][k] for r in per_rank) for k in per_rank[0]["medians"]}


def parse_arguments(
    doc: str, *, iters: int | None, iters_help: str, warmup: int
) -> argparse.Namespace:
    """``--iters`` and ``--warmup`` (untimed steps per variant); described by ``doc``'s
    first line."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--iters", type=int, default=iters, help=iters_help)
    parser.add_argument("--warmup", type=int, default=warmup, help="untimed steps per variant")
    return parser.parse_args()


def rank_pool(world: int) -> RankPool:
    """The benchmarks' ranks: long deadlines (a slow shared machine is no failure)."""
    return RankPool(world, call_deadline_s=1800, pg_timeout_s=300)


def rank_worker(module: str) -> Callable[..., dict[str, Any]]:
    """``module._measure``, imported by its package name: the ranks cannot import
    ``__main__``."""
    measure: Callable[..., dict[str, Any]] = importlib.import_module(module)._measure
    return measure


def normal_init(weight: torch.Tensor) -> None:
    """The TP benchmarks' weight init: normal, std 0.02."""
    torch.nn.init.normal_(weight, std=0.02)


def column_row_layers(layers: Any, h: int, config: Any, **group: Any) -> tuple[Any, Any]:
    """``Column(h → 4h)`` and ``Row(4h → h)`` of ``layers`` (mc_tp_layers or Megatron-Core's
    ``tensor_parallel``: the same constructor arguments), seeded 0, biases on, the row layer
    adding its bias; ``group``: the layers' group argument (``pg_collection=`` or
    ``tp_group=``)."""
    torch.manual_seed(0)
    fc1 = layers.ColumnParallelLinear(
        h, 4 * h, config=config, init_method=normal_init, bias=True, **group
    )
    fc2 = layers.RowParallelLinear(
        4 * h,
        h,
        config=config,
        init_method=normal_init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        **group,
    )
    return fc1, fc2


def column_row_block(
    layers: Any, h: int, config: Any, device: torch.device | None = None, **group: Any
) -> tuple[Callable[[torch.Tensor], torch.Tensor], list[torch.nn.Parameter]]:
    """``Column(h → 4h) → GELU → Row(4h → h)`` (:func:`column_row_layers`): the block's
    forward and its params, moved to ``device`` when given (built where ``config`` says)."""
    fc1, fc2 = column_row_layers(layers, h, config, **group)
    if device is not None:
        fc1.to(device)
        fc2.to(device)

    def block(x: torch.Tensor) -> torch.Tensor:
        hidden, _ = fc1(x)
        out, _ = fc2(F.gelu(hidden))
        return out  # type: ignore[no-any-return]

    return block, [*fc1.parameters(), *fc2.parameters()]


def dtensor_llama_layer_plan(sp: bool) -> dict[str, Any]:
    """torch DTensor's plan for one ``transformers`` Llama decoder layer at TP (the peer of
    ``mc_tp_layers.sequence_parallel_plan``'s layer entries): attention and MLP projections
    column / row parallel; with ``sp`` the norms sequence-parallel on dim 1 and the attention
    and MLP inputs gathered from it."""
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415
    from torch.distributed.tensor.parallel import (  # noqa: PLC0415
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    out = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=out),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=out),
    }
    if sp:
        plan["input_layernorm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["post_attention_layernorm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["self_attn"] = PrepareModuleInput(
            input_kwarg_layouts={"hidden_states": Shard(1)},
            desired_input_kwarg_layouts={"hidden_states": Replicate()},
            use_local_output=True,
        )
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan
