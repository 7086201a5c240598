"""Conformance with Megatron-LM's ``tests/unit_tests/distributed/test_param_and_grad_buffer.py``:
the same facts held against mc-ddp on gloo (2 and 4 ranks).

Upstream wraps a bf16 ``TestModel`` (a stack of ``nn.Linear``, optionally with the last weight
marked ``shared_embedding``) in DDP on a GPU world and reads the buffers and bucket groups.
Here the same kind of model is wrapped in :class:`mc_ddp.DistributedDataParallel` over mc's
groups; each test asserts what its upstream counterpart asserts, against numbers derived in
this file from the rule the upstream test states (not from mc's layout code). Grad values are
1, 1/dp or 1/4 (binary fractions), so they are compared exactly.

Each rank function runs every case of one world size in one pool call; the tests below read
their part of the result (module-scoped fixtures), so the file costs two pool calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import DistributedDataParallel
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp_tests._harness import ddp_config, model_parallel
from mc_groups.testing import RankPools

MP = mg.ModelParallelConfig()
WIDTH, LAYERS = 95, 10  # upstream's TestModel for the bucket-size grid
BUCKET_SIZES = [None, 9000, 9025, 9050, 18000, 18050, 20000]


class _Stack(nn.Module):
    """Upstream's ``TestModel``: ``layers`` of ``nn.Linear(width, width)`` in bf16, the last
    weight optionally marked ``shared_embedding``; ``expert`` extra layers whose params carry
    ``allreduce=False`` (upstream's ``TestModelWithExperts``)."""

    def __init__(
        self,
        width: int,
        layers: int,
        bias: bool,
        shared_embedding: bool = False,
        experts: int = 0,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(width, width, bias) for _ in range(layers)])
        self.experts = nn.ModuleList([nn.Linear(width, width, bias) for _ in range(experts)])
        if shared_embedding:
            self.layers[-1].weight.shared_embedding = True  # type: ignore[union-attr]
        for param in self.experts.parameters():
            param.allreduce = False  # type: ignore[attr-defined]
        self.to(torch.bfloat16)


def _wrap(
    pgc: mg.ProcessGroupCollection, model: nn.Module, **fields: Any
) -> DistributedDataParallel:
    return DistributedDataParallel(MP, ddp_config(**fields), model, pg_collection=pgc)


def _groups(ddp: DistributedDataParallel) -> list[ParamAndGradBucketGroup]:
    return ddp.bucket_groups + ddp.expert_parallel_bucket_groups


# -- the upstream grad-sync protocol, shared with test_conformance_test_grad_sync_with_expert_
# -- parallel.py ------------------------------------------------------------------------------


def grad_sync_trace(
    ddp: DistributedDataParallel, fill: Callable[[], None], overlap: bool
) -> list[dict[str, Any]]:
    """Drive every bucket group by hand the way upstream's ``test_grad_sync`` does.

    ``fill`` writes the starting grads into the buffers. With ``overlap_grad_reduce`` the first
    iteration registers every param (learning the ready counts, dispatching nothing), a
    ``reset()`` ends it, then each param in turn is registered and its group's
    ``finish_grad_sync()`` called. Without overlap ``finish_grad_sync()`` forces the collective
    through for the param's group, then ``reset()`` (mc's finish is idempotent within an
    iteration, Megatron's non-overlap one re-issues on every call, so upstream's per-param
    loop maps to one iteration per param here) and the grads are filled again.

    Returns, per param in ``module.parameters()`` order: how many groups hold it, its group
    ("dense"/"expert"), its index in the group, the group's size, whether finish refused,
    ``grad_data[0]`` of the group's (single) bucket afterwards, the collectives issued (op, group
    ranks) and the group's shard position (rank, size).
    """
    group_of = {p: g for g in _groups(ddp) for p in g.params}
    params = list(ddp.module.parameters())
    fill()
    if overlap:
        for param in params:
            group_of[param].register_grad_ready(param)
        for param in params:
            group_of[param].reset()
    position: dict[int, int] = {}
    out = []
    for param in params:
        group = group_of[param]
        index = position.get(id(group), -1) + 1
        position[id(group)] = index
        refused = register_refused = False
        with mg.record_collectives() as log:
            try:  # Megatron asserts overlap_grad_reduce here
                group.register_grad_ready(param)
            except AssertionError:
                register_refused = True
            try:
                group.finish_grad_sync()
            except AssertionError:  # mc's InputStateError, caught as upstream catches it
                refused = True
        out.append(
            {
                "owners": sum(param in g.params for g in _groups(ddp)),
                "kind": "dense" if group in ddp.bucket_groups else "expert",
                "index": index,
                "size": len(group.params),
                "refused": refused,
                "register_refused": register_refused,
                "value": float(group.buckets[0].grad_data[0]),
                "ops": [(r.op, r.group_ranks) for r in log],
                "shard": (group.shard.rank, group.shard.size),
            }
        )
        if not overlap:
            group.reset()
            fill()
    return out


