"""The pieces of the guarded step that need no processes: which rank counts a param in the
global grad norm (``counts_in_grad_norm``, by hand-made attributes and coordinates), and
``DynamicGradScaler`` against ``torch.amp.GradScaler`` over a sequence of overflows.

Independent references: the counting rule's table (``mc_ddp.grad_norm``), worked out by
hand for each kind of param at each coordinate; torch's own scaler on one CPU param (its
scale after every ``update()``, for overflows fed as an inf grad), compared exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from mc_ddp import DynamicGradScaler
from mc_ddp.grad_norm import GradNormRanks, counts_in_grad_norm
from mc_groups import param_attrs
from mc_groups.errors import InputTypeError, InputValueError

ORIGIN = GradNormRanks(tp=0, expt_tp=0, gtp_remat=0, expt_gtp_remat=0, embd=0, pp=0)


def _param(**attrs: object) -> torch.nn.Parameter:
    param = torch.nn.Parameter(torch.zeros(2))
    for name, value in attrs.items():
        setattr(param, name, value)
    return param


KINDS = {
    "plain": {},
    "tp_shard": {"tensor_model_parallel": True},
    "tp_summed": {"sum_gradients_across_tp_domain": True},
    "expert_shard": {"allreduce": False, "tensor_model_parallel": True},
    "expert_replica": {"allreduce": False},
    "gtp_shard": {"is_gtp_weight_remat": True, "tensor_model_parallel": True},
    "tied": {"shared_embedding": True, "tensor_model_parallel": True},
    "megatron_dup": {"shared": True, "shared_embedding": True},
    "pp_replica": {"pipeline_parallel": True},
}

# kind -> the coordinates (one axis moved off 0) at which it still counts
COUNTS_AT = {
    "plain": {"expt_tp", "expt_gtp_remat", "embd", "pp"},
    "tp_shard": {"tp", "expt_tp", "expt_gtp_remat", "embd", "pp"},
    "tp_summed": {"expt_tp", "expt_gtp_remat", "embd", "pp"},
    "expert_shard": {"tp", "expt_tp", "gtp_remat", "embd", "pp"},
    "expert_replica": {"tp", "gtp_remat", "embd", "pp"},
    "gtp_shard": {"tp", "expt_tp", "gtp_remat", "expt_gtp_remat", "embd", "pp"},
    "tied": {"tp", "expt_tp", "expt_gtp_remat", "pp"},
    "megatron_dup": set(),
    "pp_replica": {"expt_tp", "expt_gtp_remat", "embd"},
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_counts_on_the_first_copy_of_each_axis_it_is_replicated_over(
    kind: str,
) -> None:
    param = _param(**KINDS[kind])
    assert counts_in_grad_norm(param, ORIGIN) == (kind != "megatron_dup")
    for axis in ORIGIN._fields:
        moved = ORIGIN._replace(**{axis: 1})
        assert counts_in_grad_norm(param, moved) == (axis in COUNTS_AT[kind]), (kind, axis)
    if kind == "pp_replica":  # a copy on every virtual chunk: the first one counts
        assert not counts_in_grad_norm(param, ORIGIN, first_chunk=False)


def test_the_mark_accessors_read_what_the_markers_write() -> None:
    param = _param()
    assert not param_attrs.sums_grad_across_tp(param)
    param_attrs.mark_sum_gradients_across_tp_domain(param)
    assert param_attrs.sums_grad_across_tp(param)
    assert param_attrs.is_replicated_over_pp(_param(flextron_router_pp_sync=True))
    assert param_attrs.is_shared_duplicate(_param(shared=True))


def _torch_scales(overflows: list[bool], **kwargs: float) -> list[float]:
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    scaler = torch.amp.GradScaler("cpu", **kwargs)  # type: ignore[arg-type]
    scales = []
    for overflow in overflows:
        scaler.scale(torch.ones(()))  # torch sets its scale up at the first scale()
        param.grad = torch.full((1,), math.inf if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"init_scale": 1024.0, "growth_factor": 4.0, "backoff_factor": 0.25, "growth_interval": 2},
    ],
)
def test_dynamic_grad_scaler_follows_torch_grad_scaler(kwargs: dict[str, float]) -> None:
    overflows = [True, False, False, True, True, False, False, False, False, True, False]
    ours = DynamicGradScaler(
        initial_scale=kwargs.get("init_scale", 2.0**16),
        growth_factor=kwargs.get("growth_factor", 2.0),
        backoff_factor=kwargs.get("backoff_factor", 0.5),
        growth_interval=int(kwargs.get("growth_interval", 2000)),
    )
    scales = []
    for overflow in overflows:
        ours.update(overflow)
        scales.append(ours.scale)
    assert scales == _torch_scales(overflows, **kwargs)


def test_hysteresis_and_min_scale_follow_megatron() -> None:
    scaler = DynamicGradScaler(
        initial_scale=8.0, min_scale=2.0, backoff_factor=0.5, growth_interval=2, hysteresis=2
    )
    seen = []
    for overflow in [True, True, True, True, False, False, True]:
        scaler.update(overflow)
        seen.append(scaler.scale)
    # the first overflow is tolerated, then back off to the floor; growth resets hysteresis
    assert seen == [8.0, 4.0, 2.0, 2.0, 2.0, 4.0, 4.0]
    again = DynamicGradScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"initial_scale": 0.0}, InputValueError, "initial_scale=0.0 must be > 0"),
        ({"growth_factor": 1.0}, InputValueError, "growth_factor=1.0 must be > 1"),
        ({"backoff_factor": 0.0}, InputValueError, "backoff_factor=0.0 must be in (0, 1)"),
        ({"growth_interval": 0}, InputValueError, "growth_interval=0 must be >= 1"),
        ({"hysteresis": 1.5}, InputTypeError, "hysteresis=1.5 must be an int"),
        ({"min_scale": 4.0, "initial_scale": 2.0}, InputValueError, "min_scale=4.0 is above"),
    ],
)
def test_scaler_bad_input(kwargs: dict[str, float], error: type, text: str) -> None:
    with pytest.raises(error, match=text.replace("(", r"\(").replace(")", r"\)")):
        DynamicGradScaler(**kwargs)  # type: ignore[arg-type]
