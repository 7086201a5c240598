"""Shared pieces of the integration tests: the small GPT's sizes, the optimizer, the data,
the 1-process reference (computed once per session in the test process), the backends
(gloo always; NCCL when enough GPUs are visible, else skipped with the reason) and the
comparisons."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from typing import Any, NamedTuple

import pytest
import torch

import mc_groups as mg
from examples.gpt import (
    GPTConfig,
    OptimizerConfig,
    ParallelLayout,
    ReferenceRun,
    global_batch,
    init_full_weights,
    train_reference,
)
from mc_groups.testing import gpu_skip_reason

CFG = GPTConfig(vocab_size=64, hidden_size=32, num_heads=4, num_layers=2, seq_length=16)
# SGD's update is linear in the gradient, so a wrong scale (a missing 1/dp, a doubled SP
# sum) moves the weights; Adam would normalise it away. lr 0.3 with momentum takes the
# loss from 4.17 to 3.14 in 4 steps and moves every tensor by >= 1e-3 in 5.
SGD = OptimizerConfig(name="sgd", lr=0.3, momentum=0.9)
GLOBAL_BATCH = 8  # sequences per step: 2 DP ranks × 2 micro-batches × 2 sequences
STEPS = 5
SEED = 1234


def batch(step: int) -> torch.Tensor:
    """The global batch of ``step`` (``[8, 17]`` token ids), the same on every rank."""
    return global_batch(step, GLOBAL_BATCH, CFG.seq_length, seed=SEED)


@cache
def full_weights() -> dict[str, torch.Tensor]:
    """The 1-process GPT's initial weights."""
    return init_full_weights(CFG, SEED)


@cache
def reference() -> ReferenceRun:
    """Plain PyTorch, one process, the whole batch: losses of the 5 steps, final weights."""
    return train_reference(full_weights(), CFG, SGD, batch, STEPS)


def backends(world_size: int) -> list[Any]:
    """``gloo`` and ``nccl`` (marked ``gpu``; skipped with the reason without the GPUs)."""
    reason = gpu_skip_reason(world_size)
    return [
        pytest.param("gloo", id="gloo"),
        pytest.param(
            "nccl",
            id="nccl",
            marks=[pytest.mark.gpu, pytest.mark.skipif(reason is not None, reason=reason or "")],
        ),
    ]


def device_for(backend: str) -> torch.device:
    """Where a rank of ``backend``'s world keeps its model."""
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextmanager
def model_parallel(layout: ParallelLayout) -> Iterator[mg.ProcessGroupCollection]:
    """The layout's groups, destroyed on exit even when the body raises."""
    pgc = layout.initialize_groups()
    try:
        yield pgc
    finally:
        mg.destroy_model_parallel(pgc)


class Record(NamedTuple):
    """A picklable summary of one recorded collective."""

    op: str
    reduce_op: str | None
    group_ranks: tuple[int, ...]
    label: str
    async_op: bool


def summarize(log: list[mg.CollectiveRecord]) -> list[Record]:
    """The fields of each record the tests look at."""
    return [Record(r.op, r.reduce_op, r.group_ranks, r.label, r.async_op) for r in log]


def max_rel_loss_diff(losses: list[float], ref: list[float]) -> float:
    """``max_t |loss_t − ref_t| / |ref_t|`` (both lists must have the same length)."""
    assert len(losses) == len(ref), (len(losses), len(ref))
    return max(abs(a - b) / abs(b) for a, b in zip(losses, ref, strict=True))


def max_weight_diff(
    weights: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor],
    *,
    relative_to_tensor: bool = False,
) -> tuple[float, str]:
    """The largest ``|w − ref|`` over every element (divided by the reference tensor's
    largest magnitude when ``relative_to_tensor``) and the name of the worst tensor."""
    assert sorted(weights) == sorted(ref), sorted(set(weights) ^ set(ref))
    worst, name = -1.0, ""
    for key, value in weights.items():
        diff = float((value.float() - ref[key]).abs().max())
        if relative_to_tensor:
            diff /= float(ref[key].abs().max())
        if diff > worst:
            worst, name = diff, key
    return worst, name


def smallest_update(ref: ReferenceRun, relative_to_tensor: bool = False) -> float:
    """The smallest per-tensor ``max |w_final − w_initial|`` of the reference run: a weight
    tolerance far below it means a lost or mis-scaled update fails the comparison."""
    start = full_weights()
    moves = []
    for key, final in ref.weights.items():
        move = float((final - start[key]).abs().max())
        moves.append(move / float(final.abs().max()) if relative_to_tensor else move)
    return min(moves)


@contextmanager
def counting_dist(
    names: tuple[str, ...] = ("all_gather_single", "reduce_scatter_single"),
) -> Iterator[list[tuple[str, tuple[int, ...], int, torch.dtype]]]:
    """``(op, group ranks, numel, dtype)`` of every ``dist.all_gather_single`` /
    ``dist.reduce_scatter_single`` (or other ``names``: FSDP2 calls each with ``group=``)
    issued inside (FSDP2's collectives)."""
    import torch.distributed as dist

    seen: list[tuple[str, tuple[int, ...], int, torch.dtype]] = []
    originals = {name: getattr(dist, name) for name in names}

    def counting(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = (list(args) or list(kwargs.values()))[0]
            group = tuple(dist.get_process_group_ranks(kwargs["group"]))
            seen.append((name, group, int(tensor.numel()), tensor.dtype))
            return originals[name](*args, **kwargs)

        return call

    for name in names:
        setattr(dist, name, counting(name))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
