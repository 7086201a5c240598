"""ShardedOptimizer beyond the parity matrix (2 gloo ranks): state_dict round trip with Adam,
per-group hyperparameters, and its input errors.

Localizes the wrapper's bookkeeping (masters per owned slice, param groups, saved state),
not the math (the parity matrix covers SGD against the reference). The round trip compares
two runs of identical fp32 arithmetic, so they must agree exactly (Δ = 0); the lr = 0 group
must leave its params bit-identical.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import DistributedDataParallel, ShardedOptimizer, ensure_params_ready
from mc_ddp_tests._catalogue import Expect, assert_fails_as
from mc_ddp_tests._harness import (
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools, error_kind


def _wrap(pgc: Any, seed: int) -> tuple[DistributedDataParallel, ShardedOptimizer]:
    cfg = ddp_config(
        overlap_grad_reduce=True,
        overlap_param_gather=True,
        use_distributed_optimizer=True,
        bucket_size=16,
    )
    ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, mlp(seed=seed), pg_collection=pgc)
    return ddp, ShardedOptimizer(torch.optim.Adam(ddp.parameters(), lr=0.01), ddp)


def _train_step(ddp: DistributedDataParallel, opt: ShardedOptimizer, step: int) -> None:
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    ddp.zero_grad_buffer()
    ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
    ddp.finish_grad_sync()
    opt.step()
    ensure_params_ready(list(ddp.parameters()))


def _rows(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    return local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank())


def _flat(ddp: DistributedDataParallel) -> torch.Tensor:
    return torch.cat([p.detach().view(-1) for p in ddp.parameters()])


def _round_trip() -> dict[str, float]:
    with model_parallel() as pgc:
        ddp, opt = _wrap(pgc, seed=1)
        for step in range(2):
            _train_step(ddp, opt, step)
        saved_model, saved_opt = ddp.state_dict(), opt.state_dict()
        other, other_opt = _wrap(pgc, seed=2)
        before = float((_flat(other) - _flat(ddp)).abs().max())
        other.load_state_dict(saved_model)
        with mg.record_collectives() as log:
            other_opt.load_state_dict(saved_opt)
        loaded = float((_flat(other) - _flat(ddp)).abs().max())
        _train_step(ddp, opt, 2)
        _train_step(other, other_opt, 2)
        return {
            "before": before,
            "loaded": loaded,
            "continued": float((_flat(other) - _flat(ddp)).abs().max()),
            "gathers": sum(r.label.startswith("param gather") for r in log),
            "groups": len(ddp.bucket_groups),
        }


def test_state_dict_round_trip_continues_identically(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_round_trip):
        assert out["before"] > 0.1  # different init: the load has something to do
        assert out["loaded"] == 0.0
        assert out["continued"] == 0.0
        assert out["gathers"] == out["groups"]  # load publishes the masters to every rank


def _param_groups() -> dict[str, Any]:
    with model_parallel() as pgc:
        cfg = ddp_config(use_distributed_optimizer=True)
        model = mlp()
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, model, pg_collection=pgc)
        weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
        groups: list[dict[str, Any]] = [{"params": weights}, {"params": biases, "lr": 0.0}]
        inner = torch.optim.SGD(groups, lr=0.5)
        opt = ShardedOptimizer(inner, ddp)
        start = [p.detach().clone() for p in model.parameters()]
        _train_step(ddp, opt, 0)
        changed = {
            n: bool((p.detach() != s).any())
            for (n, p), s in zip(model.named_parameters(), start, strict=True)
        }
        owned = [sum(m.numel() for m in g["params"]) for g in opt.param_groups]
        return {"changed": changed, "owned": owned, "lrs": [g["lr"] for g in opt.param_groups]}


def test_param_groups_keep_their_hyperparameters(rank_pools: RankPools) -> None:
    results = rank_pools.get(2).run(_param_groups)
    for out in results:
        assert out["lrs"] == [0.5, 0.0]
        assert out["changed"] == {
            "0.weight": True,
            "0.bias": False,
            "2.weight": True,
            "2.bias": False,
            "4.weight": True,
            "4.bias": False,
        }
    # the two ranks' masters partition the 484 params (padding is owned by nobody)
    assert [sum(x) for x in zip(*(out["owned"] for out in results), strict=True)] == [
        8 * 16 + 16 * 16 + 16 * 4,
        16 + 16 + 4,
    ]


def _errors() -> dict[str, str]:
    found: dict[str, str] = {}
    with model_parallel() as pgc:
        cfg = ddp_config(use_distributed_optimizer=True)
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), cfg, mlp(), pg_collection=pgc)
        stranger = torch.nn.Parameter(torch.zeros(3))
        busy = torch.optim.SGD(ddp.parameters(), lr=0.1)
        busy.state[next(iter(ddp.parameters()))]["momentum_buffer"] = torch.zeros(1)
        chunk: Any = ddp.module
        cases: dict[str, Callable[[], object]] = {
            "stateful": lambda: ShardedOptimizer(busy, ddp),
            "stranger": lambda: ShardedOptimizer(torch.optim.SGD([stranger], lr=0.1), ddp),
            "not_ddp": lambda: ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), [chunk]),
            "lbfgs": lambda: ShardedOptimizer(torch.optim.LBFGS(ddp.parameters()), ddp),
            "not_optimizer": lambda: ShardedOptimizer(object(), ddp),  # type: ignore[arg-type]
            "step_dispatch": lambda: ShardedOptimizer(
                torch.optim.SGD(ddp.parameters(), lr=0.1),
                ddp,
                overlap_param_gather_with_optimizer_step=True,
            ),
        }
        opt = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
        cases["step_before_finish"] = opt.step
        cases["bad_state"] = lambda: opt.load_state_dict({"master_params": [], "optimizer": {}})
        good = opt.state_dict()
        loose: Any = opt
        cases["load_none"] = lambda: loose.load_state_dict(None)
        cases["load_str"] = lambda: loose.load_state_dict("x")
        cases["load_empty"] = lambda: opt.load_state_dict({})
        cases["load_shapes"] = lambda: opt.load_state_dict(
            {**good, "master_params": [m.view(1, -1) for m in good["master_params"]]}
        )
        cases["load_inner"] = lambda: opt.load_state_dict({**good, "optimizer": None})
        cases["zero_grad_flag"] = lambda: loose.zero_grad(set_to_none="no")
        twice_ddp, twice = _wrap(pgc, seed=3)
        _train_step(twice_ddp, twice, 0)  # communicates: before the recorded window
        cases["step_twice"] = twice.step
        offloaded_ddp, offloaded = _wrap(pgc, seed=4)
        _train_step(offloaded_ddp, offloaded, 0)
        offloaded_ddp.zero_grad_buffer()
        ddp_backward(offloaded_ddp, *_rows(1), 1)
        offloaded_ddp.finish_grad_sync()
        offloaded_ddp.offload_grad_buffers()
        cases["step_offloaded"] = offloaded.step
        restored_ddp, restored = _wrap(pgc, seed=5)
        _train_step(restored_ddp, restored, 0)
        restored_ddp.zero_grad_buffer()
        ddp_backward(restored_ddp, *_rows(1), 1)
        restored_ddp.finish_grad_sync()
        restored_ddp.offload_grad_buffers()
        restored_ddp.restore_grad_buffers()
        cases["step_discarded"] = restored.step
        with mg.record_collectives() as log:
            for name, call in cases.items():
                try:
                    call()
                except (TypeError, ValueError, RuntimeError) as err:
                    found[name] = f"{error_kind(err)}: {err}"
        found["collectives"] = str(len(log))
    return found


_CALL = "`ShardedOptimizer(optimizer, ddp)`"

ERRORS = {
    "stateful": Expect(
        "ValueError: optimizer already holds state",
        doc_call=_CALL,
        doc_input="optimizer that already holds state",
    ),
    "stranger": Expect(
        "ValueError: optimizer.param_groups[0]",
        doc_call=_CALL,
        doc_input="a param DDP does not own",
    ),
    "not_ddp": Expect(
        "TypeError: model_chunks[0] is a torch.nn.modules.container.Sequential",
        doc_call="`ShardedOptimizer(optimizer, model_chunks)`",
        doc_input="a plain module",
    ),
    "lbfgs": Expect("TypeError: optimizer=LBFGS", doc_call=_CALL, doc_input="`LBFGS`"),
    "not_optimizer": Expect("TypeError: optimizer=object", doc_call=_CALL, doc_input="`object()`"),
    "step_dispatch": Expect(
        "ValueError: overlap_param_gather_with_optimizer_step=True needs every model chunk",
        doc_call="`ShardedOptimizer(..., overlap_param_gather_with_optimizer_step=True)`",
        doc_input="chunks without param-gather overlap",
    ),
    "step_before_finish": Expect(
        "RuntimeError: step(): ['dense bucket",
        doc_call="`opt.step()`",
        doc_input="before `finish_grad_sync()` (call order)",
        also=("finish_grad_sync()",),
    ),
    "bad_state": Expect(
        "ValueError: state_dict['master_params']",
        doc_call="`opt.load_state_dict(sd)`",
        doc_input="`master_params` of the wrong length",
    ),
}


ERRORS.update(
    {
        "load_none": Expect(
            "TypeError: state_dict must be the mapping ShardedOptimizer.state_dict() returned, "
            "got NoneType",
            doc_call="`opt.load_state_dict(sd)`",
            doc_input="`None` (AttributeError before)",
        ),
        "load_str": Expect(
            "TypeError: state_dict must be the mapping",
            doc_call="`opt.load_state_dict(sd)`",
            doc_input="`'x'`",
        ),
        "load_empty": Expect(
            "ValueError: state_dict has no ['master_params', 'optimizer']",
            doc_call="`opt.load_state_dict(sd)`",
            doc_input="`{}`",
        ),
        "load_shapes": Expect(
            "ValueError: state_dict['master_params'] does not match this rank's shard layout",
            doc_call="`opt.load_state_dict(sd)`",
            doc_input="masters of the right numel but the wrong shape",
            also=("expected tensors of shapes",),
        ),
        "load_inner": Expect(
            "TypeError: state_dict['optimizer'] must be the wrapped optimizer's state dict",
            doc_call="`opt.load_state_dict(sd)`",
            doc_input="`'optimizer': None`",
        ),
        "zero_grad_flag": Expect(
            "TypeError: set_to_none='no' must be a bool",
            doc_call="`opt.zero_grad(set_to_none=)`",
            doc_input="`'no'`",
        ),
        "step_twice": Expect(
            "RuntimeError: step(): this optimizer already stepped on this iteration's "
            "gradients; a second step would apply them twice",
            doc_call="`opt.step()`",
            doc_input="twice without a new backward (double update before)",
            also=("zero_grad_buffer()",),
        ),
        "step_offloaded": Expect(
            "RuntimeError: step(): the grad buffers are offloaded (offload_grad_buffers())",
            doc_call="`opt.step()`",
            doc_input="after `ddp.offload_grad_buffers()` (torch's storage error before)",
            also=("restore_grad_buffers() first",),
        ),
        "step_discarded": Expect(
            "RuntimeError: step(): offload_grad_buffers() discarded this iteration's gradients",
            doc_call="`opt.step()`",
            doc_input="after offload and restore (a step on zeroed grads before)",
            also=("zero_grad_buffer()",),
        ),
    }
)


def test_bad_input_is_rejected_before_any_collective(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_errors):
        assert found["collectives"] == "0"
        for name, expect in ERRORS.items():
            assert_fails_as(name, found[name], expect)


@pytest.mark.parametrize("bad", [None, []])
def test_model_chunks_must_be_ddp(bad: Any) -> None:
    with pytest.raises(TypeError, match="model_chunks"):
        ShardedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1), bad)
