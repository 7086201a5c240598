"""Collective wrappers: values against local math, and what the recorder saw.

Inputs are rank-valued so each result is derivable by hand: on a world of W ranks,
``sum_r (r + 1) = W(W + 1)/2``; shard ``k`` of a reduce-scatter of ``arange(n)·(r + 1)``
is ``arange(n)[k-th slice] · W(W + 1)/2``.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import ReduceOp, record_collectives
from mc_groups.comm.collectives import all_reduce_flat, record_p2p_ops
from mc_groups.comm.communicator import Communicator
from mc_groups.testing import RankPools


def _world() -> dist.ProcessGroup:
    group = dist.group.WORLD
    assert group is not None
    return group


def _ops(log: list[mg.CollectiveRecord]) -> list[tuple[Any, ...]]:
    return [
        (r.op, r.reduce_op, r.group_ranks, r.numel, r.bytes, r.async_op, r.coalesced) for r in log
    ]


def _all_reduce_values() -> dict[str, Any]:
    g, r = _world(), dist.get_rank()
    with record_collectives() as log:
        s = torch.full((3,), float(r + 1))
        mg.all_reduce(s, g)
        a = torch.full((2,), float(r + 1), dtype=torch.bfloat16)
        mg.all_reduce(a, g, op=ReduceOp.AVG, label="avg")
        m = torch.tensor([float(r)])
        mg.all_reduce(m, g, op=ReduceOp.MAX, async_op=True).wait(timeout=10)
    return {
        "sum": s.tolist(),
        "avg": a.float().tolist(),
        "max": m.item(),
        "log": _ops(log),
        "label": log[1].label,
        "dtypes": [x.dtype for x in log],
    }


@pytest.mark.parametrize("world", [2, 4])
def test_all_reduce(rank_pools: RankPools, world: int) -> None:
    total = world * (world + 1) / 2
    ranks = tuple(range(world))
    for out in rank_pools.get(world).run(_all_reduce_values):
        assert out["sum"] == [total] * 3
        assert out["avg"] == [total / world] * 2
        assert out["max"] == world - 1
        assert out["log"] == [
            ("all_reduce", "sum", ranks, 3, 12, False, False),
            ("all_reduce", "avg", ranks, 2, 4, False, False),
            ("all_reduce", "max", ranks, 1, 4, True, False),
        ]
        assert out["label"] == "avg"
        assert out["dtypes"] == [torch.float32, torch.bfloat16, torch.float32]


def _reduce_scatter_in_place(n: int) -> dict[str, Any]:
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    flat = torch.arange(n, dtype=torch.float32) * (r + 1)
    shard = flat.view(-1)[r * (n // w) : (r + 1) * (n // w)]
    with record_collectives() as log:
        mg.reduce_scatter(shard, flat, g, async_op=True).wait()
    return {"shard": shard.tolist(), "log": _ops(log)}


@pytest.mark.parametrize("world", [2, 4])
def test_reduce_scatter_into_shard_view(rank_pools: RankPools, world: int) -> None:
    n = 8
    total = world * (world + 1) / 2
    for r, out in enumerate(rank_pools.get(world).run(_reduce_scatter_in_place, n)):
        lo, hi = r * n // world, (r + 1) * n // world
        assert out["shard"] == [v * total for v in range(lo, hi)]
        assert out["log"] == [("reduce_scatter", "sum", tuple(range(world)), n, 4 * n, True, False)]


def _reduce_scatter_ops() -> dict[str, list[float]]:
    """Every reduce op, sync and async, fp32 and bf16, against all_reduce-then-slice."""
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    out: dict[str, list[float]] = {}
    for op in ReduceOp:
        for dtype in (torch.float32, torch.bfloat16):
            for async_op in (False, True):
                # element i of rank r: (i + 1)·(r + 1) · (−1)^i — signs make MAX ≠ SUM order
                base = torch.arange(2 * w, dtype=torch.float32) + 1
                x = (base * (r + 1) * (-1) ** torch.arange(2 * w)).to(dtype)
                shard = torch.empty(2, dtype=dtype)
                mg.reduce_scatter(shard, x, g, op=op, async_op=async_op).wait()
                out[f"{op.value}-{dtype}-{async_op}"] = shard.float().tolist()
    return out


def test_reduce_scatter_every_op(rank_pools: RankPools) -> None:
    w = 4
    outs = rank_pools.get(w).run(_reduce_scatter_ops)
    for r, out in enumerate(outs):
        for i_local in range(2):
            i = 2 * r + i_local
            sign = (-1) ** i
            per_rank = [(i + 1) * (k + 1) * sign for k in range(w)]
            want = {
                "sum": sum(per_rank),
                "avg": sum(per_rank) / w,
                "max": max(per_rank),
                "min": min(per_rank),
            }
            for key, got in out.items():
                assert got[i_local] == want[key.split("-")[0]], (r, key)


def _with_kept_buffers() -> dict[str, Any]:
    """A caller's receive buffer (``received=``) and a communicator's kept buffers give the
    same values as fresh ones, in and out of batches, call after call; the communicator
    keeps its buffers until ``free()``; a wrong-sized ``received`` is refused before
    anything is issued."""
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    n = 4 * w
    received = torch.full((n,), float("nan"))  # garbage in the buffer must not leak out
    comm = Communicator(g)
    results: dict[str, Any] = {}
    for round_ in range(2):
        flat = torch.arange(n, dtype=torch.float32) * (r + 1)
        shard = flat.view(-1)[r * 4 : (r + 1) * 4]
        mg.reduce_scatter(shard, flat, g, received=received)
        gathered = torch.zeros(n)
        mg.all_gather(gathered, shard, g, async_op=True).wait()
        outs = [torch.zeros(4), torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4)]
        ins = [torch.full((n,), float(r + 1), dtype=o.dtype) for o in outs]
        comm.reduce_scatter(list(zip(outs, ins, strict=True)), async_op=True).wait()
        results[f"round{round_}"] = (gathered.tolist(), [o.float().tolist() for o in outs])
        results[f"kept{round_}"] = comm.nbytes
    comm.free()
    results["freed"] = comm.nbytes
    with record_collectives() as log:
        try:
            mg.reduce_scatter(torch.zeros(4), torch.zeros(n), g, received=torch.zeros(3))
            results["bad"] = "no error"
        except ValueError as err:
            results["bad"] = str(err)
    results["logged"] = len(log)
    return results


def test_receive_buffers_are_reused_safely(rank_pools: RankPools) -> None:
    w = 2
    total = w * (w + 1) / 2  # rank r contributes arange·(r + 1), or the constant r + 1
    full = [v * total for v in range(4 * w)]
    # gloo keeps one receive buffer per reduce-scatter (n elements of its dtype) and one
    # fp32 sum buffer for the bf16 one (its 4-element output)
    kept = 2 * (4 * w * 4) + 4 * w * 2 + 4 * 4
    for out in rank_pools.get(w).run(_with_kept_buffers):
        for key in ("round0", "round1"):
            gathered, shards = out[key]
            assert gathered == full
            assert shards == [[total] * 4] * 3
        assert out["kept0"] == out["kept1"] == kept
        assert out["freed"] == 0
        assert "received=3 × float32" in out["bad"]
        assert f"{4 * w} × float32" in out["bad"]
        assert out["logged"] == 0


def _communicator_batches() -> dict[str, Any]:
    """What a communicator issues for a list: on gloo one batch per dtype in first-appearance
    order (a batch of one alone, not coalesced); with ``accumulate_dtype`` one all-to-all
    per pair; values equal to one collective at a time."""
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    comm = Communicator(g)
    dtypes = [torch.float32, torch.bfloat16, torch.float32]
    tensors = [torch.full((2 * w,), float(r + 1), dtype=d) for d in dtypes]
    out: dict[str, Any] = {}
    with record_collectives() as log:
        comm.all_reduce(tensors, op=ReduceOp.AVG, label="ar").wait()
        pairs = [(t.new_zeros(2), t.clone()) for t in tensors]
        comm.reduce_scatter(pairs, label="rs").wait()
        acc = [(t.new_zeros(2), t.clone()) for t in tensors]
        comm.reduce_scatter(acc, accumulate_dtype=torch.float32, async_op=True, label="acc").wait()
        gathers = [(t.new_zeros(2 * w), torch.full((2,), float(r), dtype=t.dtype)) for t in tensors]
        comm.all_gather(gathers, label="ag").wait()
    out["log"] = [(x.op, x.dtype, x.numel, x.async_op, x.coalesced, x.label) for x in log]
    out["all_reduce"] = [t.float().tolist() for t in tensors]
    out["reduce_scatter"] = [o.float().tolist() for o, _ in pairs]
    out["accumulated"] = [o.float().tolist() for o, _ in acc]
    out["gathered"] = [o.float().tolist() for o, _ in gathers]
    return out


def test_communicator_batches_by_dtype_on_gloo(rank_pools: RankPools) -> None:
    w = 2
    f32, bf16 = torch.float32, torch.bfloat16
    for out in rank_pools.get(w).run(_communicator_batches):
        assert out["log"] == [
            ("all_reduce", f32, 2 * w, False, True, "ar"),
            ("all_reduce", f32, 2 * w, False, True, "ar"),
            ("all_reduce", bf16, 2 * w, False, False, "ar"),
            ("reduce_scatter", f32, 2 * w, False, True, "rs"),
            ("reduce_scatter", f32, 2 * w, False, True, "rs"),
            ("reduce_scatter", bf16, 2 * w, False, False, "rs"),
            ("all_to_all", f32, 2 * w, True, False, "acc"),
            ("all_to_all", bf16, 2 * w, True, False, "acc"),
            ("all_to_all", f32, 2 * w, True, False, "acc"),
            ("all_gather", f32, 2, False, True, "ag"),
            ("all_gather", f32, 2, False, True, "ag"),
            ("all_gather", bf16, 2, False, False, "ag"),
        ]
        assert out["all_reduce"] == [[1.5] * 2 * w] * 3
        assert out["reduce_scatter"] == out["accumulated"] == [[3.0] * 2] * 3
        assert out["gathered"] == [[0.0, 0.0, 1.0, 1.0]] * 3


def _flat_all_reduces() -> dict[str, Any]:
    """``all_reduce_flat`` on rank-valued tensors of two dtypes, one of them a
    non-contiguous view; then a lone non-contiguous tensor."""
    g, r = _world(), dist.get_rank()
    a = torch.full((2, 3), float(r + 1)).t()  # fp32, non-contiguous
    b = torch.full((3,), float(r + 1), dtype=torch.bfloat16)
    c = torch.full((1,), 10.0 * (r + 1))
    lone = torch.full((3, 2), float(r)).t()
    with record_collectives() as log:
        all_reduce_flat([a, b, c], g, label="flat")
        all_reduce_flat([lone], g, op=ReduceOp.MAX, label="lone")
    return {
        "values": [a.tolist(), b.float().tolist(), c.tolist(), lone.tolist()],
        "log": [(x.op, x.reduce_op, x.dtype, x.numel, x.label) for x in log],
    }


def test_all_reduce_flat_one_collective_per_dtype(rank_pools: RankPools) -> None:
    """Megatron's flatten / all-reduce / unflatten, per dtype: fp32 ``a`` (6 elements) and
    ``c`` (1) travel as one buffer of 7, bf16 ``b`` alone in place; 2 ranks sum 1 + 2 = 3
    (``c``: 10 + 20); a lone non-contiguous tensor is flattened too (MAX of 0 and 1). Bad
    arguments: ``test_bad_input.py``."""
    f32, bf16 = torch.float32, torch.bfloat16
    for out in rank_pools.get(2).run(_flat_all_reduces):
        assert out["values"] == [[[3.0] * 2] * 3, [3.0] * 3, [30.0], [[1.0] * 3] * 2]
        assert out["log"] == [
            ("all_reduce", "sum", f32, 7, "flat"),
            ("all_reduce", "sum", bf16, 3, "flat"),
            ("all_reduce", "max", f32, 6, "lone"),
        ]


def _rows(out: torch.Tensor, w: int) -> list[tuple[float, float]]:
    """(min, max) of each rank's row of a gathered output."""
    return [(float(row.min()), float(row.max())) for row in out.view(w, -1)]


