"""mc-ddp's bad-input catalogue: bad input and calls out of order, each a clear error raised
before any collective.

Localizes argument validation (module, devices, configs, process groups, the methods' and
the fp32-accumulating reduce-scatter's arguments) and the state machine's guards (finish
before start, a second start, zero/offload with a reduction in flight, gradients after
finish, unused params under overlap, param-sync calls without the distributed optimizer).
Each case runs under the recorder on 2 gloo ranks and must leave the log empty; messages
are matched on the words that name the argument, the value and the fix (listed in
``docs/bad_inputs.md``). No numeric tolerance.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mc_groups as mg
from mc_ddp import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    reduce_scatter_with_fp32_accumulation,
)
from mc_ddp_tests._catalogue import Expect, assert_fails_as
from mc_ddp_tests._harness import (
    ddp_backward,
    ddp_config,
    global_batch,
    local_rows,
    mlp,
    model_parallel,
)
from mc_groups.testing import RankPools

MP = mg.ModelParallelConfig()


def _attempt(call: Callable[[], object]) -> tuple[str, int]:
    """(``ErrorType: message`` or ``"no error"``, collectives issued during the call)."""
    with mg.record_collectives() as log:
        try:
            call()
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as err:
            return f"{type(err).__name__}: {err}", len(log)
    return "no error", len(log)


def _frozen() -> nn.Module:
    model = mlp()
    model.requires_grad_(False)
    return model


def _mixed_devices() -> nn.Module:
    model = mlp()
    model[4].to("meta")
    return model


def _expert() -> nn.Module:
    model = mlp()
    model[2].weight.allreduce = False  # type: ignore[union-attr]
    return model


class _NoConfig:
    pass


def _construction_errors() -> dict[str, tuple[str, int]]:
    world = dist.group.WORLD
    assert world is not None
    loose: Any = DistributedDataParallel  # lets the wrong types through to the checks
    with (
        model_parallel() as pgc,
        model_parallel(num_distributed_optimizer_instances=2) as pgc_two,
    ):
        no_expert_inter = mg.ProcessGroupCollection(
            **{
                name: getattr(pgc_two, name)
                for name in ("dp", "dp_cp", "intra_dp_cp", "inter_dist_opt", "expt_dp")
            },
            intra_expt_dp=pgc_two.intra_expt_dp,
        )
        mutated = DistributedDataParallelConfig()
        mutated.num_distributed_optimizer_instances = 2
        skip = mlp()
        skip[0].weight.skip_backward_post_hook = True  # type: ignore[union-attr]
        bare = mg.ProcessGroupCollection(dp=world, dp_cp=world)
        gtp = mg.ProcessGroupCollection(dp=pgc.dp, dp_cp=pgc.dp_cp, gtp_remat=world)
        two = ddp_config(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
        per_token = mg.ModelParallelConfig(calculate_per_token_loss=True)
        cfg = ddp_config()
        calls: dict[str, Callable[[], object]] = {
            "frozen": lambda: loose(MP, cfg, _frozen(), pg_collection=pgc),
            "devices": lambda: loose(MP, cfg, _mixed_devices(), pg_collection=pgc),
            "not_module": lambda: loose(MP, cfg, object(), pg_collection=pgc),
            "missing_dp": lambda: loose(
                MP, cfg, mlp(), pg_collection=mg.ProcessGroupCollection(dp_cp=world)
            ),
            "no_default": lambda: loose(MP, cfg, mlp()),
            "collection_type": lambda: loose(MP, cfg, mlp(), pg_collection=world),
            "config": lambda: loose(_NoConfig(), cfg, mlp(), pg_collection=pgc),
            "ddp_config": lambda: loose(MP, {"bucket_size": 1}, mlp(), pg_collection=pgc),
            "mutated": lambda: loose(MP, mutated, mlp(), pg_collection=pgc),
            "disable_bucketing": lambda: loose(MP, cfg, mlp(), 1, pgc),
            "instances": lambda: loose(MP, two, mlp(), pg_collection=pgc),
            "expert_group": lambda: loose(MP, cfg, _expert(), pg_collection=bare),
            "expert_instances": lambda: loose(MP, two, _expert(), pg_collection=no_expert_inter),
            "per_token_avg": lambda: loose(
                per_token, ddp_config(average_in_collective=True), mlp(), pg_collection=pgc
            ),
            "wgrad_owner": lambda: loose(
                MP, ddp_config(delay_wgrad_compute=True), skip, pg_collection=pgc
            ),
            "gtp_avg": lambda: loose(
                MP, ddp_config(average_in_collective=True), mlp(), pg_collection=gtp
            ),
        }
        return {name: _attempt(call) for name, call in calls.items()}


CONSTRUCTION = {
    "frozen": Expect(
        "ValueError: module=Sequential has no parameter with requires_grad=True",
        doc_call="`DistributedDataParallel(config, ddp_config, module)`",
        doc_input="every param frozen",
    ),
    "devices": Expect(
        "ValueError: module params are on mixed devices: '4.weight' is on meta",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="params on cpu and meta",
    ),
    "not_module": Expect(
        "TypeError: module=object must be a torch.nn.Module",
        doc_call="`DistributedDataParallel(..., module)`",
        doc_input="`object()`",
    ),
    "missing_dp": Expect(
        "MissingGroupError: DistributedDataParallel (the bucket size and the replicas) "
        "needs pg_collection.dp",
        doc_call="`DistributedDataParallel(..., pg_collection=)`",
        doc_input="a collection without `dp`",
    ),
    "no_default": Expect(
        "ValueError: pg_collection=None and no default ProcessGroupCollection",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="`pg_collection=None`, none registered",
    ),
    "collection_type": Expect(
        "TypeError: pg_collection=",
        doc_call="`DistributedDataParallel(..., pg_collection=)`",
        doc_input="a process group",
    ),
    "config": Expect(
        "TypeError: config=_NoConfig must have a bool attribute calculate_per_token_loss",
        doc_call="`DistributedDataParallel(config, ...)`",
        doc_input="config without `calculate_per_token_loss`",
    ),
    "ddp_config": Expect(
        "TypeError: ddp_config=dict must be a mc_ddp.DistributedDataParallelConfig",
        doc_call="`DistributedDataParallel(..., ddp_config)`",
        doc_input="a dict",
    ),
    "mutated": Expect(
        "ValueError: num_distributed_optimizer_instances=2 needs use_distributed_optimizer",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="config field set after construction to an invalid combination",
    ),
    "disable_bucketing": Expect(
        "TypeError: disable_bucketing=1 must be a bool",
        doc_call="`DistributedDataParallel(..., disable_bucketing)`",
        doc_input="`1`",
    ),
    "instances": Expect(
        "MissingGroupError: DistributedDataParallel with 2 optimizer instances needs "
        "pg_collection.inter_dist_opt",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="2 optimizer instances, collection without `inter_dist_opt`",
    ),
    "expert_group": Expect(
        "MissingGroupError: DistributedDataParallel for expert params (allreduce=False) "
        "needs pg_collection.expt_dp",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="expert params, collection without `expt_dp`",
    ),
    "expert_instances": Expect(
        "MissingGroupError: DistributedDataParallel for expert params with 2 optimizer "
        "instances needs pg_collection.inter_expt_dp",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="expert params and 2 optimizer instances, collection without `inter_expt_dp`",
    ),
    "per_token_avg": Expect(
        "ValueError: config.calculate_per_token_loss=True with "
        "ddp_config.average_in_collective=True",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="`calculate_per_token_loss` with `average_in_collective`",
    ),
    "gtp_avg": Expect(
        "ValueError: ddp_config.average_in_collective=True with an active gtp_remat group",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="`average_in_collective` with gtp_remat (Megatron-Core refuses it too)",
        also=("set average_in_collective=False",),
    ),
    "wgrad_owner": Expect(
        "ValueError: param '0.weight' has skip_backward_post_hook=True",
        doc_call="`DistributedDataParallel(...)`",
        doc_input=(
            "`skip_backward_post_hook` param under `delay_wgrad_compute` without an owning layer"
        ),
    ),
}


def test_construction_errors(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_construction_errors):
        for name, expect in CONSTRUCTION.items():
            message, issued = found[name]
            assert_fails_as(name, message, expect)
            assert issued == 0, name


def _iteration(ddp: DistributedDataParallel, step: int, finish: bool = True) -> None:
    x, y = global_batch(step, dist.get_world_size(), torch.float32)
    ddp_backward(ddp, local_rows(x, dist.get_rank()), local_rows(y, dist.get_rank()), 1)
    if finish:
        ddp.finish_grad_sync()


def _order_errors() -> dict[str, tuple[str, int]]:
    out: dict[str, tuple[str, int]] = {}
    with model_parallel() as pgc:
        plain = DistributedDataParallel(MP, ddp_config(), mlp(), pg_collection=pgc)
        out["finish_param_sync"] = _attempt(plain.bucket_groups[0].finish_param_sync)
        out["start_param_sync"] = _attempt(plain.start_param_sync)
        out["disable_hooks"] = _attempt(plain.disable_forward_pre_hook)
        out["enable_hooks"] = _attempt(plain.enable_forward_pre_hook)

        gathered = DistributedDataParallel(
            MP,
            ddp_config(use_distributed_optimizer=True, overlap_param_gather=True),
            mlp(),
            pg_collection=pgc,
        )
        out["enable_twice"] = _attempt(gathered.enable_forward_pre_hook)

        ddp = DistributedDataParallel(
            MP, ddp_config(overlap_grad_reduce=True, bucket_size=16), mlp(), pg_collection=pgc
        )
        _iteration(ddp, 0)
        out["grad_after_finish"] = _attempt(lambda: _iteration(ddp, 1, finish=False))
        ddp.zero_grad_buffer()
        out["finish_before_backward"] = _attempt(ddp.finish_grad_sync)
        _iteration(ddp, 1, finish=False)  # every group's reduction is now in flight
        out["zero_in_flight"] = _attempt(ddp.zero_grad_buffer)
        out["offload_in_flight"] = _attempt(ddp.offload_grad_buffers)
        out["start_twice"] = _attempt(ddp.start_grad_sync)
        ddp.finish_grad_sync()

        unused = mlp()
        lazy = DistributedDataParallel(
            MP, ddp_config(overlap_grad_reduce=True), unused, pg_collection=pgc
        )
        torch.autograd.backward(unused[0](torch.ones(2, 8)).sum())  # only layer 0 used
        lazy.finish_grad_sync()
        out["unused_param"] = _attempt(lazy.zero_grad_buffer)

        frozen_expert = mlp()
        frozen_expert[4].bias.allreduce = False  # type: ignore[union-attr]
        frozen_expert[4].bias.requires_grad_(False)
        world = dist.group.WORLD
        assert world is not None
        bare = mg.ProcessGroupCollection(dp=world, dp_cp=world)
        holder = DistributedDataParallel(MP, ddp_config(), frozen_expert, pg_collection=bare)
        out["broadcast_expert"] = _attempt(holder.broadcast_params)
    return out


ORDER = {
    "finish_param_sync": Expect(
        "RuntimeError: dense bucket group 0: finish_param_sync() needs overlap_param_gather=True",
        doc_call="`bucket_group.finish_param_sync()`",
        doc_input="without `overlap_param_gather`",
    ),
    "start_param_sync": Expect(
        "RuntimeError: start_param_sync() needs use_distributed_optimizer=True",
        doc_call="`ddp.start_param_sync()`",
        doc_input="without the distributed optimizer",
    ),
    "disable_hooks": Expect(
        "RuntimeError: disable_forward_pre_hook(): the forward pre-hooks are not enabled",
        doc_call="`ddp.disable_forward_pre_hook()`",
        doc_input="hooks not enabled",
    ),
    "enable_hooks": Expect(
        "RuntimeError: enable_forward_pre_hook() needs use_distributed_optimizer=True",
        doc_call="`ddp.enable_forward_pre_hook()`",
        doc_input="without param-gather overlap",
    ),
    "enable_twice": Expect(
        "RuntimeError: forward pre-hooks are already enabled",
        doc_call="`ddp.enable_forward_pre_hook()`",
        doc_input="called twice",
    ),
    "grad_after_finish": Expect(
        "RuntimeError: dense bucket group 0: a gradient of param(s) '4.bias' arrived after "
        "finish_grad_sync()",
        doc_call="second backward",
        doc_input="a step without `zero_grad_buffer()` (call order)",
        also=("zero_grad_buffer()",),
    ),
    "finish_before_backward": Expect(
        "RuntimeError: dense bucket group 0: finish_grad_sync() but the reduction was never "
        "started: 2 of 2 params",
        doc_call="`ddp.finish_grad_sync()`",
        doc_input="before the backward (finish before start)",
        also=("seen/expected: ",),
    ),
    "zero_in_flight": Expect(
        "RuntimeError: zero_grad_buffer(): gradient reductions of ['dense bucket group 0'",
        doc_call="`ddp.zero_grad_buffer()`",
        doc_input=(
            "reductions in flight (call order; after a forward or backward that raised, "
            "`discard_grad_sync()` recovers)"
        ),
        also=("finish_grad_sync() first", "discard_grad_sync()"),
    ),
    "offload_in_flight": Expect(
        "RuntimeError: offload_grad_buffers(): gradient reductions of",
        doc_call="`ddp.offload_grad_buffers()`",
        doc_input="reductions in flight (call order)",
        also=("finish_grad_sync() first", "discard_grad_sync()"),
    ),
    "start_twice": Expect(
        "RuntimeError: dense bucket group 0: start_grad_sync() called while its reduction is "
        "in flight",
        doc_call="`ddp.start_grad_sync()`",
        doc_input="while in flight (call order)",
    ),
    "unused_param": Expect(
        "RuntimeError: dense bucket group 0: param(s) '4.bias', '4.weight', '2.bias' and 1 "
        "more got no gradient",
        doc_call="`ddp.zero_grad_buffer()` after iteration 1",
        doc_input=(
            "params without a gradient in the first iteration under overlap (unused, or a "
            "backward that raised part-way: `discard_grad_sync()` first)"
        ),
        also=("in the first iteration", "requires_grad=False", "discard_grad_sync()"),
    ),
    "broadcast_expert": Expect(
        "MissingGroupError: broadcast_params() needs pg_collection.expt_dp for the expert "
        "param '4.bias'",
        doc_call="`ddp.broadcast_params()`",
        doc_input="expert param, no `expt_dp`",
    ),
}


def test_calls_out_of_order(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_order_errors):
        for name, expect in ORDER.items():
            message, issued = found[name]
            assert_fails_as(name, message, expect)
            assert issued == 0, name


def _function_errors() -> dict[str, tuple[str, int]]:
    world = dist.group.WORLD
    assert world is not None
    loose: Any = reduce_scatter_with_fp32_accumulation
    with model_parallel() as pgc:
        ddp = DistributedDataParallel(MP, ddp_config(), mlp(), pg_collection=pgc)
        calls: dict[str, Callable[[], object]] = {
            "fp32_rs_op": lambda: loose(torch.zeros(2), torch.zeros(4), world, op=mg.ReduceOp.MAX),
            "fp32_rs_numel": lambda: loose(torch.zeros(3), torch.zeros(4), world),
            "fp32_rs_dtype": lambda: loose(
                torch.zeros(2, dtype=torch.bfloat16), torch.zeros(4), world
            ),
            "fp32_rs_scratch": lambda: loose(
                torch.zeros(2), torch.zeros(4), world, received=torch.zeros(3)
            ),
            "fp32_rs_group": lambda: loose(torch.zeros(2), torch.zeros(4), None),
            "scale_type": lambda: ddp.scale_gradients("2"),  # type: ignore[arg-type]
            "offload_flag": lambda: ddp.offload_grad_buffers(synchronize=1),  # type: ignore[arg-type]
            "restore_flag": lambda: ddp.restore_grad_buffers(synchronize="no"),  # type: ignore[arg-type]
        }
        return {name: _attempt(call) for name, call in calls.items()}


FUNCTIONS = {
    "fp32_rs_op": Expect(
        "ValueError: op=ReduceOp.MAX is not supported: use ReduceOp.SUM or ReduceOp.AVG",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., op=)`",
        doc_input="`ReduceOp.MAX`",
    ),
    "fp32_rs_numel": Expect(
        "ValueError: input.numel()=4 must equal output.numel()=3 × group size 2",
        doc_call="`reduce_scatter_with_fp32_accumulation`",
        doc_input="input 4, output 3 on 2 ranks",
    ),
    "fp32_rs_dtype": Expect(
        "ValueError: output dtype torch.bfloat16 differs from input dtype torch.float32",
        doc_call="`reduce_scatter_with_fp32_accumulation`",
        doc_input="bf16 output, fp32 input",
    ),
    "fp32_rs_scratch": Expect(
        "ValueError: received must be a contiguous torch.float32 tensor of 4 elements, got 3",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., received=)`",
        doc_input="3 elements for 4",
    ),
    "fp32_rs_group": Expect(
        "TypeError: group=None must be a torch.distributed.ProcessGroup",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., group)`",
        doc_input="`None`",
    ),
    "scale_type": Expect(
        "TypeError: scaling_factor='2'", doc_call="`ddp.scale_gradients(f)`", doc_input="`'2'`"
    ),
    "offload_flag": Expect(
        "TypeError: synchronize=1 must be a bool",
        doc_call="`ddp.offload_grad_buffers(synchronize=)`",
        doc_input="`1`",
    ),
    "restore_flag": Expect(
        "TypeError: synchronize='no' must be a bool",
        doc_call="`ddp.restore_grad_buffers(synchronize=)`",
        doc_input="`'no'`",
    ),
}


def test_function_arguments(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_function_errors):
        for name, expect in FUNCTIONS.items():
            message, issued = found[name]
            assert_fails_as(name, message, expect)
            assert issued == 0, name


def test_unknown_config_field_is_rejected() -> None:
    config: Any = DistributedDataParallelConfig
    with pytest.raises(TypeError, match="bucket_sise"):
        config(bucket_sise=10)
