"""mc-tp-layers: mappings, linear functions, cross-entropy, utilities, checkpoint views and
the RNG tracker."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from integration_tests._sweep_cases.base import (
    NAN,
    Ctx,
    T,
    arg,
    misuse,
    tp_config,
    tpl,
    z,
)
from integration_tests._sweep_cases.groups_collectives import (
    _enter,
)
from mc_tp_layers import layers as tp_layers
from mc_tp_layers import mappings as tp_mappings
from mc_tp_layers.gtp import shard_weight_for_gtp
from mc_tp_layers.layers import (
    copy_gtp_attributes,
    copy_tensor_model_parallel_attributes,
    gtp_local_pad_zero_count,
    param_is_not_tensor_parallel_duplicate,
    set_tensor_model_parallel_attributes,
)
from mc_tp_layers.linear import (
    drain_embedding_wgrad_compute,
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.mappings import all_to_all, gather_from_sequence_parallel_region
from mc_tp_layers.random import set_cuda_rng_tracker
from mc_tp_layers.sharded_state import tp_sharded_tensor
from mc_tp_layers.utils import VocabUtility, divide, split_tensor_along_last_dim

_MAPPINGS = (
    "copy_to_tensor_model_parallel_region",
    "reduce_from_tensor_model_parallel_region",
    "scatter_to_tensor_model_parallel_region",
    "gather_from_tensor_model_parallel_region",
    "scatter_to_sequence_parallel_region",
    "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "all_gather_last_dim_from_tensor_parallel_region",
    "reduce_scatter_last_dim_to_tensor_parallel_region",
    "all_to_all_sp2hp",
    "all_to_all_hp2sp",
)


def _function_slots() -> None:
    for name in _MAPPINGS:
        fn = getattr(tp_mappings, name)
        arg(
            T,
            f"{name}(input_=)",
            "tensor",
            lambda c, v, f=fn: f(v, group=c.world_group),
            ("input",),
            good=torch.ones(2, 4),
        )
        arg(T, f"{name}(group=)", "opt_group", lambda c, v, f=fn: f(torch.ones(2, 4), group=v))
    for name in ("tensor_parallel_output_grad", "use_global_buffer"):
        arg(
            T,
            f"gather_from_sequence_parallel_region({name}=)",
            "flag",
            lambda c, v, n=name: gather_from_sequence_parallel_region(
                torch.ones(2, 4), group=c.world_group, **{n: v}
            ),
        )
    arg(T, "mappings.all_to_all(group=)", "group", lambda c, v: all_to_all(v, torch.ones(4)))
    arg(
        T,
        "mappings.all_to_all(input_=)",
        "tensor",
        lambda c, v: all_to_all(c.world_group, v),
        ("input",),
        good=torch.ones(4),
    )
    arg(
        T,
        "gather_from_sequence_parallel_region(output_split_sizes=)",
        "misuse",
        lambda c, v: gather_from_sequence_parallel_region(
            torch.ones(2, 2), group=c.world_group, output_split_sizes=v
        ),
        ("output_split_sizes",),
        values=([3], "x", [1.5], [-2]),
        only=True,
        good=[2],
    )
    lin = linear_with_grad_accumulation_and_async_allreduce

    def linear(c: Ctx, **kw: Any) -> Any:
        args: dict[str, Any] = {
            "input": torch.ones(2, 4, requires_grad=True),
            "weight": torch.ones(6, 4),
            "bias": None,
            "gradient_accumulation_fusion": False,
            "allreduce_dgrad": False,
            "sequence_parallel": False,
            "tp_group": c.world_group,
        }
        args.update(kw)
        return lin(**args)

    for name in ("gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel"):
        arg(
            T,
            f"linear_with_grad_accumulation_and_async_allreduce({name}=)",
            "flag",
            lambda c, v, n=name: linear(c, **{n: v}),
        )
    for name, values in (
        ("input", (torch.ones(2, 5), torch.ones(2, 4, dtype=torch.int64))),
        ("weight", (torch.ones(6, 5), torch.ones(6))),
        ("bias", (torch.ones(5), "x")),
    ):
        arg(
            T,
            f"linear_with_grad_accumulation_and_async_allreduce({name}=)",
            "misuse",
            lambda c, v, n=name: linear(c, **{n: v}),
            (name,),
            values=values,
            only=True,
        )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(wgrad_deferral_limit=)",
        "count",
        lambda c, v: linear(c, wgrad_deferral_limit=v),
        values=(NAN,),
    )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(gtp_remat_size=)",
        "size",
        lambda c, v: linear(c, gtp_remat_size=v),
    )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(output_dtype=)",
        "opt_dtype",
        lambda c, v: linear(c, output_dtype=v),
    )
    arg(
        T,
        "linear_with_grad_accumulation_and_async_allreduce(tp_group=)",
        "opt_group",
        lambda c, v: linear(c, tp_group=v),
    )
    frozen = linear_with_frozen_weight
    for name in ("gradient_accumulation_fusion", "allreduce_dgrad", "sequence_parallel"):
        arg(
            T,
            f"linear_with_frozen_weight({name}=)",
            "flag",
            lambda c, v, n=name: frozen(**{**_FROZEN, n: v, "tp_group": c.world_group}),
        )
    arg(
        T,
        "linear_with_frozen_weight(tp_group=)",
        "opt_group",
        lambda c, v: frozen(**{**_FROZEN, "tp_group": v}),
    )
    arg(
        T,
        "linear_with_frozen_weight(weight=)",
        "misuse",
        lambda c, v: frozen(**{**_FROZEN, "weight": v, "tp_group": c.world_group}),
        ("weight",),
        values=(torch.ones(6, 5), None),
        only=True,
    )
    # utilities and attributes
    arg(
        T,
        "divide(numerator=)",
        "count",
        lambda c, v: divide(v, 2),
        ("numerator",),
        values=(5,),
        good=4,
    )
    arg(T, "divide(denominator=)", "size", lambda c, v: divide(4, v), ("denominator",), good=2)
    arg(
        T,
        "split_tensor_along_last_dim(num_partitions=)",
        "size",
        lambda c, v: split_tensor_along_last_dim(torch.ones(2, 4), v),
        ("num_partitions",),
        values=(3,),
    )
    arg(
        T,
        "split_tensor_along_last_dim(tensor=)",
        "tensor",
        lambda c, v: split_tensor_along_last_dim(v, 2),
        ("tensor",),
        good=torch.ones(2, 4),
    )
    arg(
        T,
        "split_tensor_along_last_dim(contiguous_split_chunks=)",
        "flag",
        lambda c, v: split_tensor_along_last_dim(torch.ones(2, 4), 2, v),
    )
    vu = VocabUtility
    for name, call in (
        ("global_vocab_size", lambda v: vu.vocab_range_from_global_vocab_size(v, 0, 2)),
        ("rank", lambda v: vu.vocab_range_from_global_vocab_size(8, v, 2)),
        (
            "per_partition_vocab_size",
            lambda v: vu.vocab_range_from_per_partition_vocab_size(v, 0, 2),
        ),
    ):
        arg(
            T,
            f"VocabUtility.vocab_range_*({name}=)",
            "count",
            lambda c, v, f=call: f(v),
            (name,),
            values=(-8, 2) if name == "rank" else (-8,),
            good=0 if name == "rank" else 8,
        )
    sta = set_tensor_model_parallel_attributes
    arg(
        T,
        "set_tensor_model_parallel_attributes(tensor=)",
        "tensor",
        lambda c, v: sta(v, True, 0, 1),
        ("tensor",),
        good=nn.Parameter(torch.ones(2, 2)),
    )
    arg(
        T,
        "set_tensor_model_parallel_attributes(is_parallel=)",
        "flag",
        lambda c, v: sta(nn.Parameter(torch.ones(2, 2)), v, 0, 1),
    )
    arg(
        T,
        "set_tensor_model_parallel_attributes(dim=)",
        "misuse",
        lambda c, v: sta(nn.Parameter(torch.ones(2, 2)), True, v, 1),
        ("dim",),
        values=(5, -3, "0", True, 1.0),
        only=True,
        good=1,
    )
    arg(
        T,
        "set_tensor_model_parallel_attributes(stride=)",
        "size",
        lambda c, v: sta(nn.Parameter(torch.ones(2, 2)), True, 0, v),
        ("stride",),
    )
    for name in (
        "set_defaults_if_not_set_tensor_model_parallel_attributes",
        "param_is_not_gtp_duplicate",
    ):
        arg(
            T,
            f"{name}(tensor=)",
            "tensor",
            lambda c, v, n=name: getattr(tp_layers, n)(v),
            ("tensor", "param"),
            good=nn.Parameter(z()),
        )
    arg(
        T,
        "param_is_not_tensor_parallel_duplicate(param=)",
        "tensor",
        lambda c, v: param_is_not_tensor_parallel_duplicate(v, c.world_group),
        ("param",),
        good=nn.Parameter(z()),
    )
    arg(
        T,
        "param_is_not_tensor_parallel_duplicate(tp_group=)",
        "opt_group",
        lambda c, v: param_is_not_tensor_parallel_duplicate(nn.Parameter(z()), v),
    )
    arg(
        T,
        "copy_tensor_model_parallel_attributes(source_tensor=)",
        "tensor",
        lambda c, v: copy_tensor_model_parallel_attributes(nn.Parameter(z()), v),
        ("source", "tensor"),
        good=nn.Parameter(z()),
    )
    arg(
        T,
        "copy_gtp_attributes(destination=)",
        "tensor",
        lambda c, v: copy_gtp_attributes(v, nn.Parameter(z())),
        ("destination",),
        good=nn.Parameter(z()),
    )
    arg(
        T,
        "gtp_local_pad_zero_count(range_start=)",
        "misuse",
        lambda c, v: gtp_local_pad_zero_count(z(), v, 4),
        ("range_start",),
        values=(-1, 5, "0", 1.5),
        only=True,
        good=0,
    )
    arg(
        T,
        "gtp_local_pad_zero_count(gtp_shard=)",
        "tensor",
        lambda c, v: gtp_local_pad_zero_count(v, 0, 4),
        ("gtp_shard",),
        good=z(),
    )
    arg(
        T,
        "shard_weight_for_gtp(group=)",
        "group",
        lambda c, v: shard_weight_for_gtp(nn.Parameter(torch.ones(4, 2)), v),
    )
    arg(
        T,
        "shard_weight_for_gtp(weight=)",
        "tensor",
        lambda c, v: shard_weight_for_gtp(v, c.world_group),
        ("weight",),
        good=nn.Parameter(torch.ones(4, 2)),
    )
    arg(
        T,
        "shard_weight_for_gtp(calculate_per_token_loss=)",
        "flag",
        lambda c, v: shard_weight_for_gtp(
            nn.Parameter(torch.ones(4, 2)), c.world_group, calculate_per_token_loss=v
        ),
    )
    arg(
        T,
        "tp_sharded_tensor(partition_dim=)",
        "misuse",
        lambda c, v: tp_sharded_tensor(torch.ones(2, 2), c.world_group, v),
        ("partition_dim",),
        values=(5, -3, "0", None),
        only=True,
        good=0,
    )
    arg(
        T,
        "tp_sharded_tensor(stride=)",
        "size",
        lambda c, v: tp_sharded_tensor(torch.ones(2, 2), c.world_group, 0, v),
        ("stride",),
    )
    arg(
        T,
        "tp_sharded_tensor(tp_group=)",
        "group",
        lambda c, v: tp_sharded_tensor(torch.ones(2, 2), v, 0),
    )
    arg(
        T,
        "drain_embedding_wgrad_compute(weight=)",
        "misuse",
        lambda c, v: drain_embedding_wgrad_compute(
            tp_config(), [torch.ones(2, 4)], [torch.ones(2, 6)], v, c.world_group
        ),
        ("weight", "main_grad"),
        values=(None, torch.ones(6, 4)),
        only=True,
    )
    misuse(
        T,
        "drain_embedding_wgrad_compute keeps its buffers when it fails",
        _drain_keeps,
        ("weight", "main_grad"),
    )


_FROZEN: dict[str, Any] = {
    "input": torch.ones(2, 4),
    "weight": torch.ones(6, 4),
    "bias": None,
    "gradient_accumulation_fusion": False,
    "allreduce_dgrad": False,
    "sequence_parallel": False,
}


def _drain_keeps(ctx: Ctx) -> None:
    acts, grads = [torch.ones(2, 4)], [torch.ones(2, 6)]
    try:
        drain_embedding_wgrad_compute(tp_config(), acts, grads, torch.ones(6, 4), ctx.world_group)
    except (TypeError, ValueError):
        if len(acts) == 1 and len(grads) == 1:
            raise
        raise AttributeError(
            "drain_embedding_wgrad_compute emptied its buffers, then failed"
        ) from None


def _rng_slots() -> None:
    tracker = tpl.RNGStatesTracker
    arg(T, "RNGStatesTracker(device=)", "device", lambda c, v: tracker(v), values=(None,))
    arg(
        T,
        "RNGStatesTracker.add(name=)",
        "misuse",
        lambda c, v: tracker().add(v, 1),
        ("name",),
        values=(3, None, ""),
        only=True,
        good="a",
    )
    arg(
        T,
        "RNGStatesTracker.add(seed=)",
        "misuse",
        lambda c, v: tracker().add("a", v),
        ("seed",),
        values=("1", 1.5, True, None, -1, 2**70),
        only=True,
        good=1,
    )
    arg(
        T,
        "RNGStatesTracker.set_states(states=)",
        "misuse",
        lambda c, v: tracker().set_states(v),
        ("states",),
        values=(None, "x", {"a": z()}, {3: torch.get_rng_state()}),
        only=True,
        good={},
    )
    arg(
        T,
        "RNGStatesTracker.fork(name=)",
        "misuse",
        lambda c, v: _enter(tracker().fork(v)),
        ("name", "stream"),
        values=(3, None, "nope"),
        only=True,
    )
    arg(
        T,
        "set_cuda_rng_tracker(tracker=)",
        "misuse",
        lambda c, v: set_cuda_rng_tracker(v),
        ("tracker",),
        values=(None, "x"),
        only=True,
        good=tracker(),
    )
    seed = tpl.model_parallel_cuda_manual_seed
    arg(
        T,
        "model_parallel_cuda_manual_seed(seed=)",
        "misuse",
        lambda c, v: seed(v, pg_collection=c.pgc),
        ("seed",),
        values=("1", 1.5, True, None, -1),
        only=True,
        good=1,
    )
    for name in (
        "te_rng_tracker",
        "inference_rng_tracker",
        "use_cudagraphable_rng",
        "force_reset_rng",
        "set_default",
    ):
        arg(
            T,
            f"model_parallel_cuda_manual_seed({name}=)",
            "flag",
            lambda c, v, n=name: seed(1, **{n: v}, pg_collection=c.pgc),
        )
    for name in ("tp_rank", "ep_rank", "etp_rank"):
        arg(
            T,
            f"model_parallel_cuda_manual_seed({name}=)",
            "count",
            lambda c, v, n=name: seed(1, **{n: v}, pg_collection=c.pgc),
            good=0,
        )
    arg(
        T,
        "model_parallel_cuda_manual_seed(device=)",
        "device",
        lambda c, v: seed(1, device=v, pg_collection=c.pgc),
    )
    arg(
        T,
        "model_parallel_cuda_manual_seed(pg_collection=)",
        "collection",
        lambda c, v: seed(1, pg_collection=v),
        ("pg_collection",),
    )
