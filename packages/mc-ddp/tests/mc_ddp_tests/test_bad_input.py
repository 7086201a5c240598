"""mc-ddp's bad-input catalogue: bad input and calls out of order, each a clear error raised
before any collective.

Localizes argument validation (module, devices, configs, process groups, the methods' and
the fp32-accumulating reduce-scatter's arguments; the FSDP2 entry points: the wrapper and
its config, ``clip_grad_norm``, the torch optimizer's sharded state) and the state
machine's guards (finish before start, a second start, zero/offload with a reduction in
flight, gradients after finish, unused params under overlap, param-sync calls without the
distributed optimizer).
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
    ensure_params_ready,
    partition_buckets,
    reduce_scatter_with_fp32_accumulation,
)
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp.grad_checks import LargeGradMonitor, check_finite_grads
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

MP = mg.ModelParallelConfig()


def _attempt(call: Callable[[], object]) -> tuple[str, int]:
    """(``ErrorType: message`` or ``"no error"``, collectives issued during the call)."""
    with mg.record_collectives() as log:
        try:
            call()
        except (TypeError, ValueError, RuntimeError, NotImplementedError) as err:
            return f"{error_kind(err)}: {err}", len(log)
    return "no error", len(log)


def _frozen() -> nn.Module:
    model = mlp()
    model.requires_grad_(False)
    return model


def _mixed_devices() -> nn.Module:
    model = mlp()
    model[4].to("meta")
    return model


def _meta() -> nn.Module:
    return mlp().to("meta")


def _dtensor_experts() -> nn.Module:
    """An MLP whose middle weight torch sharded over the world (as torch's own expert or
    tensor parallelism would): every rank holds a different half."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = mlp()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    layer: Any = model[2]
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(0)]))
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
        truthy = mlp()
        truthy[2].bias.skip_backward_post_hook = 1  # type: ignore[union-attr]
        bare = mg.ProcessGroupCollection(dp=world, dp_cp=world)
        gtp = mg.ProcessGroupCollection(dp=pgc.dp, dp_cp=pgc.dp_cp, gtp_remat=world)
        two = ddp_config(use_distributed_optimizer=True, num_distributed_optimizer_instances=2)
        per_token = mg.ModelParallelConfig(calculate_per_token_loss=True)
        cfg = ddp_config()
        calls: dict[str, Callable[[], object]] = {
            "frozen": lambda: loose(MP, cfg, _frozen(), pg_collection=pgc),
            "devices": lambda: loose(MP, cfg, _mixed_devices(), pg_collection=pgc),
            "meta": lambda: loose(MP, cfg, _meta(), pg_collection=pgc),
            "dtensor": lambda: loose(MP, cfg, _dtensor_experts(), pg_collection=pgc),
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
            "param_flag": lambda: loose(
                MP, ddp_config(delay_wgrad_compute=True), truthy, pg_collection=pgc
            ),
        }
        return {name: _attempt(call) for name, call in calls.items()}