def _gloo_all_gathers(per_rank: int) -> dict[str, Any]:
    """The gloo all-gather in its corner cases, ``per_rank`` elements from each rank."""
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    n = per_rank * w
    results: dict[str, Any] = {}
    # in place: the input is this rank's row of the output
    flat = torch.full((n,), -1.0)
    flat[per_rank * r : per_rank * (r + 1)] = float(r)
    with record_collectives() as log:
        mg.all_gather(flat, flat[per_rank * r : per_rank * (r + 1)], g)
    results["in_place"] = _rows(flat, w)
    results["log"] = _ops(log)
    # the input is another row of the output (it must be read before that row is received)
    other = (r + 1) % w
    flat = torch.full((n,), -1.0)
    flat[per_rank * other : per_rank * (other + 1)] = float(10 + r)
    mg.all_gather(flat, flat[per_rank * other : per_rank * (other + 1)], g)
    results["aliased"] = _rows(flat, w)
    # several gathers in flight at once on one group, with a user send/recv (tag 0) between
    outs = [torch.zeros(n) for _ in range(3)]
    handles = [
        mg.all_gather(out, torch.full((per_rank,), float(100 * k + r)), g, async_op=True)
        for k, out in enumerate(outs)
    ]
    token = torch.full((1,), float(r))
    if r == 0:
        mg.send(token, g, group_dst=1)
    elif r == 1:
        mg.recv(token, g, group_src=0)
    for handle in reversed(handles):
        handle.wait()
    results["in_flight"] = [_rows(out, w) for out in outs]
    results["token"] = token.item()
    return results


