"""mc-groups' bad-input catalogue: every case a TypeError/ValueError naming the argument and
its value, raised before any collective.

One table (``CASES``) lists each bad call of the package's public surface: collectives
(shapes, dtypes, devices, contiguity, groups, ranks, receive buffers, batch kinds, the
communicator's lists), the schedule-check switch, layout sizes and
``initialize_model_parallel``, the ``ProcessGroupCollection``, the rank generator,
``ModelParallelConfig`` and the test harness's ``RankPool``. Every case runs on each rank
of a 2-rank gloo world inside ``record_collectives()``; the test asserts the exception
type, that each listed fragment (the argument with its value, and the fix where there is
one) is in the message, and that the recorder stayed empty. ``docs/bad_inputs.md`` lists
the same cases.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any, NamedTuple

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import argcheck, device, dtensors
from mc_groups.collection import set_default_collection
from mc_groups.comm.collectives import all_reduce_flat
from mc_groups.comm.communicator import Communicator
from mc_groups.pipeline_stages import pipeline_rank
from mc_groups.rank_generator import RankGenerator
from mc_groups.testing import RankPool, RankPools, error_kind


def Loose(value: object) -> Any:  # noqa: N802 (reads as a cast)
    """``value`` typed as anything: lets wrong types reach the checks."""
    return value


class Case(NamedTuple):
    """``call(world_group, rank)`` must raise ``error`` with every fragment of ``words``,
    after issuing ``issued`` collectives (0 but for a batch whose valid first collective
    went out on gloo before the odd second one was refused). With ``setup``, its result
    (made outside the recorder: e.g. a collection already destroyed) replaces the world
    group as ``call``'s first argument. ``doc_call`` and ``doc_input`` are the catalogue's
    "call" and "bad input" cells (markdown), read by ``scripts/gen_bad_inputs.py``."""

    call: Callable[[Any, int], object]
    error: str
    words: tuple[str, ...]
    doc_call: str
    doc_input: str
    issued: int = 0
    setup: Callable[[], object] | None = None


def _batch_mixing_kinds(g: dist.ProcessGroup) -> None:
    with mg.coalesced(g) as batch:
        batch.all_reduce(torch.zeros(2))
        batch.all_gather(torch.zeros(4), torch.zeros(2))


def _bad_switch(g: dist.ProcessGroup) -> None:
    os.environ["MC_CHECK_COLLECTIVE_SCHEDULE"] = "maybe"
    try:
        mg.all_reduce(torch.ones(2), g)
    finally:
        del os.environ["MC_CHECK_COLLECTIVE_SCHEDULE"]


def _enter(manager: Any) -> None:
    with manager:
        pass


def _one_rank_group() -> dist.ProcessGroup:
    """This rank alone as a group (every rank creates every rank's group, in order)."""
    mine: dist.ProcessGroup | None = None
    for r in range(dist.get_world_size()):
        group: dist.ProcessGroup = dist.new_group([r])
        if r == dist.get_rank():
            mine = group
    assert mine is not None
    return mine


def _one_rank_switch(g: dist.ProcessGroup) -> None:
    os.environ["MC_CHECK_COLLECTIVE_SCHEDULE"] = "maybe"
    try:
        mg.all_reduce(torch.ones(2), g)
    finally:
        del os.environ["MC_CHECK_COLLECTIVE_SCHEDULE"]


def _batch_after_block(g: dist.ProcessGroup) -> None:
    with mg.coalesced(g) as batch:
        batch.all_reduce(torch.zeros(2))
    batch.all_reduce(torch.zeros(2))


def _destroyed() -> mg.ProcessGroupCollection:
    pgc = mg.initialize_model_parallel()
    mg.destroy_model_parallel(pgc)
    return pgc


_F32, _BF16 = torch.float32, torch.bfloat16
_RG: dict[str, Any] = {"tp": 1, "ep": 1, "dp": 1, "pp": 1, "cp": 1}

CASES: dict[str, Case] = {
    # -- collectives: shapes, types, dtypes, devices ------------------------------------
    "reduce_scatter numel": Case(
        lambda g, r: mg.reduce_scatter(torch.zeros(3), torch.zeros(8), g),
        "ValueError",
        ("input.numel()=8", "output.numel()=3", "group size 2"),
        doc_call="`reduce_scatter(out, inp, group)`",
        doc_input="input of 8 for an output of 3 on 2 ranks",
    ),
    "all_gather numel": Case(
        lambda g, r: mg.all_gather(torch.zeros(5), torch.zeros(2), g),
        "ValueError",
        ("output.numel()=5", "input.numel()=2", "group size 2"),
        doc_call="`all_gather(out, inp, group)`",
        doc_input="output of 5 for an input of 2 on 2 ranks",
    ),
    "not contiguous": Case(
        lambda g, r: mg.all_reduce(torch.zeros(4, 4).t(), g),
        "ValueError",
        ("tensor (shape (4, 4)) must be contiguous", ".contiguous()"),
        doc_call="`all_reduce(t, group)`",
        doc_input="a transposed (non-contiguous) tensor",
    ),
    "not a tensor": Case(
        lambda g, r: mg.all_reduce(Loose([1.0]), g),
        "TypeError",
        ("tensor must be a torch.Tensor, got list",),
        doc_call="`all_reduce(t, group)`",
        doc_input="a list instead of a tensor",
    ),
    "reduce op": Case(
        lambda g, r: mg.all_reduce(torch.zeros(2), g, op=Loose("sum")),
        "TypeError",
        ("op='sum'", "mc_groups.ReduceOp"),
        doc_call="`all_reduce(..., op=)`",
        doc_input="`op='sum'` (a string)",
    ),
    "flat not a list": Case(
        lambda g, r: all_reduce_flat(Loose(torch.zeros(2)), g),
        "TypeError",
        ("tensors must be a list of tensors, got torch.Tensor",),
        doc_call="`comm.collectives.all_reduce_flat(tensors, group)`",
        doc_input="a tensor, not a list (its rows would be iterated)",
    ),
    "flat element": Case(
        lambda g, r: all_reduce_flat([torch.zeros(2), Loose("b")], g),
        "TypeError",
        ("tensors[1] is a str, not a torch.Tensor",),
        doc_call="`comm.collectives.all_reduce_flat(tensors, group)`",
        doc_input="`[tensor, 'b']`",
    ),
    "group None": Case(
        lambda g, r: mg.all_reduce(torch.zeros(2), Loose(None)),
        "TypeError",
        ("group=None", "ProcessGroup"),
        doc_call="`all_reduce(t, group)`",
        doc_input="`group=None`",
    ),
    "dtype pair": Case(
        lambda g, r: mg.reduce_scatter(torch.zeros(2, dtype=_BF16), torch.zeros(4), g),
        "ValueError",
        ("output dtype torch.bfloat16 differs from input dtype torch.float32",),
        doc_call="`reduce_scatter`",
        doc_input="bf16 output, fp32 input",
    ),
    "device pair": Case(
        lambda g, r: mg.all_gather(torch.zeros(4, device="meta"), torch.zeros(2), g),
        "ValueError",
        ("output device meta differs from input cpu",),
        doc_call="`all_gather`",
        doc_input="output on `meta`, input on cpu",
    ),
    "received size": Case(
        lambda g, r: mg.reduce_scatter(torch.zeros(2), torch.zeros(4), g, received=torch.zeros(3)),
        "ValueError",
        ("received=3 × float32 on cpu", "4 × float32 on cpu"),
        doc_call="`reduce_scatter(..., received=)`",
        doc_input="receive buffer of the wrong size",
    ),
    "accumulate dtype": Case(
        lambda g, r: mg.reduce_scatter(
            torch.zeros(2), torch.zeros(4), g, accumulate_dtype=Loose(torch.int64)
        ),
        "TypeError",
        ("accumulate_dtype=torch.int64", "floating-point"),
        doc_call="`reduce_scatter(..., accumulate_dtype=)`",
        doc_input="`torch.int64`",
    ),
    "communicator pair size": Case(
        lambda g, r: Communicator(g).reduce_scatter(
            [(torch.zeros(2), torch.zeros(4)), (torch.zeros(3), torch.zeros(4))]
        ),
        "ValueError",
        ("pairs[1]: reduce_scatter: input.numel()=4", "output.numel()=3", "group size 2"),
        doc_call="`Communicator(group).reduce_scatter(pairs)`",
        doc_input="second pair's output of 3 for an input of 4 (nothing issued for the first)",
    ),
    "communicator pairs": Case(
        lambda g, r: Communicator(g).all_gather(Loose(torch.zeros(4))),
        "TypeError",
        ("pairs=tensor", "must be a list"),
        doc_call="`Communicator(group).all_gather(pairs)`",
        doc_input="a tensor instead of a list of (output, input) pairs",
    ),
    # -- collectives: ranks, splits, batches ---------------------------------------------
    "broadcast source": Case(
        lambda g, r: mg.broadcast(torch.zeros(2), g, group_src=5),
        "ValueError",
        ("group_src=5", "[0, 2)"),
        doc_call="`broadcast(..., group_src=)`",
        doc_input="group rank 5 in a group of 2",
    ),
    "send to self": Case(
        lambda g, r: mg.send(torch.zeros(2), g, group_dst=r),
        "ValueError",
        ("group_dst=", "must be another group rank in [0, 2)"),
        doc_call="`send(..., group_dst=)`",
        doc_input="this rank's own group rank",
    ),
    "recv bool": Case(
        lambda g, r: mg.recv(torch.zeros(2), g, group_src=Loose(True)),
        "TypeError",
        ("group_src=True", "must be an int"),
        doc_call="`recv(..., group_src=)`",
        doc_input="`True` (a bool)",
    ),
    "all_to_all splits": Case(
        lambda g, r: mg.all_to_all(torch.zeros(4), torch.zeros(4), g, input_split_sizes=[4]),
        "ValueError",
        ("input_split_sizes=[4] must have 2 entries",),
        doc_call="`all_to_all(..., input_split_sizes=)`",
        doc_input="1 split for 2 ranks",
    ),
    "batch kinds": Case(
        lambda g, r: _batch_mixing_kinds(g),
        "ValueError",
        ("already holds all_reduce(sum); cannot add all_gather", "open a second batch"),
        issued=1,
        doc_call="`coalesced(group)` batch",
        doc_input=(
            "an all-gather added to an all-reduce batch (the first, valid all-reduce was "
            "issued; the odd one is refused)"
        ),
    ),
    "batch group": Case(
        lambda g, r: _enter(mg.coalesced(Loose("world"))),
        "TypeError",
        ("group='world'",),
        doc_call="`coalesced(group)`",
        doc_input="`group='world'`",
    ),
    "barrier group": Case(
        lambda g, r: mg.barrier(Loose(0)),
        "TypeError",
        ("group=0",),
        doc_call="`barrier(group)`",
        doc_input="`group=0`",
    ),
    # -- schedule check switch -----------------------------------------------------------
    "switch value": Case(
        lambda g, r: _bad_switch(g),
        "ValueError",
        ("MC_CHECK_COLLECTIVE_SCHEDULE='maybe' is not a switch", "1/true/yes/on"),
        doc_call="any collective",
        doc_input="`MC_CHECK_COLLECTIVE_SCHEDULE=maybe`",
    ),
    "switch type": Case(
        lambda g, r: _enter(mg.check_collective_schedule(Loose("yes"))),
        "TypeError",
        ("enabled='yes' must be a bool",),
        doc_call="`check_collective_schedule(enabled)`",
        doc_input="`enabled='yes'`",
    ),
    # -- cross_check (issue 38) --------------------------------------------------------------
    "cross_check value": Case(
        lambda g, r: mg.cross_check(g, "sizes", {"hidden": 8, "weight": Loose(torch.zeros(2))}),
        "TypeError",
        ("fields['weight']=tensor([0., 0.])", "pass its text instead"),
        doc_call="`cross_check(group, where, fields)`",
        doc_input="a tensor as a field's value",
    ),
    "cross_check fields": Case(
        lambda g, r: mg.cross_check(g, "sizes", Loose([("hidden", 8)])),
        "TypeError",
        ("fields must be a mapping of names to values, got list",),
        doc_call="`cross_check(group, where, fields)`",
        doc_input="a list of pairs instead of a mapping",
    ),
    # -- layout sizes and initialize_model_parallel --------------------------------------
    "tp on world": Case(
        lambda g, r: mg.initialize_model_parallel(tensor_model_parallel_size=3),
        "ValueError",
        ("tensor_model_parallel_size=3 exceeds the world size 2",),
        doc_call="`initialize_model_parallel` (2 ranks)",
        doc_input="`tensor_model_parallel_size=3`",
    ),
    "tp type": Case(
        lambda g, r: mg.initialize_model_parallel(tensor_model_parallel_size=Loose(2.0)),
        "TypeError",
        ("tensor_model_parallel_size=2.0 must be an int",),
        doc_call="`initialize_model_parallel`",
        doc_input="`tensor_model_parallel_size=2.0`",
    ),
    "tp zero": Case(
        lambda g, r: mg.validate_sizes(8, tensor_model_parallel_size=0),
        "ValueError",
        ("tensor_model_parallel_size=0 must be >= 1",),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="`tensor_model_parallel_size=0`",
    ),
    "tp world 8": Case(
        lambda g, r: mg.validate_sizes(8, tensor_model_parallel_size=3),
        "ValueError",
        ("world size 8", "tp=3"),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="`tensor_model_parallel_size=3`",
    ),
    "ep": Case(
        lambda g, r: mg.validate_sizes(8, expert_model_parallel_size=3),
        "ValueError",
        ("ep=3", "expert data-parallel"),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="`expert_model_parallel_size=3`",
    ),
    "vpp without pp": Case(
        lambda g, r: mg.validate_sizes(8, virtual_pipeline_model_parallel_size=2),
        "ValueError",
        ("virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size > 1 (got 1)"),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="virtual pipeline size 2 with one stage",
    ),
    "instances": Case(
        lambda g, r: mg.validate_sizes(8, num_distributed_optimizer_instances=3),
        "ValueError",
        ("num_distributed_optimizer_instances=3", "8"),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="3 optimizer instances",
    ),
    "gtp with instances": Case(
        lambda g, r: mg.validate_sizes(8, gtp_remat_size=2, num_distributed_optimizer_instances=2),
        "ValueError",
        ("gtp_remat_size=2", "num_distributed_optimizer_instances=2"),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="`gtp_remat_size=2` with 2 optimizer instances",
    ),
    # -- ProcessGroupCollection ----------------------------------------------------------
    "collection name": Case(
        lambda g, r: mg.ProcessGroupCollection(tensor=g),
        "ValueError",
        ("unknown group name(s) ['tensor']", "known names are"),
        doc_call="`ProcessGroupCollection(...)`",
        doc_input="unknown field `tensor=`",
    ),
    "collection set": Case(
        lambda g, r: setattr(mg.ProcessGroupCollection(), "foo", None),
        "ValueError",
        ("no group named 'foo'",),
        doc_call="`pgc.foo = ...`",
        doc_input="unknown field on assignment",
    ),
    "collection type": Case(
        lambda g, r: mg.ProcessGroupCollection(tp=Loose(3)),
        "TypeError",
        ("ProcessGroupCollection.tp=3 must be a torch.distributed.ProcessGroup or None",),
        doc_call="`ProcessGroupCollection(tp=)`",
        doc_input="`tp=3`",
    ),
    "collection require": Case(
        lambda g, r: mg.ProcessGroupCollection().require("tp", "step 4"),
        "MissingGroupError",
        ("step 4 needs pg_collection.tp", "initialize_model_parallel()"),
        doc_call="`pgc.require('tp', 'step 4')`",
        doc_input="a collection without `tp`",
    ),
    "collection field": Case(
        lambda g, r: mg.ProcessGroupCollection().require("nope", "x"),
        "ValueError",
        ("name='nope' is not a ProcessGroupCollection field",),
        doc_call="`pgc.require(name, ...)`",
        doc_input="`name='nope'`",
    ),
    "default collection": Case(
        lambda g, r: set_default_collection(Loose("tp")),
        "TypeError",
        ("collection='tp' must be a ProcessGroupCollection",),
        doc_call="`set_default_collection(c)`",
        doc_input="`c='tp'`",
    ),
    # -- RankGenerator -------------------------------------------------------------------
    "generator ep with cp": Case(
        lambda g, r: RankGenerator(**{**_RG, "ep": 2, "cp": 2}),
        "ValueError",
        ("ep=2", "cp=2"),
        doc_call="`RankGenerator(...)`",
        doc_input="`ep=2` and `cp=2` together",
    ),
    "generator order misses": Case(
        lambda g, r: RankGenerator(**{**_RG, "tp": 2, "dp": 2}, order="dp-pp"),
        "ValueError",
        ("'tp'", "size 2"),
        doc_call="`RankGenerator(..., order=)`",
        doc_input="order without `tp` while `tp=2`",
    ),
    "generator zero": Case(
        lambda g, r: RankGenerator(**{**_RG, "tp": 0}),
        "ValueError",
        ("tp=0",),
        doc_call="`RankGenerator(tp=)`",
        doc_input="`tp=0`",
    ),
    "generator bool": Case(
        lambda g, r: RankGenerator(**{**_RG, "tp": True}),
        "TypeError",
        ("tp=True",),
        doc_call="`RankGenerator(tp=)`",
        doc_input="`tp=True`",
    ),
    "generator token": Case(
        lambda g, r: RankGenerator(**_RG, order="tp-xx"),
        "ValueError",
        ("'tp-xx'",),
        doc_call="`RankGenerator(order=)`",
        doc_input="`order='tp-xx'`",
    ),
    "generator repeat": Case(
        lambda g, r: RankGenerator(**_RG, order="tp-tp"),
        "ValueError",
        ("'tp-tp'",),
        doc_call="`RankGenerator(order=)`",
        doc_input="`order='tp-tp'`",
    ),
    "generator offset": Case(
        lambda g, r: RankGenerator(**_RG, rank_offset=-1),
        "ValueError",
        ("rank_offset=-1",),
        doc_call="`RankGenerator(rank_offset=)`",
        doc_input="`rank_offset=-1`",
    ),
    "generator query": Case(
        lambda g, r: RankGenerator(**{**_RG, "tp": 2}).get_ranks("tp-zz"),
        "ValueError",
        ("token='tp-zz'",),
        doc_call="`gen.get_ranks(token)`",
        doc_input="`token='tp-zz'`",
    ),
    # -- ModelParallelConfig -------------------------------------------------------------
    "config tp zero": Case(
        lambda g, r: mg.ModelParallelConfig(tensor_model_parallel_size=0),
        "ValueError",
        ("tensor_model_parallel_size=0",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`tensor_model_parallel_size=0`",
    ),
    "config tp float": Case(
        lambda g, r: mg.ModelParallelConfig(tensor_model_parallel_size=Loose(2.0)),
        "TypeError",
        ("tensor_model_parallel_size=2.0",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`tensor_model_parallel_size=2.0`",
    ),
    "config sp int": Case(
        lambda g, r: mg.ModelParallelConfig(sequence_parallel=Loose(1)),
        "TypeError",
        ("sequence_parallel=1",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`sequence_parallel=1`",
    ),
    "config sp without tp": Case(
        lambda g, r: mg.ModelParallelConfig(sequence_parallel=True),
        "ValueError",
        ("sequence_parallel", "tensor_model_parallel"),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`sequence_parallel=True` at TP 1",
    ),
    "config fp16 and bf16": Case(
        lambda g, r: mg.ModelParallelConfig(fp16=True, bf16=True),
        "ValueError",
        ("fp16", "bf16"),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`fp16=True, bf16=True`",
    ),
    "config dtype": Case(
        lambda g, r: mg.ModelParallelConfig(params_dtype=Loose("float32")),
        "TypeError",
        ("params_dtype='float32'",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`params_dtype='float32'`",
    ),
    "config deferral": Case(
        lambda g, r: mg.ModelParallelConfig(wgrad_deferral_limit=-1),
        "ValueError",
        ("wgrad_deferral_limit=-1",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`wgrad_deferral_limit=-1`",
    ),
    "config vpp": Case(
        lambda g, r: mg.ModelParallelConfig(virtual_pipeline_model_parallel_size=2),
        "ValueError",
        ("virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size"),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="virtual pipeline size without pipeline",
    ),
    "config tp overlap": Case(
        lambda g, r: mg.ModelParallelConfig(tp_comm_overlap=True),
        "ValueError",
        ("tp_comm_overlap",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`tp_comm_overlap=True` (Transformer Engine only)",
    ),
    "config gtp bool": Case(
        lambda g, r: mg.ModelParallelConfig(gtp_remat_size=Loose(True)),
        "TypeError",
        ("gtp_remat_size=True",),
        doc_call="`ModelParallelConfig(...)`",
        doc_input="`gtp_remat_size=True`",
    ),
    "config replace": Case(
        lambda g, r: mg.ModelParallelConfig().replace(nonsense=1),
        "ValueError",
        ("no field",),
        doc_call="`config.replace(...)`",
        doc_input="unknown field `nonsense=`",
    ),
    # -- issue 16: flags, texts and ranks are typed; one-rank groups are judged the same ----
    "async_op flag": Case(
        lambda g, r: mg.all_reduce(torch.zeros(2), g, async_op=Loose("no")),
        "TypeError",
        ("async_op='no' must be a bool",),
        doc_call="`all_reduce(..., async_op=)`",
        doc_input="`'no'` (truthy, not a bool)",
    ),
    "label type": Case(
        lambda g, r: mg.all_gather(torch.zeros(4), torch.zeros(2), g, label=Loose(3)),
        "TypeError",
        ("label=3 must be a str",),
        doc_call="`all_gather(..., label=)`",
        doc_input="`3`",
    ),
    "broadcast source type": Case(
        lambda g, r: mg.broadcast(torch.zeros(2), g, group_src=Loose(0.0)),
        "TypeError",
        ("group_src=0.0 must be an int",),
        doc_call="`broadcast(..., group_src=)`",
        doc_input="`0.0`",
    ),
    "all_to_all numel": Case(
        lambda g, r: mg.all_to_all(torch.zeros(8), torch.zeros(4), g),
        "ValueError",
        ("output.numel()=8", "input.numel()=4"),
        doc_call="`all_to_all(out, inp, group)`",
        doc_input="output of 8 for an input of 4, no split sizes",
    ),
    "all_to_all split type": Case(
        lambda g, r: mg.all_to_all(torch.zeros(4), torch.zeros(4), g, input_split_sizes=Loose(4)),
        "TypeError",
        ("input_split_sizes=4 must be a list of 2 ints",),
        doc_call="`all_to_all(..., input_split_sizes=)`",
        doc_input="`4` (an int)",
    ),
    "all_to_all split sum": Case(
        lambda g, r: mg.all_to_all(torch.zeros(4), torch.zeros(4), g, input_split_sizes=[1, 5]),
        "ValueError",
        ("input_split_sizes=[1, 5]", "adding up to the 4 rows"),
        doc_call="`all_to_all(..., input_split_sizes=)`",
        doc_input="splits adding up to 6 for 4 rows",
    ),
    "coalesced device": Case(
        lambda g, r: _enter(mg.coalesced(g, device=Loose("nope"))),
        "ValueError",
        ("device='nope' is not a device",),
        doc_call="`coalesced(group, device=)`",
        doc_input="`'nope'`",
    ),
    "group query": Case(
        lambda g, r: mg.group_size(Loose(None)),
        "TypeError",
        ("group=None", "ProcessGroup"),
        doc_call="`group_size(group)`",
        doc_input="`None`",
    ),
    "switch at one rank": Case(
        lambda g, r: _one_rank_switch(g),
        "ValueError",
        ("MC_CHECK_COLLECTIVE_SCHEDULE='maybe' is not a switch",),
        setup=_one_rank_group,
        doc_call="any collective on a one-rank group",
        doc_input="`MC_CHECK_COLLECTIVE_SCHEDULE=maybe` (refused at every group size)",
    ),
    "received at one rank": Case(
        lambda g, r: mg.reduce_scatter(torch.zeros(4), torch.zeros(4), g, received=torch.zeros(3)),
        "ValueError",
        ("received=3 × float32 on cpu", "4 × float32 on cpu"),
        setup=_one_rank_group,
        doc_call="`reduce_scatter(..., received=)` on a one-rank group",
        doc_input="receive buffer of the wrong size (refused at every group size)",
    ),
    "handle timeout": Case(
        lambda g, r: mg.all_reduce(torch.zeros(2), g, async_op=True).wait(timeout=math.nan),
        "ValueError",
        ("timeout=nan must be finite",),
        setup=_one_rank_group,
        doc_call="`handle.wait(timeout=)`",
        doc_input="`nan`",
    ),
    "batch closed": Case(
        lambda g, r: _batch_after_block(g),
        "RuntimeError",
        ("was closed when its with block ended", "open a new batch"),
        issued=1,
        doc_call="`coalesced(group)` batch",
        doc_input="a collective added after the `with` block (the block's own one was issued)",
    ),
    # -- issue 16: layouts, destroy, the generator ------------------------------------------
    "world size zero": Case(
        lambda g, r: mg.validate_sizes(0),
        "ValueError",
        ("world_size=0 must be >= 1",),
        doc_call="`validate_sizes(world_size)`",
        doc_input="`0`",
    ),
    "size beyond world": Case(
        lambda g, r: mg.validate_sizes(8, tensor_model_parallel_size=2**40),
        "ValueError",
        ("tensor_model_parallel_size=1099511627776 exceeds the world size 8",),
        doc_call="`validate_sizes(8, ...)`",
        doc_input="`tensor_model_parallel_size=2**40`",
    ),
    "init timeout": Case(
        lambda g, r: mg.initialize_model_parallel(timeout=Loose(10)),
        "TypeError",
        ("timeout=10 must be a datetime.timedelta",),
        doc_call="`initialize_model_parallel(timeout=)`",
        doc_input="`10` (seconds as an int)",
    ),
    "init negative timeout": Case(
        lambda g, r: mg.initialize_model_parallel(timeout=timedelta(seconds=-1)),
        "ValueError",
        ("timeout=", "must be positive"),
        doc_call="`initialize_model_parallel(timeout=)`",
        doc_input="`timedelta(seconds=-1)`",
    ),
    "init set_default": Case(
        lambda g, r: mg.initialize_model_parallel(set_default=Loose("no")),
        "TypeError",
        ("set_default='no' must be a bool",),
        doc_call="`initialize_model_parallel(set_default=)`",
        doc_input="`'no'`",
    ),
    "init empty order": Case(
        lambda g, r: mg.initialize_model_parallel(order=""),
        "ValueError",
        ("order='' names no axis",),
        doc_call="`initialize_model_parallel(order=)`",
        doc_input="`''`",
    ),
    "destroy dict": Case(
        lambda g, r: mg.destroy_model_parallel(Loose({"tp": None})),
        "TypeError",
        ("collection={'tp': None} must be the ProcessGroupCollection",),
        doc_call="`destroy_model_parallel(collection)`",
        doc_input="`{'tp': None}` (would have destroyed the world group)",
    ),
    "destroy None": Case(
        lambda g, r: mg.destroy_model_parallel(Loose(None)),
        "TypeError",
        ("collection=None must be the ProcessGroupCollection",),
        doc_call="`destroy_model_parallel(collection)`",
        doc_input="`None` (refused before the world barrier)",
    ),
    "destroy twice": Case(
        lambda pgc, r: mg.destroy_model_parallel(pgc),
        "RuntimeError",
        ("already destroyed", "once per initialize_model_parallel()"),
        setup=_destroyed,
        doc_call="`destroy_model_parallel(collection)`",
        doc_input="a second call (refused before the world barrier)",
    ),
    "destroyed group": Case(
        lambda pgc, r: mg.all_reduce(torch.zeros(2), pgc.dp),
        "RuntimeError",
        ("group (a process group of 2 rank(s)) was destroyed",),
        setup=_destroyed,
        doc_call="`all_reduce(t, pgc.dp)`",
        doc_input="a group of a destroyed collection",
    ),
    "destroyed collection": Case(
        lambda pgc, r: pgc.require("dp", "a step"),
        "RuntimeError",
        ("a step needs pg_collection.dp", "destroyed by destroy_model_parallel()"),
        setup=_destroyed,
        doc_call="`pgc.require('dp', ...)`",
        doc_input="a destroyed collection",
    ),
    "destroyed default": Case(
        lambda pgc, r: set_default_collection(pgc),
        "RuntimeError",
        ("destroyed by destroy_model_parallel()",),
        setup=_destroyed,
        doc_call="`set_default_collection(c)`",
        doc_input="a destroyed collection",
    ),
    "require name type": Case(
        lambda g, r: mg.ProcessGroupCollection().require(Loose(3), "a step"),
        "TypeError",
        ("name=3 must be a str",),
        doc_call="`pgc.require(name, ...)`",
        doc_input="`name=3`",
    ),
    "generator absurd": Case(
        lambda g, r: RankGenerator(**{**_RG, "tp": 2**40}),
        "ValueError",
        ("tp=1099511627776", "exceeds MAX_WORLD_SIZE=1048576"),
        doc_call="`RankGenerator(tp=)`",
        doc_input="`2**40` (refused before anything is allocated)",
    ),
    "generator expert flag": Case(
        lambda g, r: RankGenerator(**_RG, is_expert=Loose("no")),
        "TypeError",
        ("is_expert='no' must be a bool",),
        doc_call="`RankGenerator(is_expert=)`",
        doc_input="`'no'`",
    ),
    "generator token type": Case(
        lambda g, r: RankGenerator(**_RG).get_ranks(Loose(3)),
        "TypeError",
        ("token=3 must be a str",),
        doc_call="`gen.get_ranks(token)`",
        doc_input="`3`",
    ),
    # -- issue 16: config, pipeline helpers, devices, argcheck -------------------------------
    "config integer dtype": Case(
        lambda g, r: mg.ModelParallelConfig(params_dtype=torch.int64),
        "TypeError",
        ("params_dtype=torch.int64 must be a floating-point dtype",),
        doc_call="`ModelParallelConfig(params_dtype=)`",
        doc_input="`torch.int64`",
    ),
    "pipeline collection": Case(
        lambda g, r: pipeline_rank(Loose(None)),
        "TypeError",
        ("pipeline_rank: pg_collection=None must be a ProcessGroupCollection",),
        doc_call="`pipeline_rank(pg_collection)`",
        doc_input="`None`",
    ),
    "virtual stage type": Case(
        lambda g, r: mg.is_pipeline_first_stage(
            mg.ProcessGroupCollection(), vp_stage=Loose("0"), vp_size=2
        ),
        "TypeError",
        ("vp_stage='0' must be an int",),
        doc_call="`is_pipeline_first_stage(..., vp_stage=)`",
        doc_input="`'0'`",
    ),
    "stream type": Case(
        lambda g, r: _enter(device.stream_scope(Loose("x"))),
        "TypeError",
        ("stream='x' must be a torch.cuda.Stream or a NullStream",),
        doc_call="`device.stream_scope(stream)`",
        doc_input="`'x'`",
    ),
    "device string": Case(
        lambda g, r: device.synchronize(Loose("nope")),
        "ValueError",
        ("device='nope' is not a device",),
        doc_call="`device.synchronize(device)`",
        doc_input="`'nope'`",
    ),
    "check bound": Case(
        lambda g, r: argcheck.check_int("n", 3, minimum=Loose("1")),
        "TypeError",
        ("minimum='1' must be an int",),
        doc_call="`argcheck.check_int(..., minimum=)`",
        doc_input="`'1'`",
    ),
    "check flag of a check": Case(
        lambda g, r: argcheck.check_real("x", 1.0, positive=Loose("no")),
        "TypeError",
        ("positive='no' must be a bool",),
        doc_call="`argcheck.check_real(..., positive=)`",
        doc_input="`'no'`",
    ),
    # -- the test harness ------------------------------------------------------------------
    "pool size": Case(
        lambda g, r: RankPool(0),
        "ValueError",
        ("world_size=0 must be >= 1",),
        doc_call="`RankPool(world_size)`",
        doc_input="`world_size=0`",
    ),
    "pool backend": Case(
        lambda g, r: RankPool(2, backend="mpi"),
        "ValueError",
        ("backend='mpi' must be one of",),
        doc_call="`RankPool(..., backend=)`",
        doc_input="`backend='mpi'`",
    ),
    "pool timeout": Case(
        lambda g, r: RankPool(2, pg_timeout_s=0),
        "ValueError",
        ("pg_timeout_s=0 must be > 0",),
        doc_call="`RankPool(..., pg_timeout_s=)`",
        doc_input="`pg_timeout_s=0`",
    ),
    "pool preload": Case(
        lambda g, r: RankPool(2, preload="transformers"),
        "TypeError",
        ("preload='transformers' must be a list or tuple of module names",),
        doc_call="`RankPool(..., preload=)`",
        doc_input="`preload='transformers'`",
    ),
    "pools preload": Case(
        lambda g, r: RankPools(preload="transformers"),
        "TypeError",
        ("preload='transformers' must be a list or tuple of module names",),
        doc_call="`RankPools(preload=)`",
        doc_input="`preload='transformers'`",
    ),
    "pool deadline": Case(
        lambda g, r: RankPool(2).run_with_deadline(-1.0, Loose(_batch_after_block)),
        "ValueError",
        ("deadline_s=-1.0 must be > 0",),
        doc_call="`pool.run_with_deadline(deadline_s, fn)`",
        doc_input="`-1.0` (refused before any rank starts)",
    ),
    "pool argument": Case(
        lambda g, r: RankPool(2).run(_batch_after_block, Loose(lambda: 1)),
        "TypeError",
        ("must be picklable",),
        doc_call="`pool.run(fn, *args)`",
        doc_input="a lambda as an argument (refused before any rank starts)",
    ),
    "pool grace": Case(
        lambda g, r: RankPool(2, failure_grace_s=math.nan),
        "ValueError",
        ("failure_grace_s=nan must be finite",),
        doc_call="`RankPool(..., failure_grace_s=)`",
        doc_input="`nan`",
    ),
    "pool env": Case(
        lambda g, r: RankPool(2, env=Loose({"A": 1})),
        "TypeError",
        ("env={'A': 1} must be a dict of str to str",),
        doc_call="`RankPool(..., env=)`",
        doc_input="`{'A': 1}`",
    ),
    "reshard_fsdp module": Case(
        lambda g, r: dtensors.reshard_fsdp(Loose("model")),
        "TypeError",
        ("module must be a torch.nn.Module", "got str"),
        doc_call="`dtensors.reshard_fsdp(module)`",
        doc_input="`'model'`",
    ),
}


def _run_cases() -> dict[str, tuple[str, str, int]]:
    g = dist.group.WORLD
    assert g is not None
    out: dict[str, tuple[str, str, int]] = {}
    for name, case in CASES.items():
        first: Any = g if case.setup is None else case.setup()
        with mg.record_collectives() as log:
            try:
                case.call(first, dist.get_rank())
                out[name] = ("no error", "", len(log))
            except (TypeError, ValueError, RuntimeError) as err:
                out[name] = (error_kind(err), str(err), len(log))
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
