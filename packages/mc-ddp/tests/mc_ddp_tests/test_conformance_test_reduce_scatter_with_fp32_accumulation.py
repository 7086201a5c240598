"""Conformance with Megatron-LM's
``tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py``: the same facts
held against :func:`mc_ddp.reduce_scatter_with_fp32_accumulation` on 4 gloo ranks.

Upstream compares the function with NCCL's ``reduce_scatter_tensor`` in fp32 (must match) and
in bf16 (must not). On gloo, mc_groups' own reduce-scatter already sums narrow dtypes in fp32,
so the two baselines are computed here in one process from every rank's input (each rank
regenerates all inputs from their seeds): the fp32 sum in rank order rounded once to bf16, and
a bf16 running sum rounded after every addition. "Match" is upstream's ``torch.allclose`` with
its default tolerances, which at bf16 resolution (a relative step of 2**-8) means equality.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import shard_buffer
from mc_ddp import reduce_scatter_with_fp32_accumulation
from mc_ddp_tests._harness import model_parallel
from mc_groups.testing import RankPools

NUMEL, TRIALS = 100_000, 3


def _inputs(trial: int, world: int) -> list[torch.Tensor]:
    """Every rank's bf16 input of one trial (uniform in [0, 1), as upstream's ``torch.rand``)."""
    return [
        torch.rand(NUMEL, generator=torch.Generator().manual_seed(100 * trial + r)).bfloat16()
        for r in range(world)
    ]


def _random_inputs(async_op: bool) -> list[dict[str, Any]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    assert group is not None
    out = []
    for trial in range(TRIALS):
        inputs = _inputs(trial, world)
        flat = inputs[rank].clone()
        shard = shard_buffer(flat, world)[rank]  # the output is a view of the input
        with mg.record_collectives() as log:
            pending = reduce_scatter_with_fp32_accumulation(
                shard, flat, group, op=mg.ReduceOp.SUM, async_op=async_op
            )
            pending.wait()
        chunks = [shard_buffer(t, world)[rank] for t in inputs]
        fp32 = chunks[0].float()
        running = chunks[0].clone()
        for chunk in chunks[1:]:
            fp32 = fp32 + chunk.float()
            running = running + chunk  # bf16: rounded after every addition
        result = shard_buffer(flat, world)[rank]
        out.append(
            {
                "fp32_match": torch.allclose(result, fp32.bfloat16()),
                "fp32_differ": int((result != fp32.bfloat16()).sum()),
                "bf16_match": torch.allclose(result, running),
                "bf16_differ": int((result != running).sum()),
                "ops": [(r.op, r.dtype, r.numel, r.async_op) for r in log],
            }
        )
    return out


def _prescale_and_scratch() -> dict[str, Any]:
    out: dict[str, Any] = {}
    world_group = dist.group.WORLD
    assert world_group is not None
    with model_parallel(tensor_model_parallel_size=2) as pgc:
        assert pgc.dp is not None
        for name, group in (("world", world_group), ("pair", pgc.dp)):
            size, index = mg.group_size(group), mg.group_rank(group)
            gen = torch.Generator().manual_seed(7)
            contributions = (torch.randn(size, NUMEL, generator=gen) * 1e-3).bfloat16()
            scale = 1.0 / size
            averaged = contributions[index].clone()
            reduce_scatter_with_fp32_accumulation(
                shard_buffer(averaged, size)[index], averaged, group, op=mg.ReduceOp.AVG
            )
            prescaled = (contributions[index] * scale).clone()  # exact: a power of two
            reduce_scatter_with_fp32_accumulation(
                shard_buffer(prescaled, size)[index], prescaled, group, op=mg.ReduceOp.SUM
            )
            local = (contributions.sum(dim=0, dtype=torch.float32) * scale).bfloat16()
            mine = slice(index * (NUMEL // size), (index + 1) * (NUMEL // size))
            out[name] = {
                "size": size,
                "avg_vs_prescaled": int((averaged[mine] != prescaled[mine]).sum()),
                "avg_vs_local": int((averaged[mine] != local[mine]).sum()),
            }

        rank, world = dist.get_rank(), dist.get_world_size()
        tensor = _inputs(9, world)[rank]
        internal, provided = tensor.clone(), tensor.clone()
        reduce_scatter_with_fp32_accumulation(
            shard_buffer(internal, world)[rank], internal, world_group
        )
        with mg.record_collectives() as log:
            reduce_scatter_with_fp32_accumulation(
                shard_buffer(provided, world)[rank],
                provided,
                world_group,
                all_to_all_output_tensor=torch.empty_like(tensor),
            )
        with mg.record_collectives() as refused_log:
            try:
                reduce_scatter_with_fp32_accumulation(
                    shard_buffer(tensor, world)[rank],
                    tensor,
                    world_group,
                    all_to_all_output_tensor=torch.empty_like(tensor)[:-world],
                )
                refused = ""
            except AssertionError as err:  # mc's InputValueError is one, as Megatron asserts
                refused = str(err)
        mine = slice(rank * (NUMEL // world), (rank + 1) * (NUMEL // world))
        out["scratch"] = {
            "equal": torch.equal(provided[mine], internal[mine]),
            "ops": len(log),
            "refused": refused,
            "refused_ops": len(refused_log),
        }
    return out


@pytest.mark.parametrize("async_op", [True, False])
def test_reduce_scatter_with_fp32_accumulation(rank_pools: RankPools, async_op: bool) -> None:
    """Follows ``tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py::
    TestReduceScatterWithFP32Accumulation::test_reduce_scatter_with_fp32_accumulation``.

    Same facts (100 000 uniform bf16 values per rank, SUM, sync and async, the output a view
    of this rank's shard of the input): the result matches a reduction summed in fp32 and
    rounded once, and does not match a reduction done in bf16. Three trials here (upstream:
    20). The recorder shows the one bf16 all-to-all it communicates with.
    """
    for out in rank_pools.get(4).run(_random_inputs, async_op):
        for trial in out:
            assert trial["fp32_match"]
            assert trial["fp32_differ"] == 0
            assert not trial["bf16_match"]
            assert trial["bf16_differ"] > 0
            assert trial["ops"] == [("all_to_all", torch.bfloat16, NUMEL, async_op)]


@pytest.fixture(scope="module")
def prescale_and_scratch(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(4).run(_prescale_and_scratch)


def test_power_of_two_prescale_equals_scaling_the_fp32_sum(
    prescale_and_scratch: list[dict[str, Any]],
) -> None:
    """Follows ``tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py::
    TestReduceScatterWithFP32Accumulation::test_power_of_two_prescale_equals_scaling_the_fp32_sum``.

    Upstream checks the arithmetic locally (no collective): pre-scaling bf16 grads by 1/2**k
    and summing in fp32 equals scaling the fp32 sum. Held here through the function itself,
    for axis sizes 4 (the world) and 2 (a data-parallel pair): a SUM of inputs pre-scaled by
    1/size equals the AVG of the raw inputs bit for bit, and both equal the one-process
    ``(Σ fp32) · 1/size`` rounded to bf16. Sizes 8 and 16 would need more ranks.
    """
    for out in prescale_and_scratch:
        assert (out["world"]["size"], out["pair"]["size"]) == (4, 2)
        for name in ("world", "pair"):
            assert out[name]["avg_vs_prescaled"] == 0, name
            assert out[name]["avg_vs_local"] == 0, name


def test_caller_provided_all_to_all_output_tensor(
    prescale_and_scratch: list[dict[str, Any]],
) -> None:
    """Follows ``tests/unit_tests/distributed/test_reduce_scatter_with_fp32_accumulation.py::
    TestReduceScatterWithFP32Accumulation::test_caller_provided_all_to_all_output_tensor``.

    Same facts, under Megatron's keyword ``all_to_all_output_tensor=``: a caller-supplied
    all-to-all receive buffer gives the same shard bit for bit as the internal one (one
    collective), and one that is ``world`` elements short is refused with an
    ``AssertionError`` before any collective starts (none recorded), so no peer waits.
    """
    for out in prescale_and_scratch:
        scratch = out["scratch"]
        assert (scratch["equal"], scratch["ops"], scratch["refused_ops"]) == (True, 1, 0)
        assert scratch["refused"].startswith(
            "all_to_all_output_tensor of shape (99996,) and dtype torch.bfloat16 must match "
            "input_tensor's shape (100000,)"
        )