@pytest.mark.parametrize(
    "per_rank_bytes", [12, 4 * 2**20], ids=["all-to-all (small)", "exchange (4 MiB per rank)"]
)
def test_gloo_all_gather_paths(rank_pools: RankPools, per_rank_bytes: int) -> None:
    """Localizes gloo's two all-gather algorithms (all-to-all of the repeated shard below
    4 MiB of output, point-to-point exchange above): in-place and aliased inputs, and three
    gathers in flight at once beside a user send/recv on the same group (messages must not
    cross: the exchange has its own tag; same-tag messages match in posting order)."""
    for w in (2, 4):
        results = rank_pools.get(w).run(_gloo_all_gathers, per_rank_bytes // 4)
        for r, out in enumerate(results):
            assert out["in_place"] == [(float(s), float(s)) for s in range(w)]
            assert out["aliased"] == [(float(10 + s), float(10 + s)) for s in range(w)]
            for k, got in enumerate(out["in_flight"]):
                assert got == [(float(100 * k + s), float(100 * k + s)) for s in range(w)]
            assert out["token"] == (0.0 if r <= 1 else float(r))
            # either algorithm is recorded as one all-gather of this rank's input
            n = per_rank_bytes // 4
            assert out["log"] == [
                ("all_gather", None, tuple(range(w)), n, per_rank_bytes, False, False)
            ]


def _all_gather_values() -> dict[str, Any]:
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    out = torch.zeros(3 * w)
    with record_collectives() as log:
        mg.all_gather(out, torch.full((3,), float(r)), g)
    return {"out": out.tolist(), "log": _ops(log)}


def test_all_gather(rank_pools: RankPools) -> None:
    for out in rank_pools.get(4).run(_all_gather_values):
        assert out["out"] == [0.0] * 3 + [1.0] * 3 + [2.0] * 3 + [3.0] * 3
        assert out["log"] == [("all_gather", None, (0, 1, 2, 3), 3, 12, False, False)]


def _broadcast_all_to_all_p2p() -> dict[str, Any]:
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    with record_collectives() as log:
        b = torch.full((2,), float(r))
        mg.broadcast(b, g, group_src=w - 1)
        # rank r sends [10r + j] to rank j
        a2a_out = torch.zeros(w)
        mg.all_to_all(a2a_out, torch.tensor([10.0 * r + j for j in range(w)]), g)
        # ring: even ranks send first, odd ranks receive first (no deadlock)
        got = torch.zeros(1)
        nxt, prv = (r + 1) % w, (r - 1) % w
        if r % 2 == 0:
            mg.send(torch.tensor([float(r)]), g, group_dst=nxt)
            mg.recv(got, g, group_src=prv)
        else:
            mg.recv(got, g, group_src=prv)
            mg.send(torch.tensor([float(r)]), g, group_dst=nxt)
        objs = mg.all_gather_objects({"rank": r}, g)
        mg.barrier(g)
    return {
        "b": b.tolist(),
        "a2a": a2a_out.tolist(),
        "got": got.item(),
        "objs": objs,
        "ops": [x.op for x in log],
    }


def test_broadcast_all_to_all_send_recv_objects(rank_pools: RankPools) -> None:
    w = 4
    for r, out in enumerate(rank_pools.get(w).run(_broadcast_all_to_all_p2p)):
        assert out["b"] == [w - 1.0] * 2
        assert out["a2a"] == [10.0 * src + r for src in range(w)]
        assert out["got"] == float((r - 1) % w)
        assert out["objs"] == [{"rank": i} for i in range(w)]
        sends = ["send", "recv"] if r % 2 == 0 else ["recv", "send"]
        assert out["ops"] == ["broadcast", "all_to_all", *sends, "all_gather_object", "barrier"]


def _recorded_p2p_ops() -> dict[str, Any]:
    g, r = _world(), dist.get_rank()
    got = torch.zeros(3)
    ops = [
        dist.P2POp(dist.isend, torch.full((2,), float(r)), group=g, group_peer=1 - r),
        dist.P2POp(dist.irecv, got[:2], group=g, group_peer=1 - r),
    ]
    with record_collectives() as log:
        record_p2p_ops(ops, label="activation")
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    errors = []
    for bad in ("ops", [ops[0], "op"]):
        try:
            record_p2p_ops(bad)
        except TypeError as err:
            errors.append(str(err))
    return {
        "got": got.tolist(),
        "log": _ops(log),
        "labels": [x.label for x in log],
        "errors": errors,
    }


def test_record_p2p_ops_logs_an_outside_engines_sends_and_receives(rank_pools: RankPools) -> None:
    for r, out in enumerate(rank_pools.get(2).run(_recorded_p2p_ops)):
        assert out["got"] == [float(1 - r)] * 2 + [0.0]
        assert out["log"] == [
            ("send", None, (0, 1), 2, 8, True, False),
            ("recv", None, (0, 1), 2, 8, True, False),
        ]
        assert out["labels"] == ["activation"] * 2
        assert out["errors"] == [
            "ops must be a sequence of torch.distributed.P2POp, got str",
            "ops[1] must be a torch.distributed.P2POp, got str",
        ]


def _coalesced_batch(async_op: bool) -> dict[str, Any]:
    g, r, w = _world(), dist.get_rank(), dist.get_world_size()
    x = torch.arange(4, dtype=torch.float32) * (r + 1)
    z = torch.arange(6, dtype=torch.float32) * (r + 1)
    y = torch.full((3,), float(r + 1))
    with record_collectives() as log:
        with mg.coalesced(g, async_op=async_op, label="bucket 0") as batch:
            batch.reduce_scatter(x.view(-1)[r * 4 // w : (r + 1) * 4 // w], x)
            batch.reduce_scatter(z.view(-1)[r * 6 // w : (r + 1) * 6 // w], z)
            try:
                batch.reduce_scatter(z.view(-1)[: 6 // w], z, op=ReduceOp.AVG)
                mixed_op = "no error"
            except ValueError as err:
                mixed_op = str(err)
        batch.handle.wait(timeout=10)
        with mg.coalesced(g, async_op=async_op) as second:
            second.all_reduce(y, op=ReduceOp.AVG)
            try:
                second.all_gather(torch.zeros(2 * w), torch.zeros(2))
                mixed = "no error"
            except ValueError as err:
                mixed = str(err)
        second.handle.wait(timeout=10)
    return {
        "x": x.tolist(),
        "z": z.tolist(),
        "y": y.tolist(),
        "log": _ops(log),
        "labels": [e.label for e in log],
        "mixed": mixed,
        "mixed_op": mixed_op,
    }


@pytest.mark.parametrize("async_op", [False, True])
def test_coalesced(rank_pools: RankPools, async_op: bool) -> None:
    outs = rank_pools.get(2).run(_coalesced_batch, async_op)
    # x: shard r of arange(4)·(1 + 2): rank 0 → [0, 3], rank 1 → [6, 9]
    # z: arange(6)·1 + arange(6)·2 = arange(6)·3
    assert outs[0]["x"][:2] == [0.0, 3.0]
    assert outs[1]["x"][2:] == [6.0, 9.0]
    assert outs[0]["z"][:3] == [0.0, 3.0, 6.0]
    assert outs[1]["z"][3:] == [9.0, 12.0, 15.0]
    for out in outs:
        assert out["y"] == [1.5] * 3
        assert out["log"] == [
            ("reduce_scatter", "sum", (0, 1), 4, 16, async_op, True),
            ("reduce_scatter", "sum", (0, 1), 6, 24, async_op, True),
            ("all_reduce", "avg", (0, 1), 3, 12, async_op, True),
        ]
        assert out["labels"] == ["bucket 0", "bucket 0", ""]
        assert "already holds all_reduce(avg); cannot add all_gather" in out["mixed"]
        assert "holds reduce_scatter(sum); cannot add reduce_scatter(avg)" in out["mixed_op"]


def _single_rank_group_skips_torch() -> dict[str, Any]:
    r = dist.get_rank()
    groups = [dist.new_group([i]) for i in range(dist.get_world_size())]
    solo = groups[r]
    boom = mock.Mock(side_effect=AssertionError("torch.distributed must not be called"))
    x = torch.arange(4.0)
    out = torch.zeros(4)
    with (
        record_collectives() as log,
        mock.patch.multiple(
            dist, all_reduce=boom, broadcast=boom, all_to_all_single=boom, barrier=boom
        ),
    ):
        mg.all_reduce(x, solo, op=ReduceOp.AVG)
        mg.reduce_scatter(out, x, solo)
        mg.all_gather(out, x, solo)
        mg.broadcast(x, solo)
        mg.all_to_all(out, x, solo)
        mg.barrier(solo)
        with mg.coalesced(solo) as batch:
            batch.all_reduce(x)
    for group in groups:
        if group is solo:
            dist.destroy_process_group(group)
    return {"x": x.tolist(), "out": out.tolist(), "log": len(log), "calls": boom.call_count}


def test_single_rank_group_short_circuits(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_single_rank_group_skips_torch):
        assert out == {"x": [0.0, 1.0, 2.0, 3.0], "out": [0.0, 1.0, 2.0, 3.0], "log": 0, "calls": 0}


def _peer_dies_mid_collective() -> str:
    import os

    if dist.get_rank() == 1:
        os._exit(3)
    try:
        mg.all_reduce(torch.ones(4), _world())
    except mg.CollectiveError as err:
        return str(err)
    return "no error"


def test_dead_peer_is_a_named_collective_error() -> None:
    from mc_groups.testing import RankFailure, RankPool

    # A short group timeout and a grace period longer than it: the survivor must answer.
    with (
        RankPool(2, pg_timeout_s=3.0, failure_grace_s=10.0) as pool,
        pytest.raises(RankFailure) as info,
    ):
        pool.run(_peer_dies_mid_collective)
    outcomes = info.value.outcomes
    assert not outcomes[1].ok
    assert "exit code 3" in outcomes[1].error
    assert outcomes[0].ok, outcomes[0].error
    assert "all_reduce on group ranks [0, 1] (4 × float32)" in str(outcomes[0].result)
