"""ensure_params_ready and DDP's _BucketParamReadyCallback; the hooks under capture.

The in-process tests drive the callback's branches with fake DDP / bucket-group objects
(no processes): unmarked params, per-group dedup, CUDA-graph capture deferral, idempotence,
draining an in-flight gather, align_param_gather, removed pre-hooks, collected DDP or group.
Each test keeps a strong reference to its fake DDP (the callback holds it weakly, so a
temporary would be collected and make every call vacuous). The 2-rank tests check the real
thing: a read-ahead publishes exactly one group (one all-gather, values equal to the
single-process reference after one SGD step, fp32 |Δ| ≤ 1e-6 as in the parity matrix), a
second call communicates nothing, and a collected DDP leaves a harmless callback behind;
a backward while the probe reads "capturing" leaves every ``main_grad`` at zero and
autograd's ``param.grad`` in place, and the same backward after it accumulates exactly that
gradient into ``main_grad``.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp import PARAM_READY_CALLBACK_ATTR, ensure_params_ready
from mc_ddp import distributed_data_parallel as ddp_module
from mc_ddp import hooks as param_ready
from mc_ddp.distributed_data_parallel import DistributedDataParallel, _BucketParamReadyCallback
from mc_ddp_tests._harness import GATHER_OP, ddp_config, main_grad, mlp, model_parallel
from mc_ddp_tests.test_param_sync import _trained
from mc_groups.testing import RankPools


class _FakeConfig:
    def __init__(self, align_param_gather: bool) -> None:
        self.align_param_gather = align_param_gather


class _FakeDDP:
    # the real probe: DDP's hooks and callbacks ask their DDP, which reads its module's
    # ``is_graph_capturing`` at each call (where Megatron-Core's tests patch it)
    _graph_capturing = staticmethod(DistributedDataParallel._graph_capturing)

    def __init__(self, align_param_gather: bool = False, hooks_enabled: bool = True) -> None:
        self.ddp_config = _FakeConfig(align_param_gather)
        self.overlap_param_gather_with_optimizer_step = False
        self.remove_forward_pre_hook_handles = {object(): object()} if hooks_enabled else {}
        self.seen: list[str] = []

    def _on_grad_ready(self, param: torch.nn.Parameter, index: int) -> None:
        self.seen.append(f"grad {index}")

    def _on_module_forward(self, module: torch.nn.Module) -> None:
        self.seen.append("forward")


class _FakeBucketGroup:
    def __init__(self, dispatched: bool = False, in_flight: bool = False) -> None:
        self.finished: list[bool] = []
        self.param_gather_dispatched = dispatched
        self.param_gather_handle: object | None = object() if in_flight else None

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        self.finished.append(skip_next_bucket_dispatch)
        self.param_gather_dispatched = True
        self.param_gather_handle = None


def _callback(ddp: _FakeDDP, group: _FakeBucketGroup) -> _BucketParamReadyCallback:
    return _BucketParamReadyCallback(ddp, group)  # type: ignore[arg-type]


def test_unmarked_params_need_nothing() -> None:
    ensure_params_ready([torch.nn.Parameter(torch.zeros(2))])


def test_callbacks_are_called_once_per_group_in_order() -> None:
    calls: list[str] = []
    first, second, third, plain = (torch.nn.Parameter(torch.zeros(1)) for _ in range(4))
    shared, other = (lambda: calls.append("shared")), (lambda: calls.append("other"))
    setattr(first, PARAM_READY_CALLBACK_ATTR, shared)
    setattr(second, PARAM_READY_CALLBACK_ATTR, shared)
    setattr(third, PARAM_READY_CALLBACK_ATTR, other)
    ensure_params_ready([first, second, plain, first, third])
    assert calls == ["shared", "other"]


def test_graph_capture_defers_publication(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under capture nothing is published (a captured gather would rerun at every replay);
    the first call outside capture publishes. The probe is patched in the DDP module."""
    ddp, group = _FakeDDP(), _FakeBucketGroup()
    param = torch.nn.Parameter(torch.zeros(1))
    setattr(param, PARAM_READY_CALLBACK_ATTR, _callback(ddp, group))
    capturing = [True]
    monkeypatch.setattr(ddp_module, "is_graph_capturing", lambda: capturing[0])
    ensure_params_ready([param])
    assert group.finished == []
    assert not group.param_gather_dispatched
    capturing[0] = False
    ensure_params_ready([param])
    assert group.finished == [False]
    assert group.param_gather_dispatched