def expected_value(*, start: float, dist_opt: bool, shard_rank: int, scale: float) -> float:
    """Upstream's rule for ``grad_data[0]`` once its group's collective finished.

    Every rank starts with ``start`` and the group pre-scales by ``scale``; the starting values
    are chosen so that the reduced grad is 1. Element 0 is in shard 0, so a distributed-
    optimizer rank owning another shard keeps its pre-scaled local value ``start · scale``
    (which is also 1 under ``average_in_collective`` for dense grads, whose scale is 1).
    """
    if dist_opt and shard_rank != 0:
        return start * scale
    return 1.0


# -- 2 ranks ------------------------------------------------------------------------------


def _bucket_grid(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for bucket_size in BUCKET_SIZES:
        for dist_opt in (False, True):
            for bias in (False, True):
                for shared in (False, True):
                    if shared and bias:
                        continue  # upstream skips it too
                    ddp = _wrap(
                        pgc,
                        _Stack(WIDTH, LAYERS, bias, shared),
                        grad_reduce_in_fp32=True,
                        use_distributed_optimizer=dist_opt,
                        overlap_grad_reduce=True,
                        bucket_size=bucket_size,
                    )
                    (buffer,) = ddp.buffers
                    out[str((bucket_size, dist_opt, bias, shared))] = (
                        [b.numel_unpadded for b in buffer.buckets],
                        [b.grad_data.numel() for b in buffer.buckets],
                    )
    return out


def _fp32_local(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for patterns in (("*.weight",), ("all",), ()):
        model = _Stack(10, 3, bias=True)
        ddp = _wrap(pgc, model, param_name_patterns_for_fp32_local_accumulation=patterns)
        (buffer,) = ddp.buffers
        names = {p: n for n, p in model.named_parameters()}
        params = {}
        for name, param in model.named_parameters():
            copy = getattr(param, "main_grad_copy_in_grad_buffer", None)
            params[name] = (
                param.main_grad.dtype,  # type: ignore[attr-defined]
                None if copy is None else copy.dtype,
            )
        out[str(patterns)] = {
            "params": params,
            "grad_dtype": buffer.grad_dtype,
            "extra": len(buffer.extra_main_grads),
            "tracked": sorted(
                names[p] for b in buffer.buckets for p in b.params_with_extra_main_grads
            ),
            "in_bucket": all(
                set(b.params_with_extra_main_grads) <= b.params for b in buffer.buckets
            ),
        }
    return out


def _expert_buffers(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for dist_opt in (False, True):
        model = _Stack(WIDTH, 3, bias=True, experts=2)
        names = {p: n for n, p in model.named_parameters()}
        ddp = _wrap(
            pgc,
            model,
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=dist_opt,
            overlap_grad_reduce=True,
        )
        result = []
        for buffers in (ddp.buffers, ddp.expert_parallel_buffers):
            result.append(
                [
                    {
                        "bucket_params": sorted(names[p] for b in buf.buckets for p in b.params),
                        "index_keys": sorted(names[p] for p in buf.param_index_map),
                        "min_start": min(s for s, _, _ in buf.param_index_map.values()),
                        "numel": buf.numel,
                    }
                    for buf in buffers
                ]
            )
        out[str(dist_opt)] = result
    return out


class _Handle:
    """Stands in for an in-flight all-gather: counts its waits."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> None:
        self.waits += 1


def _free_overlap(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    def make() -> DistributedDataParallel:
        return _wrap(
            pgc,
            _Stack(32, 2, bias=False, experts=1),
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        )

    out: dict[str, Any] = {}
    ddp = make()
    out["idle"] = [(g.param_gather_handle is None, g.communicator.nbytes) for g in _groups(ddp)]
    for group in _groups(ddp):
        group.free_overlap_buffers()  # nothing allocated, nothing in flight: a no-op
    out["idle_after"] = [
        (g.param_gather_handle is None, g.communicator.nbytes) for g in _groups(ddp)
    ]

    ddp = make()
    ddp.finish_grad_sync()  # the gloo reduce-scatter's receive buffer stays in the communicator
    out["held"] = [g.communicator.nbytes for g in _groups(ddp)]
    for group in _groups(ddp):
        group.free_overlap_buffers()
    out["freed"] = [g.communicator.nbytes for g in _groups(ddp)]

    ddp = make()
    handles = []
    for group in _groups(ddp):
        handle = _Handle()
        handles.append(handle)
        group.param_gather_handle = handle  # type: ignore[assignment]
        group.free_overlap_buffers()
    out["waited"] = [
        (h.waits, g.param_gather_handle is None) for h, g in zip(handles, _groups(ddp), strict=True)
    ]

    ddp = make()
    calls: list[str] = []
    for group in _groups(ddp):

        def record(name: str = group.name) -> None:
            calls.append(name)

        setattr(group, "free_overlap_buffers", record)  # noqa: B010
    ddp.free_overlap_buffers()
    out["delegated"] = (sorted(calls), sorted(g.name for g in _groups(ddp)))
    return out


def _param_sync_dp1() -> dict[str, Any]:
    with model_parallel(tensor_model_parallel_size=dist.get_world_size()) as pgc:
        ddp = _wrap(
            pgc,
            _Stack(32, 2, bias=False),
            grad_reduce_in_fp32=True,
            use_distributed_optimizer=True,
            overlap_grad_reduce=True,
            overlap_param_gather=True,
        )
        states = []
        with mg.record_collectives() as log:
            for group in ddp.bucket_groups:
                before = group.param_gather_dispatched
                group.start_param_sync()
                states.append((group.shard.size, before, group.param_gather_dispatched))
        return {"states": states, "ops": [r.op for r in log]}


def _two_rank_facts() -> dict[str, Any]:
    with model_parallel() as pgc:
        out = {
            "grid": _bucket_grid(pgc),
            "fp32_local": _fp32_local(pgc),
            "experts": _expert_buffers(pgc),
            "free": _free_overlap(pgc),
        }
    out["dp1"] = _param_sync_dp1()
    return out


@pytest.fixture(scope="module")
def two_ranks(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(2).run(_two_rank_facts)


def _expected_buckets(
    bias: bool, shared: bool, bucket_size: int | None, dist_opt: bool, dp: int
) -> tuple[list[int], list[int]]:
    """Unpadded and padded bucket sizes by upstream's rule: params in backprop order; with the
    distributed optimizer each param starts on a multiple of 64 and each bucket ends on a
    multiple of lcm(dp, 128), and a ``shared_embedding`` param (here the first in backprop
    order) sits alone in the first bucket; a bucket closes at the param that brings it to
    ``bucket_size`` or more."""
    sizes: list[int] = []
    for _ in range(LAYERS):
        sizes.append(WIDTH * WIDTH)
        if bias:
            sizes.append(WIDTH)
    order = sizes[::-1]
    unpadded: list[int] = []
    if shared and dist_opt:
        unpadded.append(order.pop(0))
    filled = 0
    for size in order:
        if dist_opt:
            filled = math.ceil(filled / 64) * 64
        filled += size
        if bucket_size is not None and filled >= bucket_size:
            unpadded.append(filled)
            filled = 0
    if filled:
        unpadded.append(filled)
    divisor = math.lcm(dp, 128) if dist_opt else 1
    return unpadded, [math.ceil(n / divisor) * divisor for n in unpadded]


@pytest.mark.parametrize("bucket_size", BUCKET_SIZES)
def test_bucket_sizes(two_ranks: list[dict[str, Any]], bucket_size: int | None) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::test_bucket_sizes``.

    Same grid (bucket sizes × distributed optimizer × bias × shared embedding, shared with
    bias skipped), same facts: each bucket's ``numel_unpadded`` and padded
    ``grad_data.numel()`` follow the rule of :func:`_expected_buckets`, padded buckets divide
    by dp, and ``bucket_size=None`` gives one bucket (two with a shared embedding under the
    distributed optimizer). dp = 2 here.
    """
    for out in two_ranks:
        for dist_opt in (False, True):
            for bias in (False, True):
                for shared in (False, True):
                    if shared and bias:
                        continue
                    got = out["grid"][str((bucket_size, dist_opt, bias, shared))]
                    want = _expected_buckets(bias, shared, bucket_size, dist_opt, dp=2)
                    assert tuple(got) == want, (bucket_size, dist_opt, bias, shared)
                    if dist_opt:
                        assert all(n % 2 == 0 for n in got[1])
                    if bucket_size is None:
                        assert len(got[0]) == (2 if shared and dist_opt else 1)


def test_fp32_local_accumulation_patterns_on_ddp_names(two_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    TestFP32LocalGradAccumulation::{test_pattern_matching_creates_fp32_main_grad,
    test_all_pattern_matches_every_param, test_bucket_tracks_params_with_extra_main_grads,
    test_no_patterns_means_no_extra_main_grads}``.

    Same facts on a bf16 model without ``grad_reduce_in_fp32``: the patterns match the names
    DDP sees (``layers.0.weight``); a matched param gets an fp32 ``main_grad`` and a
    ``main_grad_copy_in_grad_buffer`` in the buffer's grad dtype (bf16); an unmatched one keeps
    a bf16 ``main_grad`` and no copy; ``"all"`` matches every param; the buckets track exactly
    the matched params (a subset of their own params); no pattern, no extra grads.
    """
    bf16, fp32 = torch.bfloat16, torch.float32
    weights = [f"layers.{i}.weight" for i in range(3)]
    biases = [f"layers.{i}.bias" for i in range(3)]
    for out in two_ranks:
        matched = out["fp32_local"]["('*.weight',)"]
        assert matched["grad_dtype"] == bf16
        assert {n: matched["params"][n] for n in weights} == dict.fromkeys(weights, (fp32, bf16))
        assert {n: matched["params"][n] for n in biases} == dict.fromkeys(biases, (bf16, None))
        assert matched["tracked"] == sorted(weights)
        assert matched["extra"] == 3
        assert matched["in_bucket"]
        every = out["fp32_local"]["('all',)"]
        assert set(every["params"].values()) == {(fp32, bf16)}
        assert every["tracked"] == sorted(weights + biases)
        none = out["fp32_local"]["()"]
        assert set(none["params"].values()) == {(bf16, None)}
        assert (none["extra"], none["tracked"]) == (0, [])


def test_expert_parallel_params_get_separate_buffers(two_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    test_expert_parallel_params_get_separate_buffers``.

    Same facts (3 dense + 2 expert ``Linear(95, 95)`` with bias, one bucket per buffer): one
    dense and one expert buffer; each holds exactly its params, in its buckets and in its
    ``param_index_map``; both index spaces start at 0; with the distributed optimizer both
    sizes divide by dp (2).
    """
    dense = sorted(f"layers.{i}.{k}" for i in range(3) for k in ("weight", "bias"))
    expert = sorted(f"experts.{i}.{k}" for i in range(2) for k in ("weight", "bias"))
    for out in two_ranks:
        for dist_opt in (False, True):
            dense_buffers, expert_buffers = out["experts"][str(dist_opt)]
            assert (len(dense_buffers), len(expert_buffers)) == (1, 1)
            for (buf,), names in ((dense_buffers, dense), (expert_buffers, expert)):
                assert buf["bucket_params"] == buf["index_keys"] == names
                assert buf["min_start"] == 0
                if dist_opt:
                    assert buf["numel"] % 2 == 0


def test_free_overlap_buffers(two_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    TestFreeOverlapBuffers::{test_bucket_group_clears_buffers,
    test_bucket_group_waits_on_pending_handle, test_bucket_group_noop_when_no_buffers,
    test_ddp_free_overlap_buffers_delegates}``.

    Same facts: a group with nothing allocated and nothing in flight is left as it is; a
    pending param all-gather handle is waited on exactly once and dropped; the group's
    temporaries are released (upstream's are the layer-wise optimizer's gather lists, which
    mc does not have; mc's are the gloo reduce-scatter buffers a group's
    ``mc_groups.comm.communicator.Communicator`` keeps between iterations); DDP's
    ``free_overlap_buffers``
    calls it on every dense and expert group.
    Upstream's model has ``use_distributed_optimizer=False`` with ``overlap_param_gather``
    (the layer-wise path), which mc refuses; the distributed optimizer is on here.
    """
    for out in two_ranks:
        free = out["free"]
        assert free["idle"] == free["idle_after"] == [(True, 0), (True, 0)]
        assert all(n > 0 for n in free["held"])
        assert free["freed"] == [0, 0]
        assert free["waited"] == [(1, True), (1, True)]
        calls, names = free["delegated"]
        assert calls == names == ["dense bucket group 0", "expert bucket group 0"]


def test_start_param_sync_dp_size_1(two_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    test_start_param_sync_dp_size_1``.

    Same facts with tp = world (so dp = 1): ``start_param_sync`` marks every group's gather
    dispatched and issues no all-gather. Upstream reaches this through the layer-wise
    optimizer path (``overlap_param_gather`` without the distributed optimizer), which mc
    refuses; here the distributed optimizer is on and the gather is skipped because its group
    has one rank.
    """
    for out in two_ranks:
        assert out["dp1"]["states"] == [(1, False, True)]
        assert out["dp1"]["ops"] == []


# -- 4 ranks ------------------------------------------------------------------------------


def _dense_grad_sync() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for instances in (1, 2):
        with model_parallel(num_distributed_optimizer_instances=instances) as pgc:
            for dist_opt in (False, True):
                if instances > 1 and not dist_opt:
                    continue  # several instances need the distributed optimizer (upstream too)
                for overlap in (False, True):
                    for average in (False, True):
                        model = _Stack(10, 4, bias=True)
                        ddp = _wrap(
                            pgc,
                            model,
                            grad_reduce_in_fp32=True,
                            use_distributed_optimizer=dist_opt,
                            overlap_grad_reduce=overlap,
                            average_in_collective=average,
                            num_distributed_optimizer_instances=instances,
                        )
                        (buffer,) = ddp.buffers

                        def fill(buffer: Any = buffer) -> None:
                            buffer.grad_data.fill_(1.0)

                        key = str((instances, dist_opt, overlap, average))
                        out[key] = grad_sync_trace(ddp, fill, overlap)
    return out


def _shard_cover() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for instances in (1, 2):
        with model_parallel(num_distributed_optimizer_instances=instances) as pgc:
            model = _Stack(100, 2, bias=True)
            ddp = _wrap(
                pgc,
                model,
                use_distributed_optimizer=True,
                num_distributed_optimizer_instances=instances,
            )
            (buffer,) = ddp.buffers
            (group,) = ddp.bucket_groups
            owned = sum(
                b - a
                for bucket in buffer.buckets
                for s in bucket.shard_param_slices(group.shard.rank, group.shard.size)
                for a, b in [s.param_range]
            )
            total = torch.tensor([owned], dtype=torch.int64)
            mg.all_reduce(total, group.shard.group)
            out[str(instances)] = {
                "owned_total": int(total),
                "numel": sum(p.numel() for p in buffer.params),
                "shards": buffer.param_layout.num_optimizer_shards,
                "group": (group.shard.size, mg.group_ranks(group.shard.group)),
            }
    return out


def _four_rank_facts() -> dict[str, Any]:
    return {"grad_sync": _dense_grad_sync(), "shards": _shard_cover()}


@pytest.fixture(scope="module")
def four_ranks(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(4).run(_four_rank_facts)


@pytest.mark.parametrize("instances", [1, 2])
def test_grad_sync(four_ranks: list[dict[str, Any]], instances: int) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::test_grad_sync``.

    Same grid (distributed optimizer × overlap × average_in_collective × 1 or 2 optimizer instances,
    the latter with the distributed optimizer only), one bucket, every grad 1 on every rank, dp = 4.
    Facts: every param is in exactly one bucket group; with overlap, nothing is communicated and
    ``grad_data[0]`` stays 1 until the last param of the group is registered ready, and finishing
    earlier is refused; once the reduction ran, ``grad_data[0]`` is 1, except on a
    distributed-optimizer rank not owning element 0 under a SUM reduction, where it is the
    pre-scaled 1/dp (the shard index counts inside the optimizer instance, the scaling uses the
    whole dp). Without overlap ``finish_grad_sync`` forces the collective through.

    Both refusals are ``AssertionError`` s, as upstream catches them: ``register_grad_ready``
    without overlap, and an early ``finish_grad_sync`` with overlap. Readings: upstream calls
    ``finish_grad_sync`` once per param without overlap, each call re-issuing the collective
    (Megatron's non-overlap path); mc's ``finish_grad_sync`` is idempotent within an
    iteration, so the per-param loop is one iteration per param here. With several instances
    upstream's early ``finish_grad_sync`` returns silently and marks the sync finished though
    nothing was reduced (CUDA-stream semantics); mc refuses it like the one-instance case
    (docs/compatibility.md: a deliberate difference that keeps unreduced grads from reaching
    the optimizer).
    """
    dp = 4
    for out in four_ranks:
        for dist_opt in (False, True):
            if instances > 1 and not dist_opt:
                continue
            for overlap in (False, True):
                for average in (False, True):
                    trace = out["grad_sync"][str((instances, dist_opt, overlap, average))]
                    assert len(trace) == 8
                    for step in trace:
                        assert step["owners"] == 1  # every param in exactly one group
                        assert step["register_refused"] is not overlap
                        shard_rank, shard_size = step["shard"]
                        assert shard_size == (dp // instances if dist_opt else dp)
                        last = step["index"] == step["size"] - 1
                        if overlap and not last:
                            assert (step["refused"], step["value"], step["ops"]) == (True, 1.0, [])
                            continue
                        assert not step["refused"]
                        scale = 1.0 if average else 1.0 / dp
                        want = expected_value(
                            start=1.0, dist_opt=dist_opt, shard_rank=shard_rank, scale=scale
                        )
                        assert step["value"] == want, (dist_opt, overlap, average, step)
                        first = "reduce_scatter" if dist_opt else "all_reduce"
                        ops = [op for op, _ in step["ops"]]
                        assert ops == [first] + (["all_reduce"] if instances > 1 else [])


def test_optimizer_shards_cover_every_param(four_ranks: list[dict[str, Any]]) -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    test_optimizer_shards_cover_every_param``.

    Same fact, for 1 and 2 optimizer instances on 4 ranks: summing, over the group a buffer
    reduce-scatters in, the param elements each rank's shards own gives every param element
    once; so the layout splits each bucket into exactly that group's size (4, or 2 inside
    an instance) of shards.
    """
    for rank, out in enumerate(four_ranks):
        for instances, intra in ((1, (0, 1, 2, 3)), (2, (0, 1) if rank < 2 else (2, 3))):
            facts = out["shards"][str(instances)]
            assert facts["owned_total"] == facts["numel"] == 2 * (100 * 100 + 100)
            assert facts["shards"] == len(intra)
            assert facts["group"] == (len(intra), intra)
