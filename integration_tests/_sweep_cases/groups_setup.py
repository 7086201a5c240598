"""mc-groups: layouts, collections, the rank generator, config, pipeline, devices, the test
harness and argcheck."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from integration_tests._sweep_cases.base import (
    HUGE,
    Ctx,
    G,
    Ref,
    arg,
    device,
    mg,
    misuse,
    testing,
    z,
)
from integration_tests._sweep_cases.groups_collectives import (
    _enter,
)
from mc_groups import collection, pipeline_stages
from mc_groups.rank_generator import RankGenerator

_SIZE_ARGS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_remat_size",
    "expert_gtp_remat_size",
    "num_distributed_optimizer_instances",
)


def _layout_slots() -> None:
    for name in _SIZE_ARGS:
        extra = (HUGE,) if name == "tensor_model_parallel_size" else ()
        good = 2 if name == "virtual_pipeline_model_parallel_size" else 1
        arg(
            G,
            f"initialize_model_parallel({name}=)",
            "size",
            lambda c, v, n=name: mg.initialize_model_parallel(**{n: v}),
            values=extra,
            good=None if good == 2 else 1,
        )
        arg(
            G,
            f"validate_sizes({name}=)",
            "size",
            lambda c, v, n=name: mg.validate_sizes(8, **{n: v}),
            values=extra,
            good=None if good == 2 else 1,
        )
    arg(
        G,
        "validate_sizes(world_size=)",
        "size",
        lambda c, v: mg.validate_sizes(v),
        ("world_size",),
        values=(None, HUGE + 0.5),
        good=8,
    )
    orders = ("tp-xx", 3, None, "tp-tp", "")
    arg(
        G,
        "initialize_model_parallel(order=)",
        "misuse",
        lambda c, v: mg.initialize_model_parallel(order=v),
        ("order",),
        values=orders,
        only=True,
        good="tp-cp-ep-dp-pp",
    )
    arg(
        G,
        "initialize_model_parallel(timeout=)",
        "misuse",
        lambda c, v: mg.initialize_model_parallel(timeout=v),
        ("timeout",),
        values=(10, "10s", -1.0, timedelta(seconds=-1)),
        only=True,
        good=timedelta(seconds=30),
    )
    arg(
        G,
        "initialize_model_parallel(set_default=)",
        "flag",
        lambda c, v: mg.initialize_model_parallel(set_default=v),
    )
    # destroy
    arg(
        G,
        "destroy_model_parallel(collection=)",
        "misuse",
        lambda c, v: mg.destroy_model_parallel(v),
        ("collection",),
        values=(None, "tp", {"tp": None}, Ref("world"), 3),
        only=True,
    )
    misuse(G, "destroy_model_parallel twice", _destroy_twice, ("destroy",))
    misuse(
        G,
        "all_reduce on a destroyed collection's group",
        lambda c: _after_destroy(c, lambda p: mg.all_reduce(z(), p.tp)),
        ("destroy",),
    )
    misuse(
        G,
        "require on a destroyed collection",
        lambda c: _after_destroy(c, lambda p: p.require("dp", "a step")),
        ("destroy",),
    )
    # default collection, collections
    arg(
        G,
        "set_default_collection(collection=)",
        "misuse",
        lambda c, v: collection.set_default_collection(v),
        ("collection",),
        values=("tp", None, Ref("world"), {}),
        only=True,
        good=Ref("pgc"),
    )
    for field in ("tp", "dp", "world"):
        arg(
            G,
            f"ProcessGroupCollection({field}=)",
            "misuse",
            lambda c, v, f=field: mg.ProcessGroupCollection(**{f: v}),
            (field,),
            values=("x", 3, [Ref("world")]),
            only=True,
            good=None,
        )
    arg(
        G,
        "ProcessGroupCollection.require(name=)",
        "misuse",
        lambda c, v: c.pgc.require(v, "a step"),
        ("name",),
        values=(3, None, "nope", ""),
        only=True,
        good="tp",
    )
    arg(
        G,
        "ProcessGroupCollection.require(needed_for=)",
        "misuse",
        lambda c, v: mg.ProcessGroupCollection().require("tp", v),
        ("needed_for",),
        values=(3, None),
        only=True,
    )


def _destroy_twice(ctx: Ctx) -> None:
    pgc = ctx.fresh_pgc()
    mg.destroy_model_parallel(pgc)
    mg.destroy_model_parallel(pgc)


def _after_destroy(ctx: Ctx, use: Callable[[Any], object]) -> None:
    pgc = ctx.fresh_pgc()
    mg.destroy_model_parallel(pgc)
    use(pgc)


def _generator_slots() -> None:
    base: dict[str, Any] = {"tp": 1, "ep": 1, "dp": 1, "pp": 1, "cp": 1}

    def generate(**changes: Any) -> Any:
        return RankGenerator(**{**base, **changes}).get_ranks("dp")

    for name in ("tp", "ep", "dp", "pp", "cp", "gtp_remat"):
        extra = (HUGE,) if name in ("tp", "dp") else ()
        arg(
            G,
            f"RankGenerator({name}=)",
            "size",
            lambda c, v, n=name: generate(**{n: v}),
            values=extra,
        )
    arg(
        G,
        "RankGenerator(rank_offset=)",
        "count",
        lambda c, v: generate(rank_offset=v),
        values=(None,),
    )
    arg(
        G,
        "RankGenerator(order=)",
        "misuse",
        lambda c, v: generate(order=v),
        ("order",),
        values=("tp-xx", 3, None, "tp-tp", ""),
        only=True,
        good="tp-dp",
    )
    arg(G, "RankGenerator(is_expert=)", "flag", lambda c, v: generate(is_expert=v))
    arg(
        G,
        "RankGenerator.get_ranks(token=)",
        "misuse",
        lambda c, v: RankGenerator(**base).get_ranks(v),
        ("token",),
        values=(3, None, "", "tp-zz"),
        only=True,
        good="tp",
    )


_MPC_BOOLS = (
    "sequence_parallel",
    "perform_initialization",
    "use_cpu_initialization",
    "fp16",
    "bf16",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
    "calculate_per_token_loss",
    "delay_wgrad_compute",
    "tp_comm_overlap",
)


def _config_slots() -> None:
    for name in _SIZE_ARGS[:-1]:
        if name == "expert_gtp_remat_size":
            continue
        good = None if name.startswith(("virtual", "expert_tensor")) else 1
        arg(
            G,
            f"ModelParallelConfig({name}=)",
            "size",
            lambda c, v, n=name: mg.ModelParallelConfig(**{n: v}),
            good=good,
        )
    for name in _MPC_BOOLS:
        arg(
            G,
            f"ModelParallelConfig({name}=)",
            "flag",
            lambda c, v, n=name: mg.ModelParallelConfig(**{n: v}),
        )
    arg(
        G,
        "ModelParallelConfig(params_dtype=)",
        "dtype",
        lambda c, v: mg.ModelParallelConfig(params_dtype=v),
    )
    arg(
        G,
        "ModelParallelConfig(wgrad_deferral_limit=)",
        "count",
        lambda c, v: mg.ModelParallelConfig(wgrad_deferral_limit=v),
    )
    arg(
        G,
        "ModelParallelConfig.replace(sequence_parallel=)",
        "flag",
        lambda c, v: mg.ModelParallelConfig().replace(sequence_parallel=v),
    )


def _pipeline_slots() -> None:
    for name in (
        "pipeline_rank",
        "pipeline_size",
        "get_pipeline_next_rank",
        "get_pipeline_prev_rank",
        "is_pipeline_first_stage",
        "is_pipeline_last_stage",
    ):
        arg(
            G,
            f"{name}(pg_collection=)",
            "misuse",
            lambda c, v, n=name: getattr(pipeline_stages, n)(v),
            ("pg_collection",),
            values=(None, "pp", Ref("world"), {}),
            only=True,
            good=Ref("pgc"),
        )
    for name in ("is_pipeline_first_stage", "is_pipeline_last_stage"):
        arg(
            G,
            f"{name}(vp_stage=)",
            "misuse",
            lambda c, v, n=name: getattr(pipeline_stages, n)(c.pgc, vp_stage=v, vp_size=2),
            ("vp_stage",),
            values=(-1, 2, "0", True, 1.5),
            only=True,
            good=1,
        )
        arg(
            G,
            f"{name}(vp_size=)",
            "misuse",
            lambda c, v, n=name: getattr(pipeline_stages, n)(c.pgc, vp_stage=0, vp_size=v),
            ("vp_size",),
            values=(0, -1, "2", True),
            only=True,
            good=2,
        )


def _device_slots() -> None:
    for name in ("current_stream", "side_stream", "synchronize", "empty_cache"):
        arg(
            G,
            f"device.{name}(device=)",
            "device",
            lambda c, v, n=name: getattr(device, n)(v),
            values=([],),
        )
    arg(
        G,
        "device.stream_scope(stream=)",
        "misuse",
        lambda c, v: _enter(device.stream_scope(v)),
        ("stream",),
        values=("x", 3),
        only=True,
        good=device.NullStream(),
    )


def _harness_slots() -> None:
    pool = testing.RankPool
    arg(G, "RankPool(world_size=)", "size", lambda c, v: pool(v), ("world_size",))
    arg(
        G,
        "RankPool(backend=)",
        "misuse",
        lambda c, v: pool(1, backend=v),
        ("backend",),
        values=("mpi", 3, None),
        only=True,
        good="gloo",
    )
    for name in ("pg_timeout_s", "call_deadline_s", "start_deadline_s", "failure_grace_s"):
        arg(G, f"RankPool({name}=)", "real", lambda c, v, n=name: pool(1, **{n: v}), values=(-1.0,))
    arg(
        G,
        "RankPool(env=)",
        "misuse",
        lambda c, v: pool(1, env=v),
        ("env",),
        values=("x", {1: "2"}, {"A": 1}),
        only=True,
        good={"A": "1"},
    )
    arg(
        G,
        "RankPool(preload=)",
        "misuse",
        lambda c, v: pool(1, preload=v),
        ("preload",),
        values=("transformers", [1], [""]),
        only=True,
        good=["json"],
    )
    arg(
        G, "RankPools(pg_timeout_s=)", "real", lambda c, v: testing.RankPools(pg_timeout_s=v).get(1)
    )
    arg(
        G,
        "RankPools(preload=)",
        "misuse",
        lambda c, v: testing.RankPools(preload=v).get(1),
        ("preload",),
        values=("transformers", [1], [""]),
        only=True,
        good=["json"],
    )
    arg(
        G,
        "RankPool.run(fn=)",
        "misuse",
        lambda c, v: pool(1).run(v),
        ("fn",),
        values=(3, "fn", None, Ref("lambda")),
        only=True,
    )
    arg(G, "gpu_skip_reason(count=)", "size", lambda c, v: testing.gpu_skip_reason(v), ("count",))
    arg(
        G,
        "RankPool.run_with_deadline(deadline_s=)",
        "real",
        lambda c, v: pool(1).run_with_deadline(v, rank_of_pool),
        ("deadline_s",),
        values=(-1.0, 0.0),
        control=False,  # a good deadline starts a rank process
    )
    misuse(
        G,
        "RankPool.run with an argument that cannot travel",
        lambda c: pool(1).run(rank_of_pool, lambda: 1),
        ("picklable",),
    )
    misuse(G, "CoalescedBatch used after its with block", _batch_after_block, ("closed",))


def rank_of_pool(*args: object) -> int:
    """A function a RankPool could send to its ranks (the cases never get that far)."""
    del args
    return int(dist.get_rank())


def _batch_after_block(ctx: Ctx) -> None:
    with mg.coalesced(ctx.world_group) as batch:
        batch.all_reduce(z())
    batch.all_reduce(z())


def _argcheck_slots() -> None:
    check: Any = mg.argcheck
    arg(
        G,
        "argcheck.check_int(minimum=)",
        "misuse",
        lambda c, v: check.check_int("n", 3, minimum=v),
        ("minimum",),
        values=("1", 1.5, None),
        only=True,
        good=1,
    )
    arg(
        G,
        "argcheck.check_real(positive=)",
        "flag",
        lambda c, v: check.check_real("x", 1.0, positive=v),
    )
    arg(
        G,
        "argcheck.check_float_dtype(allow_none=)",
        "flag",
        lambda c, v: check.check_float_dtype("d", torch.float32, allow_none=v),
    )