CONSTRUCTION = {
    "frozen": Expect(
        "ValueError: module=torch.nn.modules.container.Sequential has no parameter with "
        "requires_grad=True",
        doc_call="`DistributedDataParallel(config, ddp_config, module)`",
        doc_input="every param frozen",
    ),
    "devices": Expect(
        "ValueError: module params are on mixed devices: '4.weight' is on meta",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="params on cpu and meta",
    ),
    "meta": Expect(
        "ValueError: module has its params on the meta device ('0.weight' and the rest) and "
        "the data-parallel group runs 'gloo'",
        doc_call="`DistributedDataParallel(..., module)`",
        doc_input="a module on the meta device",
    ),
    "dtensor": Expect(
        "TypeError: module param '2.weight' is a DTensor ((Shard(dim=0),) on DeviceMesh(",
        doc_call="`DistributedDataParallel(..., module)`",
        doc_input="a param sharded by torch (`distribute_tensor`)",
        also=("mc_moe.parallelize", "mc_ddp.TorchFullyShardedDataParallel"),
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
        "NoDefaultCollectionError: DistributedDataParallel got no process group and no default "
        "ProcessGroupCollection is registered",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="`pg_collection=None`, none registered",
        also=("pass pg_collection=initialize_model_parallel(...)",),
    ),
    "collection_type": Expect(
        "TypeError: DistributedDataParallel: pg_collection=",
        doc_call="`DistributedDataParallel(..., pg_collection=)`",
        doc_input="a process group",
    ),
    "config": Expect(
        "TypeError: config=mc_ddp_tests.test_bad_input._NoConfig lacks "
        "['calculate_per_token_loss']: DistributedDataParallel reads "
        "config.calculate_per_token_loss",
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
    "param_flag": Expect(
        "TypeError: param '2.bias' has skip_backward_post_hook=1; the attribute must be a bool",
        doc_call="`DistributedDataParallel(...)`",
        doc_input="`param.skip_backward_post_hook = 1` (read by truthiness before)",
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
        out.update(_twice_errors(pgc))
        out.update(_offload_errors(pgc))
    out.update(_destroyed_errors())
    return out


def _twice_errors(pgc: mg.ProcessGroupCollection) -> dict[str, tuple[str, int]]:
    """Misuse that would count this iteration's gradients twice."""
    out: dict[str, tuple[str, int]] = {}
    ddp = DistributedDataParallel(MP, ddp_config(), mlp(), pg_collection=pgc)
    ddp.zero_grad_buffer()
    out["mark_unfinished"] = _attempt(ddp.mark_grads_finalized)
    _iteration(ddp, 0)
    ddp.scale_gradients(0.5)
    out["scale_twice"] = _attempt(lambda: ddp.scale_gradients(0.5))
    ddp.mark_grads_finalized()
    out["mark_twice"] = _attempt(ddp.mark_grads_finalized)
    sharded = DistributedDataParallel(
        MP, ddp_config(use_distributed_optimizer=True), mlp(), pg_collection=pgc
    )
    _iteration(sharded, 0)
    out["force_after_shards"] = _attempt(lambda: sharded.finish_grad_sync(force_all_reduce=True))
    return out


def _offload_errors(pgc: mg.ProcessGroupCollection) -> dict[str, tuple[str, int]]:
    """Offloaded grad buffers: every write is refused before it reaches the freed memory."""
    out: dict[str, tuple[str, int]] = {}
    ddp = DistributedDataParallel(
        MP, ddp_config(overlap_grad_reduce=True, bucket_size=16), mlp(), pg_collection=pgc
    )
    x, y = global_batch(0, dist.get_world_size(), torch.float32)
    ddp.offload_grad_buffers()
    out["offload_forward"] = _attempt(lambda: ddp(x))
    with torch.no_grad():
        ddp(x)  # inference while offloaded is fine
    out["offload_backward"] = _attempt(lambda: ddp.module(x).sum().backward())
    out["offload_main_grad"] = _attempt(lambda: ddp.params_with_grad[0].main_grad.add_(1.0))  # type: ignore[attr-defined]
    out["offload_finish"] = _attempt(ddp.finish_grad_sync)
    out["offload_zero"] = _attempt(ddp.zero_grad_buffer)
    out["offload_scale"] = _attempt(lambda: ddp.scale_gradients(0.5))
    ddp.restore_grad_buffers()
    ddp.zero_grad_buffer()
    _iteration(ddp, 1)
    ddp.offload_grad_buffers()
    ddp.restore_grad_buffers()
    out["discarded_finish"] = _attempt(ddp.finish_grad_sync)
    out["discarded_backward"] = _attempt(lambda: _iteration(ddp, 2, finish=False))
    del y
    return out


def _destroyed_errors() -> dict[str, tuple[str, int]]:
    pgc = mg.initialize_model_parallel()
    ddp = DistributedDataParallel(
        MP, ddp_config(use_distributed_optimizer=True), mlp(), pg_collection=pgc
    )
    mg.destroy_model_parallel(pgc)
    ddp.zero_grad_buffer()
    return {
        "destroyed_finish": _attempt(lambda: _iteration(ddp, 0)),
        "destroyed_broadcast": _attempt(ddp.broadcast_params),
        "destroyed_param_sync": _attempt(ddp.start_param_sync),
    }


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


_OFFLOADED = "`ddp.offload_grad_buffers()`, then "


ORDER.update(
    {
        "mark_unfinished": Expect(
            "RuntimeError: mark_grads_finalized(): ['dense bucket group 0'] have not finished "
            "their grad sync",
            doc_call="`ddp.mark_grads_finalized()`",
            doc_input="before `finish_grad_sync()` (call order)",
        ),
        "scale_twice": Expect(
            "RuntimeError: scale_gradients(): this iteration's gradients were already scaled "
            "by 0.5; a second call would scale them twice",
            doc_call="`ddp.scale_gradients(f)`",
            doc_input="twice in one iteration (grads scaled twice before)",
            also=("zero_grad_buffer()",),
        ),
        "mark_twice": Expect(
            "RuntimeError: mark_grads_finalized(): this iteration's gradients were already "
            "finalized",
            doc_call="`ddp.mark_grads_finalized()` (finalize)",
            doc_input="twice in one iteration (finalize twice scaled twice before)",
            also=("zero_grad_buffer()",),
        ),
        "force_after_shards": Expect(
            "RuntimeError: finish_grad_sync(force_all_reduce=True) after this iteration's "
            "gradients were already reduce-scattered",
            doc_call="`ddp.finish_grad_sync(force_all_reduce=True)`",
            doc_input="after `finish_grad_sync()` with the distributed optimizer (silently "
            "shards only before)",
            also=("pass force_all_reduce=True to the first call",),
        ),
        "offload_forward": Expect(
            "RuntimeError: forward with autograd on while the grad buffers are offloaded",
            doc_call="`ddp(x)`",
            doc_input=_OFFLOADED + "a forward with autograd on",
            also=("torch.no_grad()", "restore_grad_buffers()"),
        ),
        "offload_backward": Expect(
            "RuntimeError: backward: the gradient of '4.bias' has no memory to go to: the "
            "grad buffers are offloaded",
            doc_call="`loss.backward()` (DDP's hook)",
            doc_input=_OFFLOADED + "a backward (segfault before)",
            also=("restore_grad_buffers()", "nothing was written"),
        ),
        "offload_main_grad": Expect(
            "RuntimeError: aten.add_.Tensor: main_grad of '0.weight' (shape (16, 8), float32, "
            "cpu) is offloaded",
            doc_call="`param.main_grad.add_(g)` (a layer's fused wgrad)",
            doc_input=_OFFLOADED + "a write to `main_grad` (segfault before)",
            also=("ddp.restore_grad_buffers()",),
        ),
        "offload_finish": Expect(
            "RuntimeError: finish_grad_sync(): the grad buffers are offloaded",
            doc_call="`ddp.finish_grad_sync()`",
            doc_input=_OFFLOADED + "the grad sync",
            also=("restore_grad_buffers() first",),
        ),
        "offload_zero": Expect(
            "RuntimeError: zero_grad_buffer(): the grad buffers are offloaded",
            doc_call="`ddp.zero_grad_buffer()`",
            doc_input=_OFFLOADED + "zeroing",
            also=("restore_grad_buffers() first",),
        ),
        "offload_scale": Expect(
            "RuntimeError: scale_gradients(): the grad buffers are offloaded",
            doc_call="`ddp.scale_gradients(f)`",
            doc_input=_OFFLOADED + "scaling",
            also=("restore_grad_buffers() first",),
        ),
        "discarded_finish": Expect(
            "RuntimeError: finish_grad_sync(): offload_grad_buffers() discarded this "
            "iteration's gradients",
            doc_call="`ddp.finish_grad_sync()`",
            doc_input="after a backward, offload and restore (grads came back zeroed; "
            "silently zero before)",
            also=("zero_grad_buffer()",),
        ),
        "discarded_backward": Expect(
            "RuntimeError: backward: a gradient of '4.bias' arrived after offload_grad_buffers() "
            "discarded this iteration's gradients",
            doc_call="`loss.backward()`",
            doc_input="after offload and restore mid-iteration (earlier microbatches lost)",
            also=("zero_grad_buffer()",),
        ),
        "destroyed_finish": Expect(
            "RuntimeError: finish_grad_sync(): process group dp_cp was destroyed "
            "(destroy_model_parallel()",
            doc_call="backward + `ddp.finish_grad_sync()`",
            doc_input="after `destroy_model_parallel(pgc)`",
            also=("build a new one over live groups",),
        ),
        "destroyed_broadcast": Expect(
            "RuntimeError: broadcast_params(): process group dp_cp was destroyed",
            doc_call="`ddp.broadcast_params()`",
            doc_input="after `destroy_model_parallel(pgc)`",
        ),
        "destroyed_param_sync": Expect(
            "RuntimeError: start_param_sync(): process group dp_cp was destroyed",
            doc_call="`ddp.start_param_sync()`",
            doc_input="after `destroy_model_parallel(pgc)`",
        ),
    }
)


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
        cfg = ddp_config()
        ddp = DistributedDataParallel(MP, cfg, mlp(), pg_collection=pgc)
        sharded = DistributedDataParallel(
            MP,
            ddp_config(use_distributed_optimizer=True, overlap_param_gather=True),
            mlp(),
            pg_collection=pgc,
        )
        group = ddp.bucket_groups[0]
        buckets = group.buckets
        stranger = nn.Parameter(torch.zeros(3))
        calls: dict[str, Callable[[], object]] = {
            "fp32_rs_op": lambda: loose(torch.zeros(2), torch.zeros(4), world, op=mg.ReduceOp.MAX),
            "fp32_rs_torch_op": lambda: loose(
                torch.zeros(2), torch.zeros(4), world, op=dist.ReduceOp.MAX
            ),
            "fp32_rs_numel": lambda: loose(torch.zeros(3), torch.zeros(4), world),
            "fp32_rs_dtype": lambda: loose(
                torch.zeros(2, dtype=torch.bfloat16), torch.zeros(4), world
            ),
            "fp32_rs_scratch": lambda: loose(
                torch.zeros(2), torch.zeros(4), world, received=torch.zeros(3)
            ),
            "fp32_rs_both": lambda: loose(
                torch.zeros(2),
                torch.zeros(4),
                world,
                received=torch.zeros(4),
                all_to_all_output_tensor=torch.zeros(4),
            ),
            "fp32_rs_a2a_type": lambda: loose(
                torch.zeros(2), torch.zeros(4), world, all_to_all_output_tensor=[0.0] * 4
            ),
            "fp32_rs_group": lambda: loose(torch.zeros(2), torch.zeros(4), "world"),
            "scale_type": lambda: ddp.scale_gradients("2"),  # type: ignore[arg-type]
            "offload_flag": lambda: ddp.offload_grad_buffers(synchronize=1),  # type: ignore[arg-type]
            "restore_flag": lambda: ddp.restore_grad_buffers(synchronize="no"),  # type: ignore[arg-type]
            "scale_nan": lambda: ddp.scale_gradients(float("nan")),
            "scale_inf": lambda: ddp.scale_gradients(float("inf")),
            "scale_tensor": lambda: ddp.scale_gradients(torch.ones(3)),
            "finish_flag": lambda: ddp.finish_grad_sync(force_all_reduce="no"),  # type: ignore[arg-type]
            "empty_cache_flag": lambda: ddp.offload_grad_buffers(empty_cache=0),  # type: ignore[arg-type]
            "param_sync_flag": lambda: sharded.start_param_sync(force_sync=1),  # type: ignore[arg-type]
            "pre_hook_flag": lambda: sharded.disable_forward_pre_hook(param_sync="no"),  # type: ignore[arg-type]
            "load_state_dict": lambda: ddp.load_state_dict(None),  # type: ignore[arg-type]
            "register_stranger": lambda: group.register_grad_ready(stranger),
            "group_buckets": lambda: ParamAndGradBucketGroup([], cfg, world),
            "group_collective": lambda: ParamAndGradBucketGroup(buckets, cfg, None),  # type: ignore[arg-type]
            "partition_buffers": lambda: partition_buckets(None),  # type: ignore[arg-type]
            "partition_flag": lambda: partition_buckets(ddp.buffers, "no"),  # type: ignore[arg-type]
            "finite_buckets": lambda: check_finite_grads(None, {}, "w"),  # type: ignore[arg-type]
            "finite_names": lambda: check_finite_grads(buckets, None, "w"),  # type: ignore[arg-type]
            "finite_where": lambda: check_finite_grads(buckets, {}, 3),  # type: ignore[arg-type]
            "finite_groups": lambda: check_finite_grads(buckets, {}, "w", groups="x"),  # type: ignore[arg-type]
            "monitor_size": lambda: LargeGradMonitor(2.0),  # type: ignore[arg-type]
            "monitor_check": lambda: LargeGradMonitor(1).check(None, "w"),  # type: ignore[arg-type]
            "monitor_items": lambda: LargeGradMonitor(1).check([None], "w"),  # type: ignore[list-item]
            "fp32_rs_output": lambda: loose(None, torch.zeros(4), world),
            "fp32_rs_async": lambda: loose(torch.zeros(2), torch.zeros(4), world, async_op="no"),
            "ready_params": lambda: ensure_params_ready(None),  # type: ignore[arg-type]
            "ready_items": lambda: ensure_params_ready([None]),  # type: ignore[list-item]
        }
        found = {name: _attempt(call) for name, call in calls.items()}
        found["offloaded_after_flag_error"] = ("no error", int(ddp._grads_offloaded()))
        return found


FUNCTIONS = {
    "fp32_rs_op": Expect(
        "ValueError: op=ReduceOp.MAX is not supported: use ReduceOp.SUM or ReduceOp.AVG",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., op=)`",
        doc_input="`ReduceOp.MAX`",
    ),
    "fp32_rs_torch_op": Expect(
        "ValueError: op=RedOpType.MAX is not supported: use ReduceOp.SUM or ReduceOp.AVG",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., op=)`",
        doc_input="`torch.distributed.ReduceOp.MAX` (torch's SUM / AVG are accepted)",
    ),
    "fp32_rs_numel": Expect(
        "ValueError: reduce_scatter: input.numel()=4 must equal output.numel()=3 × group size 2",
        doc_call="`reduce_scatter_with_fp32_accumulation`",
        doc_input="input 4, output 3 on 2 ranks",
    ),
    "fp32_rs_dtype": Expect(
        "ValueError: reduce_scatter: output dtype torch.bfloat16 differs from input dtype "
        "torch.float32",
        doc_call="`reduce_scatter_with_fp32_accumulation`",
        doc_input="bf16 output, fp32 input",
    ),
    "fp32_rs_scratch": Expect(
        "ValueError: received=3 × float32 on cpu must be a contiguous tensor of 4 × float32",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., received=)`",
        doc_input="3 elements for 4",
    ),
    "fp32_rs_both": Expect(
        "ValueError: received= and all_to_all_output_tensor= name the same receive buffer",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., received=, "
        "all_to_all_output_tensor=)`",
        doc_input="both given",
    ),
    "fp32_rs_a2a_type": Expect(
        "TypeError: all_to_all_output_tensor=list must be None or a torch.Tensor",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., all_to_all_output_tensor=)`",
        doc_input="a list",
    ),
    "fp32_rs_group": Expect(
        "TypeError: group='world' must be a torch.distributed.ProcessGroup",
        doc_call="`reduce_scatter_with_fp32_accumulation(..., group)`",
        doc_input="`'world'` (None is torch's default group, as in Megatron)",
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


FUNCTIONS.update(
    {
        "scale_nan": Expect(
            "ValueError: scaling_factor=nan must be finite",
            doc_call="`ddp.scale_gradients(f)`",
            doc_input="`nan` (accepted before)",
        ),
        "scale_inf": Expect(
            "ValueError: scaling_factor=inf must be finite",
            doc_call="`ddp.scale_gradients(f)`",
            doc_input="`inf`",
        ),
        "scale_tensor": Expect(
            "ValueError: scaling_factor must be a scalar; got a tensor of shape (3,)",
            doc_call="`ddp.scale_gradients(f)`",
            doc_input="a 3-element tensor",
        ),
        "finish_flag": Expect(
            "TypeError: force_all_reduce='no' must be a bool",
            doc_call="`ddp.finish_grad_sync(force_all_reduce=)`",
            doc_input="`'no'` (truthy: all-reduced before)",
        ),
        "empty_cache_flag": Expect(
            "TypeError: empty_cache=0 must be a bool",
            doc_call="`ddp.offload_grad_buffers(empty_cache=)`",
            doc_input="`0` (checked after offloading before)",
        ),
        "param_sync_flag": Expect(
            "TypeError: force_sync=1 must be a bool",
            doc_call="`ddp.start_param_sync(force_sync=)`",
            doc_input="`1`",
        ),
        "pre_hook_flag": Expect(
            "TypeError: param_sync='no' must be a bool",
            doc_call="`ddp.disable_forward_pre_hook(param_sync=)`",
            doc_input="`'no'`",
        ),
        "load_state_dict": Expect(
            "TypeError: state_dict must be a mapping of names to tensors",
            doc_call="`ddp.load_state_dict(sd)`",
            doc_input="`None`",
        ),
        "register_stranger": Expect(
            "ValueError: dense bucket group 0: register_grad_ready() got a param (shape (3,)) "
            "that is not in this bucket group",
            doc_call="`bucket_group.register_grad_ready(p)`",
            doc_input="a param of another group (counted, never dispatched before)",
        ),
        "group_buckets": Expect(
            "TypeError: buckets must be a non-empty sequence of ParamAndGradBucket",
            doc_call="`ParamAndGradBucketGroup(buckets, ...)`",
            doc_input="`[]`",
        ),
        "group_collective": Expect(
            "TypeError: collective_group=None must be a torch.distributed.ProcessGroup",
            doc_call="`ParamAndGradBucketGroup(..., collective_group)`",
            doc_input="`None`",
        ),
        "partition_buffers": Expect(
            "TypeError: buffers must be a sequence of ParamAndGradBuffer, got NoneType",
            doc_call="`partition_buckets(buffers)`",
            doc_input="`None`",
        ),
        "partition_flag": Expect(
            "TypeError: force_single_bucket_group='no' must be a bool",
            doc_call="`partition_buckets(..., force_single_bucket_group)`",
            doc_input="`'no'`",
        ),
        "finite_buckets": Expect(
            "TypeError: buckets must be a non-empty sequence of ParamAndGradBucket, got None",
            doc_call="`check_finite_grads(buckets, ...)`",
            doc_input="`None`",
        ),
        "finite_names": Expect(
            "TypeError: names must map params to names, got NoneType",
            doc_call="`check_finite_grads(..., names, ...)`",
            doc_input="`None`",
        ),
        "finite_where": Expect(
            "TypeError: where=3 must be a str",
            doc_call="`check_finite_grads(..., where)`",
            doc_input="`3`",
        ),
        "finite_groups": Expect(
            "TypeError: groups='x' must be a sequence of process groups",
            doc_call="`check_finite_grads(..., groups=)`",
            doc_input="`'x'`",
        ),
        "monitor_size": Expect(
            "TypeError: num_buckets=2.0 must be an int",
            doc_call="`LargeGradMonitor(num_buckets)`",
            doc_input="`2.0`",
        ),
        "monitor_check": Expect(
            "TypeError: buckets=None must be a sequence of ParamAndGradBucket",
            doc_call="`monitor.check(buckets, where)`",
            doc_input="`None`",
        ),
        "monitor_items": Expect(
            "ValueError: LargeGradMonitor.check: buckets must be the 1 ParamAndGradBucket(s) it "
            "was built for, got [None]",
            doc_call="`monitor.check(buckets, where)`",
            doc_input="`[None]`",
        ),
        "fp32_rs_output": Expect(
            "TypeError: output must be a torch.Tensor, got NoneType",
            doc_call="`reduce_scatter_with_fp32_accumulation(output, ...)`",
            doc_input="`None`",
        ),
        "fp32_rs_async": Expect(
            "TypeError: async_op='no' must be a bool",
            doc_call="`reduce_scatter_with_fp32_accumulation(..., async_op=)`",
            doc_input="`'no'`",
        ),
        "ready_params": Expect(
            "TypeError: params must be an iterable of tensors",
            doc_call="`ensure_params_ready(params)`",
            doc_input="`None`",
        ),
        "ready_items": Expect(
            "TypeError: params holds a NoneType; every item must be a tensor",
            doc_call="`ensure_params_ready(params)`",
            doc_input="`[None]`",
        ),
    }
)


def test_function_arguments(rank_pools: RankPools) -> None:
    for found in rank_pools.get(2).run(_function_errors):
        assert found["offloaded_after_flag_error"] == ("no error", 0)  # checked before offloading
        for name, expect in FUNCTIONS.items():
            message, issued = found[name]
            assert_fails_as(name, message, expect)
            assert issued == 0, name


def test_unknown_config_field_is_rejected() -> None:
    config: Any = DistributedDataParallelConfig
    with pytest.raises(TypeError, match="bucket_sise"):
        config(bucket_sise=10)


def _fsdp2_errors() -> dict[str, tuple[str, int]]:
    """The FSDP2 entry points: ``TorchFullyShardedDataParallel`` (and its config),
    ``clip_grad_norm``, ``optimizer_sharded_state_dict`` /
    ``load_optimizer_sharded_state_dict``."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    from mc_ddp import (
        ShardedOptimizer,
        TorchFullyShardedDataParallel,
        TorchFullyShardedDataParallelConfig,
        clip_grad_norm,
        load_optimizer_sharded_state_dict,
        optimizer_sharded_state_dict,
    )

    loose: Any = TorchFullyShardedDataParallel
    fsdp_config: Any = TorchFullyShardedDataParallelConfig
    clip: Any = clip_grad_norm
    osd: Any = optimizer_sharded_state_dict
    load_osd: Any = load_optimizer_sharded_state_dict
    with model_parallel() as pgc:
        cfg = fsdp_config()
        fused = mg.ModelParallelConfig(gradient_accumulation_fusion=True)
        wrapped = mlp()
        fully_shard(wrapped, mesh=DeviceMesh.from_group(pgc.require("dp_cp", "test"), "cpu"))
        ddp = DistributedDataParallel(MP, ddp_config(), mlp(), pg_collection=pgc)
        sharded = ShardedOptimizer(torch.optim.SGD(ddp.parameters(), lr=0.1), ddp)
        sgd = torch.optim.SGD(mlp().parameters(), lr=0.1)
        calls: dict[str, Callable[[], object]] = {
            "fsdp_module": lambda: loose(MP, cfg, object(), pg_collection=pgc),
            "fsdp_ddp_config": lambda: loose(MP, {"bucket_size": 1}, mlp(), pg_collection=pgc),
            "fsdp_wrap_str": lambda: loose(MP, cfg, mlp(), "Linear", pg_collection=pgc),
            "fsdp_wrap_instance": lambda: loose(
                MP, cfg, mlp(), {nn.Linear(2, 2)}, pg_collection=pgc
            ),
            "fsdp_bucketing": lambda: loose(MP, cfg, mlp(), None, 1, pg_collection=pgc),
            "fsdp_mp_policy": lambda: loose(MP, cfg, mlp(), pg_collection=pgc, mp_policy="bf16"),
            "fsdp_fusion": lambda: loose(fused, cfg, mlp(), pg_collection=pgc),
            "fsdp_large_grads": lambda: loose(
                MP, fsdp_config(check_for_large_grads=True), mlp(), pg_collection=pgc
            ),
            "fsdp_frozen": lambda: loose(MP, cfg, _frozen(), pg_collection=pgc),
            "fsdp_expert": lambda: loose(MP, cfg, _expert(), pg_collection=pgc),
            "fsdp_twice": lambda: loose(MP, cfg, wrapped, pg_collection=pgc),
            "fsdp_reshard": lambda: fsdp_config(reshard_after_forward=1),
            "fsdp_reshard_type": lambda: fsdp_config(reshard_after_forward="yes"),
            "fsdp_accumulation": lambda: fsdp_config(gradient_accumulation_mode="sum"),
            "fsdp_clone_views": lambda: fsdp_config(clone_output_views=True),
            "clip_model": lambda: clip(None, 1.0, pg_collection=pgc),
            "clip_ddp": lambda: clip(ddp, 1.0, pg_collection=pgc),
            "clip_max_norm": lambda: clip(mlp(), 0.0, pg_collection=pgc),
            "clip_norm_type": lambda: clip(mlp(), 1.0, 0.5, pg_collection=pgc),
            "clip_scaler": lambda: clip(mlp(), 1.0, grad_scaler="dynamic", pg_collection=pgc),
            "clip_nonfinite": lambda: clip(mlp(), 1.0, error_if_nonfinite=1, pg_collection=pgc),
            "osd_optimizer": lambda: osd(None, {}),
            "osd_sharded": lambda: osd(sharded, {}),
            "osd_model_state": lambda: osd(sgd, None),
            "osd_loading": lambda: osd(sgd, {}, is_loading="yes"),
            "load_osd_state": lambda: load_osd(sgd, None, {}),
            "load_osd_optimizer": lambda: load_osd(None, {}, {}),
        }
        return {name: _attempt(call) for name, call in calls.items()}


_FSDP = "`TorchFullyShardedDataParallel(config, ddp_config, module, ...)`"
_CLIP = "`clip_grad_norm(model, max_norm, ...)`"

FSDP2 = {
    "fsdp_module": Expect(
        "TypeError: module must be a torch.nn.Module, got object",
        doc_call=_FSDP,
        doc_input="`object()` as `module`",
    ),
    "fsdp_ddp_config": Expect(
        "TypeError: ddp_config must be a mc_ddp.TorchFullyShardedDataParallelConfig",
        doc_call=_FSDP,
        doc_input="a dict as `ddp_config`",
    ),
    "fsdp_wrap_str": Expect(
        "TypeError: sub_modules_to_wrap='Linear' must be a set of torch.nn.Module classes",
        doc_call="`TorchFullyShardedDataParallel(..., sub_modules_to_wrap)`",
        doc_input="`'Linear'`",
    ),
    "fsdp_wrap_instance": Expect(
        "TypeError: sub_modules_to_wrap holds Linear(",
        doc_call="`TorchFullyShardedDataParallel(..., sub_modules_to_wrap)`",
        doc_input="a set holding a module instance",
        also=("pass classes",),
    ),
    "fsdp_bucketing": Expect(
        "TypeError: disable_bucketing=1 must be a bool",
        doc_call="`TorchFullyShardedDataParallel(..., disable_bucketing)`",
        doc_input="`1`",
    ),
    "fsdp_mp_policy": Expect(
        "TypeError: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
        "got str",
        doc_call="`TorchFullyShardedDataParallel(..., mp_policy=)`",
        doc_input="`'bf16'`",
    ),
    "fsdp_fusion": Expect(
        "ValueError: config.gradient_accumulation_fusion=True",
        doc_call=_FSDP,
        doc_input="`gradient_accumulation_fusion=True` (writes `main_grad`, FSDP2 has none)",
        also=("set gradient_accumulation_fusion=False",),
    ),
    "fsdp_large_grads": Expect(
        "ValueError: ddp_config.check_for_large_grads=True has no counterpart under FSDP2",
        doc_call=_FSDP,
        doc_input="a DDP setting FSDP2 has no counterpart for",
        also=("leave it at its default",),
    ),
    "fsdp_frozen": Expect(
        "ValueError: module (torch.nn.modules.container.Sequential) has no parameter requiring "
        "grad",
        doc_call=_FSDP,
        doc_input="every param frozen",
    ),
    "fsdp_expert": Expect(
        "ValueError: module's param '2.weight' (1 expert params in all) is an expert-parallel "
        "param (allreduce=False): set TorchFullyShardedDataParallelConfig("
        "reduce_scatter_unused_params=True)",
        doc_call=_FSDP,
        doc_input="an expert param without `reduce_scatter_unused_params=True`",
        also=("an expert that gets no token on a rank",),
    ),
    "fsdp_twice": Expect(
        "ValueError: module (torch.distributed.fsdp._fully_shard._fsdp_init.FSDPSequential) "
        "is already under fully_shard",
        doc_call=_FSDP,
        doc_input="a module `fully_shard` already wrapped",
        also=("pass the model before FSDP2 wraps it",),
    ),
    "fsdp_reshard": Expect(
        "ValueError: reshard_after_forward=1 must be None, True, False or an int >= 2",
        doc_call="`TorchFullyShardedDataParallelConfig(reshard_after_forward=)`",
        doc_input="`1`",
    ),
    "fsdp_reshard_type": Expect(
        "TypeError: reshard_after_forward='yes' must be None, a bool or an int",
        doc_call="`TorchFullyShardedDataParallelConfig(reshard_after_forward=)`",
        doc_input="`'yes'`",
    ),
    "fsdp_accumulation": Expect(
        "ValueError: gradient_accumulation_mode='sum' must be one of ['classic', "
        "'partial_reduce_scatter']",
        doc_call="`TorchFullyShardedDataParallelConfig(gradient_accumulation_mode=)`",
        doc_input="`'sum'`",
    ),
    "fsdp_clone_views": Expect(
        "NotImplementedError: clone_output_views=True",
        doc_call="`TorchFullyShardedDataParallelConfig(clone_output_views=)`",
        doc_input="`True` (Megatron main's option, not implemented)",
        also=("leave clone_output_views at Megatron's default False",),
    ),
    "clip_model": Expect(
        "TypeError: model must be a torch.nn.Module or a non-empty list of them",
        doc_call=_CLIP,
        doc_input="`None`",
    ),
    "clip_ddp": Expect(
        "TypeError: model[0] is an mc_ddp.DistributedDataParallel",
        doc_call=_CLIP,
        doc_input="an mc DDP chunk (grads in `main_grad`)",
        also=("ShardedOptimizer(max_grad_norm=...)",),
    ),
    "clip_max_norm": Expect(
        "ValueError: max_norm=0.0 must be a finite number > 0",
        doc_call=_CLIP,
        doc_input="`max_norm=0.0`",
    ),
    "clip_norm_type": Expect(
        "ValueError: norm_type=0.5",
        doc_call="`clip_grad_norm(..., norm_type)`",
        doc_input="`0.5`",
    ),
    "clip_scaler": Expect(
        "TypeError: grad_scaler=str must be an mc_ddp.DynamicGradScaler (or None)",
        doc_call="`clip_grad_norm(..., grad_scaler=)`",
        doc_input="`'dynamic'`",
    ),
    "clip_nonfinite": Expect(
        "TypeError: error_if_nonfinite=1 must be a bool",
        doc_call="`clip_grad_norm(..., error_if_nonfinite=)`",
        doc_input="`1`",
    ),
    "osd_optimizer": Expect(
        "TypeError: optimizer_sharded_state_dict: optimizer must be a torch.optim.Optimizer, "
        "got NoneType",
        doc_call="`optimizer_sharded_state_dict(optimizer, model_sharded_state_dict)`",
        doc_input="`None`",
    ),
    "osd_sharded": Expect(
        "TypeError: optimizer_sharded_state_dict: optimizer is a ShardedOptimizer",
        doc_call="`optimizer_sharded_state_dict(optimizer, ...)`",
        doc_input="a `ShardedOptimizer`",
        also=("its own sharded_state_dict()",),
    ),
    "osd_model_state": Expect(
        "TypeError: model_sharded_state_dict must be a mapping",
        doc_call="`optimizer_sharded_state_dict(optimizer, model_sharded_state_dict)`",
        doc_input="`None`",
    ),
    "osd_loading": Expect(
        "TypeError: is_loading='yes' must be a bool",
        doc_call="`optimizer_sharded_state_dict(..., is_loading=)`",
        doc_input="`'yes'`",
    ),
    "load_osd_state": Expect(
        "TypeError: state_dict must be the mapping optimizer_sharded_state_dict() returned, "
        "got NoneType",
        doc_call="`load_optimizer_sharded_state_dict(optimizer, state_dict, ...)`",
        doc_input="`None`",
    ),
    "load_osd_optimizer": Expect(
        "TypeError: load_optimizer_sharded_state_dict: optimizer must be a torch.optim.Optimizer",
        doc_call="`load_optimizer_sharded_state_dict(optimizer, ...)`",
        doc_input="`None`",
    ),
}


def test_fsdp2_entry_points(rank_pools: RankPools) -> None:
    """The FSDP2 entry points refuse bad input by name before any collective and before
    anything changes (the wrapper and the optimizer-state functions check inside
    ``mg.fail_together``: every rank raises)."""
    for found in rank_pools.get(2).run(_fsdp2_errors):
        for name, expect in FSDP2.items():
            message, issued = found[name]
            assert_fails_as(name, message, expect)
            assert issued == 0, name