def test_hooks_hand_over_or_do_nothing_under_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """The forward pre-hook asks the probe (patched in the DDP module); the backward hook
    hands its param and index to the DDP, whose ``_on_grad_ready`` asks the same probe
    (see ``_backward_under_capture``), and does nothing once the DDP is collected."""
    ddp = _FakeDDP()
    param, module = torch.nn.Parameter(torch.zeros(1)), torch.nn.Linear(1, 1)
    grad_hook = ddp_module.BackwardPostHook(ddp, param, 7)
    forward_hook = param_ready.ForwardPreHook(ddp)
    capturing = [True]
    monkeypatch.setattr(ddp_module, "is_graph_capturing", lambda: capturing[0])
    forward_hook(module, ())
    assert ddp.seen == []
    capturing[0] = False
    grad_hook(param)
    forward_hook(module, ())
    assert ddp.seen == ["grad 7", "forward"]
    orphan = ddp_module.BackwardPostHook(_FakeDDP(), param, 0)
    gc.collect()
    orphan(param)


def test_publishes_once_then_is_idempotent() -> None:
    ddp, group = _FakeDDP(), _FakeBucketGroup()
    callback = _callback(ddp, group)
    callback()
    callback()
    assert group.finished == [False]


def test_in_flight_gather_is_drained_and_chains() -> None:
    ddp, group = _FakeDDP(), _FakeBucketGroup(dispatched=True, in_flight=True)
    _callback(ddp, group)()
    assert group.finished == [False]


def test_align_param_gather_never_chains() -> None:
    ddp, group = _FakeDDP(align_param_gather=True), _FakeBucketGroup()
    _callback(ddp, group)()
    assert group.finished == [True]


def test_removed_pre_hooks_start_nothing_but_drain_in_flight() -> None:
    ddp = _FakeDDP(hooks_enabled=False)
    idle, busy = _FakeBucketGroup(), _FakeBucketGroup(dispatched=True, in_flight=True)
    _callback(ddp, idle)()
    _callback(ddp, busy)()
    assert idle.finished == []
    assert busy.finished == [True]  # drained without chaining: the caller owns the schedule


def test_collected_group_or_ddp_is_a_noop() -> None:
    ddp, group = _FakeDDP(), _FakeBucketGroup()
    dead_group = _callback(ddp, _FakeBucketGroup())
    dead_ddp = _callback(_FakeDDP(), group)
    gc.collect()
    dead_group()
    dead_ddp()
    assert group.finished == []


def _read_ahead() -> dict[str, Any]:
    with model_parallel() as pgc:
        ddp, ref = _trained(pgc)
        model: Any = ddp.module
        ref_model: Any = ref.model
        out_weight = model[4].weight
        with mg.record_collectives() as log:
            ensure_params_ready([out_weight, model[4].bias])  # both in group 0
            first = [(r.op, r.label) for r in log]
            ensure_params_ready([out_weight])
            second = len(log) - len(first)
        err = float((out_weight.detach() - ref_model[4].weight.detach()).abs().max())
        callback = getattr(out_weight, PARAM_READY_CALLBACK_ATTR)
        ddp.free_overlap_buffers()  # the chained gathers of the other groups
        ddp_ref = weakref.ref(ddp)
        del ddp
        gc.collect()
        with mg.record_collectives() as log:
            callback()
        return {
            "first": first,
            "second": second,
            "err": err,
            "collected": ddp_ref() is None,
            "after_collect": len(log),
            "rank": dist.get_rank(),
        }


def _backward_under_capture() -> dict[str, Any]:
    with model_parallel() as pgc:
        config = ddp_config(overlap_grad_reduce=True)
        ddp = DistributedDataParallel(mg.ModelParallelConfig(), config, mlp(), pg_collection=pgc)
        params = list(ddp.module.parameters())
        x = torch.linspace(-1.0, 1.0, 16).reshape(2, 8)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(ddp_module, "is_graph_capturing", lambda: True)
            ddp(x).square().sum().backward()
        autograd = [None if p.grad is None else p.grad.clone() for p in params]
        zero = all(float(main_grad(p).abs().max()) == 0.0 for p in params)
        for p in params:
            p.grad = None
        ddp(x).square().sum().backward()
        err = max(
            float((main_grad(p) - g).abs().max()) if g is not None else float("inf")
            for p, g in zip(params, autograd, strict=True)
        )
        left = sum(p.grad is not None for p in params)
        ddp.finish_grad_sync()
        return {"zero": zero, "err": err, "left": left}


def test_backward_under_capture_leaves_grads_to_autograd(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_backward_under_capture):
        assert out["zero"]  # nothing reached main_grad while "capturing"
        assert out["err"] == 0.0  # then main_grad = autograd's gradient, bit for bit
        assert out["left"] == 0  # and param.grad was dropped


def test_read_ahead_publishes_one_group_once(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_read_ahead):
        assert out["first"] == [(GATHER_OP, "param gather dense bucket group 0")]
        assert out["second"] == 0
        assert out["err"] <= 1e-6
        assert out["collected"]
        assert out["after_collect"] == 0
