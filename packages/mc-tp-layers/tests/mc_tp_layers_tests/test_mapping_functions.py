"""Megatron's names called the way Megatron's users and tests call them, on 4 ranks.

One world of 4 ranks, TP = 2 and DP = 2 (TP groups {0, 1} and {2, 3}) registered as the
default collection, runs every case once:

- the mappings' autograd Functions (``mc_tp_layers.mappings._CopyToModelParallelRegion``
  and its siblings): ``backward`` called directly with a plain ``ctx`` object holding
  only Megatron's attributes, ``symbolic(None, input_, group)`` (the forward without
  autograd), and ``_AllToAll`` through autograd with uneven splits;
- ``split_tensor_into_1d_equal_chunks`` / ``gather_split_1d_tensor`` with the default
  group and an explicit one;
- ``checkpoint(..., distribute_saved_activations=True, ...)``: the saved input is this
  rank's 1-D half between forward and backward, and the gradients equal the plain run's.

Every expected value is a small integer derived by hand (exact in fp32, compared with
``torch.equal``); every collective is recorded with the ranks of its group, which must
be this rank's TP group.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers import mappings as mp
from mc_tp_layers.mappings import all_to_all
from mc_tp_layers.random import checkpoint
from mc_tp_layers.utils import gather_split_1d_tensor, split_tensor_into_1d_equal_chunks
from mc_tp_layers_tests._helpers import backward, grad, world

_Call = Callable[[], Any]


def _recorded(call: _Call) -> tuple[Any, list[tuple[str, tuple[int, ...]]]]:
    with mg.record_collectives() as log:
        out = call()
    return out, [(e.op, e.group_ranks) for e in log]


def _rows(values: list[float], width: int) -> torch.Tensor:
    """A ``[len(values), width]`` tensor whose row j is ``values[j]``."""
    return torch.tensor(values).unsqueeze(1).expand(-1, width).contiguous()


class _Ctx:
    """Megatron's tests' stand-in for autograd's ctx: attributes only."""

    def __init__(self, **fields: object) -> None:
        self.__dict__.update(fields)


def _functions(group: torch.distributed.ProcessGroup, r: int) -> dict[str, Any]:
    one = torch.ones(1) * r
    table = torch.arange(16.0).reshape(4, 4)
    gs = _Ctx(
        group=group, tensor_parallel_output_grad=True, output_split_sizes=None,
        use_global_buffer=False,
    )  # fmt: skip
    gs_split = _Ctx(**{**gs.__dict__, "tensor_parallel_output_grad": False})
    rs = _Ctx(group=group, input_split_sizes=None, use_global_buffer=False)
    plain = _Ctx(group=group)
    cases: dict[str, _Call] = {
        "copy_bwd": lambda: mp._CopyToModelParallelRegion.backward(plain, one),
        "copy_sym": lambda: mp._CopyToModelParallelRegion.symbolic(None, one, group),
        "reduce_sym": lambda: mp._ReduceFromModelParallelRegion.symbolic(None, one, group),
        "reduce_bwd": lambda: mp._ReduceFromModelParallelRegion.backward(plain, one),
        "scatter_bwd": lambda: mp._ScatterToModelParallelRegion.backward(plain, torch.ones(2) * r),
        "scatter_sym": lambda: mp._ScatterToModelParallelRegion.symbolic(None, table, group),
        "gather_bwd": lambda: mp._GatherFromModelParallelRegion.backward(plain, table),
        "gather_sym": lambda: mp._GatherFromModelParallelRegion.symbolic(
            None, torch.ones(2) * r, group
        ),
        "scatter_sp_sym": lambda: mp._ScatterToSequenceParallelRegion.symbolic(None, table, group),
        "scatter_sp_bwd": lambda: mp._ScatterToSequenceParallelRegion.backward(
            plain, torch.ones(1, 4) * r
        ),
        "gather_sp_sym": lambda: mp._GatherFromSequenceParallelRegion.symbolic(
            None, torch.ones(1, 4) * r, group
        ),
        "gather_sp_bwd": lambda: mp._GatherFromSequenceParallelRegion.backward(
            gs, _rows([0.0, 1.0], 4)
        ),
        "gather_sp_bwd_split": lambda: mp._GatherFromSequenceParallelRegion.backward(
            gs_split, _rows([0.0, 1.0], 4)
        ),
        "rs_sp_sym": lambda: mp._ReduceScatterToSequenceParallelRegion.symbolic(
            None, _rows([0.0, 1.0], 4), group
        ),
        "rs_sp_bwd": lambda: mp._ReduceScatterToSequenceParallelRegion.backward(
            rs, torch.ones(1, 4) * r
        ),
        "ag_last_sym": lambda: mp._AllGatherFromTensorParallelRegion.symbolic(
            None, torch.ones(3, 1) * r, group
        ),
        "ag_last_bwd": lambda: mp._AllGatherFromTensorParallelRegion.backward(plain, table[:3]),
        "rs_last_sym": lambda: mp._ReduceScatterToTensorParallelRegion.symbolic(
            None, table[:3], group
        ),
        "rs_last_bwd": lambda: mp._ReduceScatterToTensorParallelRegion.backward(
            plain, torch.ones(3, 2) * r
        ),
    }
    out: dict[str, Any] = {name: _recorded(call) for name, call in cases.items()}
    out["reduce_input_after"] = one
    out["copy_sym_is_input"] = out["copy_sym"][0] is one
    out["reduce_bwd_is_grad"] = out["reduce_bwd"][0][0] is one
    return out


