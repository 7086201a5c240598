"""mc-groups: the collectives and their options."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from integration_tests._sweep_cases.base import (
    Ctx,
    G,
    arg,
    mg,
    z,
)
from mc_groups.comm.collectives import all_reduce_flat
from mc_groups.comm.communicator import Communicator


def w(ctx: Ctx) -> Any:
    """The worker's world group."""
    return ctx.world_group


# torch.distributed.ReduceOp members are accepted as the mc op of the same meaning (issue 20)
_OPS = ("sum", 0, None, dist.ReduceOp.BAND)


def _collective_slots() -> None:
    ops = _OPS
    # all_reduce
    arg(G, "all_reduce(tensor=)", "tensor", lambda c, v: mg.all_reduce(v, w(c)), good=z())
    arg(G, "all_reduce(group=)", "group", lambda c, v: mg.all_reduce(z(), v))
    arg(
        G,
        "all_reduce(op=)",
        "misuse",
        lambda c, v: mg.all_reduce(z(), w(c), op=v),
        ("op",),
        values=ops,
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(G, "all_reduce(async_op=)", "flag", lambda c, v: mg.all_reduce(z(), w(c), async_op=v))
    arg(G, "all_reduce(label=)", "text", lambda c, v: mg.all_reduce(z(), w(c), label=v))
    arg(G, "all_reduce(detail=)", "text", lambda c, v: mg.all_reduce(z(), w(c), detail=v))
    # reduce_scatter
    arg(
        G,
        "reduce_scatter(output=)",
        "tensor",
        lambda c, v: mg.reduce_scatter(v, z(), w(c)),
        values=(z(3), z(4, torch.float64)),
        good=z(),
    )
    arg(
        G,
        "reduce_scatter(input=)",
        "tensor",
        lambda c, v: mg.reduce_scatter(z(), v, w(c)),
        values=(z(8),),
        good=z(),
    )
    arg(G, "reduce_scatter(group=)", "group", lambda c, v: mg.reduce_scatter(z(), z(), v))
    arg(
        G,
        "reduce_scatter(op=)",
        "misuse",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), op=v),
        ("op",),
        values=ops,
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        G,
        "reduce_scatter(async_op=)",
        "flag",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), async_op=v),
    )
    arg(
        G,
        "reduce_scatter(received=)",
        "misuse",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), received=v),
        ("received",),
        values=("x", [0.0], z(3), z(4, torch.float64)),
        only=True,
        good=None,
    )
    arg(
        G, "reduce_scatter(label=)", "text", lambda c, v: mg.reduce_scatter(z(), z(), w(c), label=v)
    )
    arg(
        G,
        "reduce_scatter(accumulate_dtype=)",
        "opt_dtype",
        lambda c, v: mg.reduce_scatter(z(), z(), w(c), accumulate_dtype=v),
    )
    # the communicator
    arg(G, "Communicator(group=)", "group", lambda c, v: Communicator(v))
    arg(
        G,
        "Communicator.reduce_scatter(pairs=)",
        "misuse",
        lambda c, v: Communicator(w(c)).reduce_scatter(v),
        ("pairs",),
        values=(None, "x", [z()], [(z(3), z())], [(z(), z(), z())]),
        only=True,
        good=[(z(), z())],
    )
    arg(
        G,
        "Communicator.all_reduce(tensors=)",
        "misuse",
        lambda c, v: Communicator(w(c)).all_reduce(v),
        ("tensors",),
        values=(None, z(), [None]),
        only=True,
        good=[z()],
    )
    # the flat all-reduce (one collective per dtype)
    flat = all_reduce_flat
    arg(
        G,
        "all_reduce_flat(tensors=)",
        "misuse",
        lambda c, v: flat(v, w(c)),
        ("tensors",),
        values=(None, "x", [None], ["x"], z()),
        only=True,
        good=[z()],
    )
    arg(G, "all_reduce_flat(group=)", "group", lambda c, v: flat([z()], v))
    arg(
        G,
        "all_reduce_flat(op=)",
        "misuse",
        lambda c, v: flat([z()], w(c), op=v),
        ("op",),
        values=("sum", None),
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(G, "all_reduce_flat(label=)", "text", lambda c, v: flat([z()], w(c), label=v))
    # all_gather
    arg(
        G,
        "all_gather(output=)",
        "tensor",
        lambda c, v: mg.all_gather(v, z(), w(c)),
        values=(z(8), z(4, torch.float64)),
        good=z(),
    )
    arg(G, "all_gather(input=)", "tensor", lambda c, v: mg.all_gather(z(), v, w(c)), good=z())
    arg(G, "all_gather(group=)", "group", lambda c, v: mg.all_gather(z(), z(), v))
    arg(G, "all_gather(async_op=)", "flag", lambda c, v: mg.all_gather(z(), z(), w(c), async_op=v))
    arg(G, "all_gather(label=)", "text", lambda c, v: mg.all_gather(z(), z(), w(c), label=v))
    # broadcast
    arg(G, "broadcast(tensor=)", "tensor", lambda c, v: mg.broadcast(v, w(c)), good=z())
    arg(G, "broadcast(group=)", "group", lambda c, v: mg.broadcast(z(), v))
    arg(
        G,
        "broadcast(group_src=)",
        "misuse",
        lambda c, v: mg.broadcast(z(), w(c), group_src=v),
        ("group_src",),
        values=(-1, 1, True, 0.0, "0", None),
        only=True,
        good=0,
    )
    arg(G, "broadcast(async_op=)", "flag", lambda c, v: mg.broadcast(z(), w(c), async_op=v))
    arg(G, "broadcast(label=)", "text", lambda c, v: mg.broadcast(z(), w(c), label=v))
    # all_to_all
    splits = ("ab", [1.5], [-1], 4, [True], [5])
    arg(
        G,
        "all_to_all(output=)",
        "tensor",
        lambda c, v: mg.all_to_all(v, z(), w(c)),
        values=(z(8),),
        good=z(),
    )
    arg(G, "all_to_all(input=)", "tensor", lambda c, v: mg.all_to_all(z(), v, w(c)), good=z())
    arg(G, "all_to_all(group=)", "group", lambda c, v: mg.all_to_all(z(), z(), v))
    arg(
        G,
        "all_to_all(output_split_sizes=)",
        "misuse",
        lambda c, v: mg.all_to_all(z(), z(), w(c), output_split_sizes=v),
        ("output_split_sizes",),
        values=splits,
        only=True,
        good=[4],
    )
    arg(
        G,
        "all_to_all(input_split_sizes=)",
        "misuse",
        lambda c, v: mg.all_to_all(z(), z(), w(c), input_split_sizes=v),
        ("input_split_sizes",),
        values=splits,
        only=True,
        good=[4],
    )
    arg(G, "all_to_all(async_op=)", "flag", lambda c, v: mg.all_to_all(z(), z(), w(c), async_op=v))


def _other_collective_slots() -> None:
    ops = _OPS
    # point to point, barrier, objects
    peers = (0, 1, -1, True, "1", None)
    arg(
        G,
        "send(tensor=)",
        "tensor",
        lambda c, v: mg.send(v, w(c), group_dst=1),
        ("tensor", "group_dst"),
    )
    arg(
        G,
        "send(group=)",
        "group",
        lambda c, v: mg.send(z(), v, group_dst=1),
        ("group", "group_dst"),
        control=False,
    )
    arg(
        G,
        "send(group_dst=)",
        "misuse",
        lambda c, v: mg.send(z(), w(c), group_dst=v),
        ("group_dst",),
        values=peers,
        only=True,
    )
    arg(
        G,
        "recv(tensor=)",
        "tensor",
        lambda c, v: mg.recv(v, w(c), group_src=1),
        ("tensor", "group_src"),
    )
    arg(
        G,
        "recv(group=)",
        "group",
        lambda c, v: mg.recv(z(), v, group_src=1),
        ("group", "group_src"),
        control=False,
    )
    arg(
        G,
        "recv(group_src=)",
        "misuse",
        lambda c, v: mg.recv(z(), w(c), group_src=v),
        ("group_src",),
        values=peers,
        only=True,
    )
    arg(G, "barrier(group=)", "group", lambda c, v: mg.barrier(v))
    arg(G, "barrier(label=)", "text", lambda c, v: mg.barrier(w(c), label=v))
    arg(G, "all_gather_objects(group=)", "group", lambda c, v: mg.all_gather_objects(1, v))
    arg(
        G,
        "all_gather_objects(label=)",
        "text",
        lambda c, v: mg.all_gather_objects(1, w(c), label=v),
    )
    # coalesced batches
    arg(G, "coalesced(group=)", "group", lambda c, v: _batch(v))
    arg(G, "coalesced(async_op=)", "flag", lambda c, v: _batch(w(c), async_op=v))
    arg(
        G,
        "coalesced(device=)",
        "device",
        lambda c, v: _batch(w(c), device=v),
        values=([],),
        good=None,
    )
    arg(G, "coalesced(label=)", "text", lambda c, v: _batch(w(c), label=v))
    arg(
        G,
        "CoalescedBatch.all_reduce(tensor=)",
        "tensor",
        lambda c, v: _batch(w(c), lambda b: b.all_reduce(v)),
        good=z(),
    )
    arg(
        G,
        "CoalescedBatch.all_reduce(op=)",
        "misuse",
        lambda c, v: _batch(w(c), lambda b: b.all_reduce(z(), op=v)),
        ("op",),
        values=ops,
        only=True,
        good=mg.ReduceOp.SUM,
    )
    arg(
        G,
        "CoalescedBatch.reduce_scatter(output=)",
        "tensor",
        lambda c, v: _batch(w(c), lambda b: b.reduce_scatter(v, z())),
        values=(z(3),),
        good=z(),
    )
    arg(
        G,
        "CoalescedBatch.all_gather(input=)",
        "tensor",
        lambda c, v: _batch(w(c), lambda b: b.all_gather(z(), v)),
        values=(z(3),),
        good=z(),
    )
    # group queries and handles
    for name in ("group_size", "group_rank", "group_ranks"):
        arg(G, f"{name}(group=)", "group", lambda c, v, n=name: getattr(mg, n)(v))
    arg(
        G,
        "CollectiveHandle.wait(timeout=)",
        "real",
        lambda c, v: mg.all_reduce(z(), w(c), async_op=True).wait(timeout=v),
        ("timeout",),
        values=(-1.0, 0.0),
    )
    arg(
        G,
        "check_collective_schedule(enabled=)",
        "flag",
        lambda c, v: _enter(mg.check_collective_schedule(v)),
    )
    arg(
        G,
        "MC_CHECK_COLLECTIVE_SCHEDULE (env)",
        "misuse",
        _switch,
        ("MC_CHECK_COLLECTIVE_SCHEDULE",),
        values=("maybe", "2", "enable"),
        only=True,
        good="1",
    )


def _batch(group: Any, add: Callable[[Any], object] | None = None, **kw: Any) -> None:
    with mg.coalesced(group, **kw) as batch:
        if add is None:
            batch.all_reduce(z())
        else:
            add(batch)
    batch.handle.wait()


def _enter(manager: Any) -> None:
    with manager:
        pass


def _switch(ctx: Ctx, value: str) -> None:
    os.environ["MC_CHECK_COLLECTIVE_SCHEDULE"] = value
    mg.all_reduce(z(), ctx.world_group)
