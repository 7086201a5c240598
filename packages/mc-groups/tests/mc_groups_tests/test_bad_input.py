"""mc-groups' bad-input catalogue: every case a TypeError/ValueError naming the argument and
its value, raised before any collective.

One table (``CASES``) lists each bad call of the package's public surface: collectives
(shapes, dtypes, devices, contiguity, groups, ranks, staging buffers, batch kinds), the
schedule-check switch, layout sizes and ``initialize_model_parallel``, the
``ProcessGroupCollection``, the rank generator, ``ModelParallelConfig`` and the test
harness's ``RankPool``. Every case runs on each rank of a 2-rank gloo world inside
``record_collectives()``; the test asserts the exception type, that each listed fragment
(the argument with its value, and the fix where there is one) is in the message, and that
the recorder stayed empty. ``docs/bad_inputs.md`` lists the same cases.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.testing import RankPool, RankPools


def Loose(value: object) -> Any:  # noqa: N802 (reads as a cast)
    """``value`` typed as anything: lets wrong types reach the checks."""
    return value


class Case(NamedTuple):
    """``call(world_group, rank)`` must raise ``error`` with every fragment of ``words``,
    after issuing ``issued`` collectives (0 but for a batch whose valid first collective
    went out on gloo before the odd second one was refused)."""

    call: Callable[[dist.ProcessGroup, int], object]
    error: str
    words: tuple[str, ...]
    issued: int = 0


def _batch_mixing_kinds(g: dist.ProcessGroup) -> None:
    with mg.coalesced(g) as batch:
        batch.all_reduce(torch.zeros(2))
        batch.all_gather(torch.zeros(4), torch.zeros(2))


def _bad_switch(g: dist.ProcessGroup) -> None:
    os.environ[mg.SCHEDULE_CHECK_ENV] = "maybe"
    try:
        mg.all_reduce(torch.ones(2), g)
    finally:
        del os.environ[mg.SCHEDULE_CHECK_ENV]


def _enter(manager: Any) -> None:
    with manager:
        pass


_F32, _BF16 = torch.float32, torch.bfloat16
_RG: dict[str, Any] = {"tp": 1, "ep": 1, "dp": 1, "pp": 1, "cp": 1}

CASES: dict[str, Case] = {
    # -- collectives: shapes, types, dtypes, devices ------------------------------------
    "reduce_scatter numel": Case(
        lambda g, r: mg.reduce_scatter(torch.zeros(3), torch.zeros(8), g),
        "ValueError",
        ("input.numel()=8", "output.numel()=3", "group size 2"),
    ),
    "all_gather numel": Case(
        lambda g, r: mg.all_gather(torch.zeros(5), torch.zeros(2), g),
        "ValueError",
        ("output.numel()=5", "input.numel()=2", "group size 2"),
    ),
    "not contiguous": Case(
        lambda g, r: mg.all_reduce(torch.zeros(4, 4).t(), g),
        "ValueError",
        ("tensor (shape (4, 4)) must be contiguous", ".contiguous()"),
    ),
    "not a tensor": Case(
        lambda g, r: mg.all_reduce(Loose([1.0]), g),
        "TypeError",
        ("tensor must be a torch.Tensor, got list",),
    ),
    "reduce op": Case(
        lambda g, r: mg.all_reduce(torch.zeros(2), g, op=Loose("sum")),
        "TypeError",
        ("op='sum'", "mc_groups.ReduceOp"),
    ),
    "group None": Case(
        lambda g, r: mg.all_reduce(torch.zeros(2), Loose(None)),
        "TypeError",
        ("group=None", "ProcessGroup"),
    ),
    "dtype pair": Case(
        lambda g, r: mg.reduce_scatter(torch.zeros(2, dtype=_BF16), torch.zeros(4), g),
        "ValueError",
        ("output dtype torch.bfloat16 differs from input dtype torch.float32",),
    ),
    "device pair": Case(
        lambda g, r: mg.all_gather(torch.zeros(4, device="meta"), torch.zeros(2), g),
        "ValueError",
        ("output device meta differs from input cpu",),
    ),
    "staging size": Case(
        lambda g, r: mg.all_gather(torch.zeros(4), torch.zeros(2), g, staging=torch.zeros(3)),
        "ValueError",
        ("staging=3 × float32 on cpu", "4 × float32 on cpu"),
    ),
    # -- collectives: ranks, splits, batches ---------------------------------------------
    "broadcast source": Case(
        lambda g, r: mg.broadcast(torch.zeros(2), g, group_src=5),
        "ValueError",
        ("group_src=5", "[0, 2)"),
    ),
    "send to self": Case(
        lambda g, r: mg.send(torch.zeros(2), g, group_dst=r),
        "ValueError",
        ("group_dst=", "must be another group rank in [0, 2)"),
    ),
    "recv bool": Case(
        lambda g, r: mg.recv(torch.zeros(2), g, group_src=Loose(True)),
        "ValueError",
        ("group_src=True",),
    ),
    "all_to_all splits": Case(
        lambda g, r: mg.all_to_all(torch.zeros(4), torch.zeros(4), g, input_split_sizes=[4]),
        "ValueError",
        ("input_split_sizes=[4] must have 2 entries",),
    ),
    "batch kinds": Case(
        lambda g, r: _batch_mixing_kinds(g),
        "ValueError",
        ("already holds all_reduce(sum); cannot add all_gather", "open a second batch"),
        issued=1,
    ),
    "batch group": Case(
        lambda g, r: _enter(mg.coalesced(Loose("world"))),
        "TypeError",
        ("group='world'",),
    ),
    "barrier group": Case(
        lambda g, r: mg.barrier(Loose(0)),
        "TypeError",
        ("group=0",),
    ),
    # -- schedule check switch -----------------------------------------------------------
    "switch value": Case(
        lambda g, r: _bad_switch(g),
        "ValueError",
        ("MC_CHECK_COLLECTIVE_SCHEDULE='maybe' is not a switch", "1/true/yes/on"),
    ),
    "switch type": Case(
        lambda g, r: _enter(mg.check_collective_schedule(Loose("yes"))),
        "TypeError",
        ("enabled='yes' must be a bool",),
    ),
    # -- layout sizes and initialize_model_parallel --------------------------------------
    "tp on world": Case(
        lambda g, r: mg.initialize_model_parallel(tensor_model_parallel_size=3),
        "ValueError",
        ("world size 2 is not divisible by tp=3",),
    ),
    "tp type": Case(
        lambda g, r: mg.initialize_model_parallel(tensor_model_parallel_size=Loose(2.0)),
        "TypeError",
        ("tensor_model_parallel_size=2.0 must be an int",),
    ),
    "tp zero": Case(
        lambda g, r: mg.validate_sizes(8, tensor_model_parallel_size=0),
        "ValueError",
        ("tensor_model_parallel_size=0 must be >= 1",),
    ),
    "tp world 8": Case(
        lambda g, r: mg.validate_sizes(8, tensor_model_parallel_size=3),
        "ValueError",
        ("world size 8", "tp=3"),
    ),
    "ep": Case(
        lambda g, r: mg.validate_sizes(8, expert_model_parallel_size=3),
        "ValueError",
        ("ep=3", "expert data-parallel"),
    ),
    "vpp without pp": Case(
        lambda g, r: mg.validate_sizes(8, virtual_pipeline_model_parallel_size=2),
        "ValueError",
        ("virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size > 1 (got 1)"),
    ),
    "instances": Case(
        lambda g, r: mg.validate_sizes(8, num_distributed_optimizer_instances=3),
        "ValueError",
        ("num_distributed_optimizer_instances=3", "8"),
    ),
    "gtp with instances": Case(
        lambda g, r: mg.validate_sizes(8, gtp_remat_size=2, num_distributed_optimizer_instances=2),
        "ValueError",
        ("gtp_remat_size=2", "num_distributed_optimizer_instances=2"),
    ),
    # -- ProcessGroupCollection ----------------------------------------------------------
    "collection name": Case(
        lambda g, r: mg.ProcessGroupCollection(tensor=g),
        "ValueError",
        ("unknown group name(s) ['tensor']", "known names are"),
    ),
    "collection set": Case(
        lambda g, r: setattr(mg.ProcessGroupCollection(), "foo", None),
        "ValueError",
        ("no group named 'foo'",),
    ),
    "collection type": Case(
        lambda g, r: mg.ProcessGroupCollection(tp=Loose(3)),
        "TypeError",
        ("ProcessGroupCollection.tp=3 must be a torch.distributed.ProcessGroup or None",),
    ),
    "collection require": Case(
        lambda g, r: mg.ProcessGroupCollection().require("tp", "step 4"),
        "MissingGroupError",
        ("step 4 needs pg_collection.tp", "initialize_model_parallel()"),
    ),
    "collection field": Case(
        lambda g, r: mg.ProcessGroupCollection().require("nope", "x"),
        "ValueError",
        ("name='nope' is not a ProcessGroupCollection field",),
    ),
    "default collection": Case(
        lambda g, r: mg.set_default_collection(Loose("tp")),
        "TypeError",
        ("collection='tp' must be a ProcessGroupCollection",),
    ),
    # -- RankGenerator -------------------------------------------------------------------
    "generator ep with cp": Case(
        lambda g, r: mg.RankGenerator(**{**_RG, "ep": 2, "cp": 2}),
        "ValueError",
        ("ep=2", "cp=2"),
    ),
    "generator order misses": Case(
        lambda g, r: mg.RankGenerator(**{**_RG, "tp": 2, "dp": 2}, order="dp-pp"),
        "ValueError",
        ("'tp'", "size 2"),
    ),
    "generator zero": Case(
        lambda g, r: mg.RankGenerator(**{**_RG, "tp": 0}), "ValueError", ("tp=0",)
    ),
    "generator bool": Case(
        lambda g, r: mg.RankGenerator(**{**_RG, "tp": True}), "TypeError", ("tp=True",)
    ),
    "generator token": Case(
        lambda g, r: mg.RankGenerator(**_RG, order="tp-xx"), "ValueError", ("'tp-xx'",)
    ),
    "generator repeat": Case(
        lambda g, r: mg.RankGenerator(**_RG, order="tp-tp"), "ValueError", ("'tp-tp'",)
    ),
    "generator offset": Case(
        lambda g, r: mg.RankGenerator(**_RG, rank_offset=-1), "ValueError", ("rank_offset=-1",)
    ),
    "generator query": Case(
        lambda g, r: mg.RankGenerator(**{**_RG, "tp": 2}).get_ranks("tp-zz"),
        "ValueError",
        ("token='tp-zz'",),
    ),
    # -- ModelParallelConfig -------------------------------------------------------------
    "config tp zero": Case(
        lambda g, r: mg.ModelParallelConfig(tensor_model_parallel_size=0),
        "ValueError",
        ("tensor_model_parallel_size=0",),
    ),
    "config tp float": Case(
        lambda g, r: mg.ModelParallelConfig(tensor_model_parallel_size=Loose(2.0)),
        "TypeError",
        ("tensor_model_parallel_size=2.0",),
    ),
    "config sp int": Case(
        lambda g, r: mg.ModelParallelConfig(sequence_parallel=Loose(1)),
        "TypeError",
        ("sequence_parallel=1",),
    ),
    "config sp without tp": Case(
        lambda g, r: mg.ModelParallelConfig(sequence_parallel=True),
        "ValueError",
        ("sequence_parallel", "tensor_model_parallel"),
    ),
    "config fp16 and bf16": Case(
        lambda g, r: mg.ModelParallelConfig(fp16=True, bf16=True),
        "ValueError",
        ("fp16", "bf16"),
    ),
    "config dtype": Case(
        lambda g, r: mg.ModelParallelConfig(params_dtype=Loose("float32")),
        "TypeError",
        ("params_dtype='float32'",),
    ),
    "config deferral": Case(
        lambda g, r: mg.ModelParallelConfig(wgrad_deferral_limit=-1),
        "ValueError",
        ("wgrad_deferral_limit=-1",),
    ),
    "config vpp": Case(
        lambda g, r: mg.ModelParallelConfig(virtual_pipeline_model_parallel_size=2),
        "ValueError",
        ("virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size"),
    ),
    "config tp overlap": Case(
        lambda g, r: mg.ModelParallelConfig(tp_comm_overlap=True),
        "ValueError",
        ("tp_comm_overlap",),
    ),
    "config gtp bool": Case(
        lambda g, r: mg.ModelParallelConfig(gtp_remat_size=Loose(True)),
        "TypeError",
        ("gtp_remat_size=True",),
    ),
    "config replace": Case(
        lambda g, r: mg.ModelParallelConfig().replace(nonsense=1),
        "ValueError",
        ("no field",),
    ),
    # -- the test harness ------------------------------------------------------------------
    "pool size": Case(lambda g, r: RankPool(0), "ValueError", ("world_size=0 must be an int",)),
    "pool backend": Case(
        lambda g, r: RankPool(2, backend="mpi"), "ValueError", ("backend='mpi' must be one of",)
    ),
    "pool timeout": Case(
        lambda g, r: RankPool(2, pg_timeout_s=0), "ValueError", ("pg_timeout_s=0 must be > 0",)
    ),
}


def _run_cases() -> dict[str, tuple[str, str, int]]:
    g = dist.group.WORLD
    assert g is not None
    out: dict[str, tuple[str, str, int]] = {}
    for name, case in CASES.items():
        with mg.record_collectives() as log:
            try:
                case.call(g, dist.get_rank())
                out[name] = ("no error", "", len(log))
            except (TypeError, ValueError) as err:
                out[name] = (type(err).__name__, str(err), len(log))
    return out


@pytest.fixture(scope="module")
def outcomes(rank_pools: RankPools) -> list[dict[str, tuple[str, str, int]]]:
    return rank_pools.get(2).run(_run_cases)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_named_before_any_collective(
    outcomes: list[dict[str, tuple[str, str, int]]], name: str
) -> None:
    case = CASES[name]
    for out in outcomes:
        kind, message, issued = out[name]
        assert kind == case.error, message
        for word in case.words:
            assert word in message, (word, message)
        assert issued == case.issued