def _all_to_all(group: torch.distributed.ProcessGroup, t: int) -> dict[str, Any]:
    """Rank t sends ``sends[t][j]`` rows to rank j; row i of rank t's input is 10·t + i."""
    sends = [[1, 2], [3, 1]]
    ins = sends[t]
    outs = [sends[0][t], sends[1][t]]
    x = (10.0 * t + torch.arange(float(sum(ins)))).unsqueeze(1).requires_grad_()
    y, fwd = _recorded(lambda: all_to_all(group, x, outs, ins, use_nccl_stream=True))
    ctx = _Ctx(group=group, output_split_sizes=outs, input_split_sizes=ins, use_nccl_stream=False)
    direct, _ = _recorded(lambda: mp._AllToAll.backward(ctx, y.detach()))
    _, bwd = _recorded(lambda: backward(y, y.detach()))
    return {
        "y": y.detach(),
        "node": type(y.grad_fn).__name__,
        "dx": x.grad,
        "x": x.detach(),
        "direct": direct,
        "fwd": fwd,
        "bwd": bwd,
    }


def _split_helpers(group: torch.distributed.ProcessGroup, t: int) -> dict[str, Any]:
    whole = torch.arange(12.0).reshape(3, 4)
    view = split_tensor_into_1d_equal_chunks(whole)  # default collection's tp
    copy = split_tensor_into_1d_equal_chunks(whole, new_buffer=True, tp_group=group)
    gathered, log = _recorded(lambda: gather_split_1d_tensor(torch.ones(2, 2) * t))
    errors = {}
    bad: dict[str, _Call] = {
        "odd": lambda: split_tensor_into_1d_equal_chunks(torch.ones(3)),
        "strided": lambda: split_tensor_into_1d_equal_chunks(whole.t()),
    }
    for name, call in bad.items():
        try:
            call()
        except ValueError as err:
            errors[name] = str(err)
    return {
        "view": view,
        "view_shares": view.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(),
        "copy": copy,
        "copy_shares": copy.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr(),
        "gathered": gathered,
        "gather_log": log,
        "errors": errors,
    }


def _distributed_checkpoint(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    tracker = tpl.model_parallel_cuda_manual_seed(
        9, pg_collection=pgc, device="cpu", set_default=False
    )
    gen = torch.Generator().manual_seed(100 + mg.group_ranks(pgc.require("tp", "t"))[0])
    x0 = torch.randn(4, 4, generator=gen)  # identical on TP mates, as hidden states are
    w0 = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))

    def block(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        with tracker.fork():
            return torch.nn.functional.dropout(x @ w, 0.5)

    states = tracker.get_states()
    x1, w1 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    backward(block(x1, w1), torch.ones(4, 4))
    tracker.set_states(states)
    x2, w2 = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    y, fwd = _recorded(lambda: checkpoint(block, True, x2, w2, rng_tracker=tracker))
    shape_between = tuple(x2.data.shape)
    part = x2.data.clone()
    _, bwd = _recorded(lambda: backward(y, torch.ones(4, 4)))
    return {
        "shape_between": shape_between,
        "part": part,
        "x0": x0,
        "restored": torch.equal(x2.detach(), x0),
        "grads_equal": all(torch.equal(grad(a), grad(b)) for a, b in ((x1, x2), (w1, w2))),
        "fwd": fwd,
        "bwd": bwd,
    }


def _everything() -> dict[str, Any]:
    pgc = world(2, set_default=True)
    try:
        r = torch.distributed.get_rank()
        group = pgc.require("tp", "test")
        return {
            "functions": _functions(group, r),
            "all_to_all": _all_to_all(group, r % 2),
            "split": _split_helpers(group, r % 2),
            "checkpoint": _distributed_checkpoint(pgc),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.fixture(scope="module")
def results(rank_pools: RankPools) -> list[dict[str, Any]]:
    return rank_pools.get(4).run(_everything)


def _mates(r: int) -> tuple[int, int]:
    return (0, 1) if r < 2 else (2, 3)


def test_functions_called_directly(results: list[dict[str, Any]]) -> None:
    """Each Function's ``backward`` with a bare ctx and its ``symbolic`` give Megatron's
    values, with exactly the collective of the mapping over this rank's TP group."""
    table = torch.arange(16.0).reshape(4, 4)
    for r, res in enumerate(results):
        f, t, mates = res["functions"], r % 2, _mates(r)
        m0, m1 = mates
        total = float(sum(mates))

        def tp(op: str, mates: tuple[int, int] = mates) -> list[tuple[str, tuple[int, int]]]:
            return [(op, mates)]

        expected: dict[str, tuple[Any, list[Any]]] = {
            "copy_bwd": ((torch.ones(1) * total, None), tp("all_reduce")),
            "copy_sym": (torch.ones(1) * r, []),
            "reduce_sym": (torch.ones(1) * total, tp("all_reduce")),
            "reduce_bwd": ((torch.ones(1) * r, None), []),
            "scatter_bwd": (
                (torch.tensor([m0, m0, m1, m1], dtype=torch.float32), None),
                tp("all_gather"),
            ),
            "scatter_sym": (table[:, 2 * t : 2 * t + 2], []),
            "gather_bwd": ((table[:, 2 * t : 2 * t + 2], None), []),
            "gather_sym": (torch.tensor([m0, m0, m1, m1], dtype=torch.float32), tp("all_gather")),
            "scatter_sp_sym": (table[2 * t : 2 * t + 2], []),
            "scatter_sp_bwd": ((_rows([m0, m1], 4), None), tp("all_gather")),
            "gather_sp_sym": (_rows([m0, m1], 4), tp("all_gather")),
            # row j of the gradient is j on both ranks: the sum keeps 2·t on rank t
            "gather_sp_bwd": ((torch.ones(1, 4) * 2 * t, *[None] * 4), tp("reduce_scatter")),
            "gather_sp_bwd_split": ((torch.ones(1, 4) * t, *[None] * 4), []),
            "rs_sp_sym": (torch.ones(1, 4) * 2 * t, tp("reduce_scatter")),
            "rs_sp_bwd": ((_rows([m0, m1], 4), None, None, None), tp("all_gather")),
            "ag_last_sym": (_rows([m0, m1], 3).t(), tp("all_gather")),
            "ag_last_bwd": ((2 * table[:3, 2 * t : 2 * t + 2], None), tp("reduce_scatter")),
            "rs_last_sym": (2 * table[:3, 2 * t : 2 * t + 2], tp("reduce_scatter")),
            "rs_last_bwd": ((_rows([m0, m0, m1, m1], 3).t(), None), tp("all_gather")),
        }
        for name, (value, log) in expected.items():
            got, got_log = f[name]
            assert got_log == log, (r, name)
            if isinstance(value, tuple):
                assert len(got) == len(value), (r, name)
                assert torch.equal(got[0], value[0]), (r, name, got[0])
                assert all(g is None for g in got[1:]), (r, name)
            else:
                assert torch.equal(got, value), (r, name, got)
        # mc's reduce never writes into its input (Megatron's reduces in place)
        assert torch.equal(f["reduce_input_after"], torch.ones(1) * r)
        assert f["copy_sym_is_input"]
        assert f["reduce_bwd_is_grad"]


def test_all_to_all_function_round_trips(results: list[dict[str, Any]]) -> None:
    """Uneven all-to-all: rank 0 receives 1 row from itself and 3 from rank 1, rank 1
    receives 2 and 1; backward (through autograd and called directly with Megatron's ctx
    fields) sends every row back to its origin, so the gradient of ``y`` fed ``y`` is
    the input itself."""
    for r, res in enumerate(results):
        a = res["all_to_all"]
        first, second = _mates(r)
        if r % 2 == 0:
            rows = [10.0 * 0 + 0, 10.0 * 1 + 0, 10.0 * 1 + 1, 10.0 * 1 + 2]
        else:
            rows = [1.0, 2.0, 10.0 + 3]
        assert torch.equal(a["y"], torch.tensor(rows).unsqueeze(1)), r
        assert a["node"] == "_AllToAllBackward"
        assert torch.equal(a["dx"], a["x"])
        assert a["direct"][0] is None
        assert a["direct"][2:] == (None, None, None)
        assert torch.equal(a["direct"][1], a["x"])
        assert a["fwd"] == [("all_to_all", (first, second))]
        assert a["bwd"] == [("all_to_all", (first, second))]


def test_1d_split_and_gather(results: list[dict[str, Any]]) -> None:
    """Rank t of the TP group keeps flat elements ``[6t, 6t + 6)`` of a ``[3, 4]`` tensor
    (a view by default, a copy with ``new_buffer``); the gather concatenates every mate's
    flattened tensor in rank order with one all-gather."""
    for r, res in enumerate(results):
        s, t = res["split"], r % 2
        part = torch.arange(6.0 * t, 6.0 * t + 6)
        assert torch.equal(s["view"], part)
        assert s["view_shares"]
        assert torch.equal(s["copy"], part)
        assert not s["copy_shares"]
        first, second = _mates(r)
        assert torch.equal(s["gathered"], torch.tensor([0.0] * 4 + [1.0] * 4))
        assert s["gather_log"] == [("all_gather", (first, second))]
        assert "3 elements" in s["errors"]["odd"]
        assert "new_buffer=True" in s["errors"]["strided"]


def test_checkpoint_distributes_the_saved_input(results: list[dict[str, Any]]) -> None:
    """``distribute_saved_activations=True``: between forward and backward ``x.data`` is
    this rank's 8 of 16 elements (Megatron's ``input1.data.shape == (8,)``); backward
    all-gathers it over the TP group (the only collective), restores ``x`` and gives the
    plain run's gradients bit for bit, dropout included."""
    for r, res in enumerate(results):
        c, t = res["checkpoint"], r % 2
        assert c["shape_between"] == (8,)
        assert torch.equal(c["part"], c["x0"].reshape(-1)[8 * t : 8 * t + 8])
        assert c["restored"], r
        assert c["grads_equal"], r
        assert c["fwd"] == []
        assert c["bwd"] == [("all_gather", _mates(r))]
