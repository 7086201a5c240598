"""Initialisation: CPU init equals the TP=1 weight sliced; device init follows the RNG
tracker; TP attributes are set with and without initialisation.

CPU init copies values (no arithmetic), so shards are compared with ``torch.equal``. The
expected slices are computed here from a master weight drawn with the same seed, cut
into ``W·stride`` blocks of which rank r owns ``r, r + W, …`` (Megatron's strided layout).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers.layers import (
    _initialize_affine_weight_cpu,
    param_is_not_tensor_parallel_duplicate,
)
from mc_tp_layers.random import clear_cuda_rng_tracker
from mc_tp_layers_tests._helpers import config, row_parallel, world

SEED = 1234


def _init(t: torch.Tensor) -> None:
    torch.nn.init.normal_(t, mean=0.0, std=0.02)


def _master(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(SEED)
    master = torch.empty(rows, cols)
    _init(master)
    return master


def _strided(master: torch.Tensor, w: int, r: int, stride: int, dim: int) -> torch.Tensor:
    blocks = master.chunk(w * stride, dim=dim)
    return torch.cat([blocks[j * w + r] for j in range(stride)], dim=dim)


def _cpu_shards(stride: int) -> dict[str, Any]:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        cfg = config(w)
        torch.manual_seed(SEED)
        col = tpl.ColumnParallelLinear(
            8,
            16,
            config=cfg,
            init_method=_init,
            stride=stride,
            pg_collection=pgc,
            keep_master_weight_for_test=True,
        )
        torch.manual_seed(SEED)
        row = row_parallel(16, 8, cfg, _init, stride=stride, pg_collection=pgc)
        torch.manual_seed(SEED)
        emb = tpl.VocabParallelEmbedding(16, 8, init_method=_init, config=cfg, pg_collection=pgc)
        assert col.weight is not None
        assert col.bias is not None
        assert row.bias is not None
        return {
            "col": col.weight.detach(),
            "row": row.weight.detach(),
            "emb": emb.weight.detach(),
            "master": col.master_weight,
            "col_bias": col.bias.detach(),
            "row_bias": row.bias.detach(),
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(("w", "stride"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_cpu_init_equals_tp1_weight_sliced(rank_pools: RankPools, w: int, stride: int) -> None:
    col_master, row_master = _master(16, 8), _master(8, 16)
    emb_master = _master(16, 8)
    for r, out in enumerate(rank_pools.get(w).run(_cpu_shards, stride)):
        assert torch.equal(out["master"], col_master)
        assert torch.equal(out["col"], _strided(col_master, w, r, stride, 0))
        assert torch.equal(out["row"], _strided(row_master, w, r, stride, 1))
        assert torch.equal(out["emb"], emb_master.chunk(w, 0)[r])
        assert torch.equal(out["col_bias"], torch.zeros(16 // w))
        assert torch.equal(out["row_bias"], torch.zeros(8))


def test_cpu_init_function_with_explicit_rank() -> None:
    # rank 1 of 2 with stride 2 keeps blocks 1 and 3 of four 2-row blocks
    weight = torch.empty(4, 3)
    master = _initialize_affine_weight_cpu(
        weight,
        8,
        3,
        4,
        0,
        lambda t: t.copy_(torch.arange(24.0).reshape(8, 3)),
        stride=2,
        return_master_weight=True,
        rank=1,
        world_size=2,
    )
    assert master is not None
    assert torch.equal(weight, torch.cat([master[2:4], master[6:8]]))
    assert (weight.tensor_model_parallel, weight.partition_dim, weight.partition_stride) == (  # type: ignore[attr-defined]
        True,
        0,
        2,
    )


def _attributes(perform: bool, sp: bool) -> dict[str, Any]:
    pgc = world(2)
    try:
        cfg = config(
            2, perform_initialization=perform, sequence_parallel=sp, expert_model_parallel_size=1
        )
        col = tpl.ColumnParallelLinear(
            8, 16, config=cfg, init_method=_init, stride=2, pg_collection=pgc
        )
        row = row_parallel(16, 8, cfg, _init, skip_bias_add=True, pg_collection=pgc)
        emb = tpl.VocabParallelEmbedding(16, 8, init_method=_init, config=cfg, pg_collection=pgc)
        names = (
            "tensor_model_parallel",
            "partition_dim",
            "partition_stride",
            "allreduce",
            "sequence_parallel",
        )
        params = {
            "col.w": col.weight,
            "col.b": col.bias,
            "row.w": row.weight,
            "row.b": row.bias,
            "emb.w": emb.weight,
        }
        return {key: {n: getattr(p, n, "unset") for n in names} for key, p in params.items()} | {
            "dup": [
                p is not None and param_is_not_tensor_parallel_duplicate(p, pgc.tp)
                for p in params.values()
            ],
        }
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(("perform", "sp"), [(True, False), (False, True)])
def test_tp_attributes_are_set_with_or_without_initialisation(
    rank_pools: RankPools, perform: bool, sp: bool
) -> None:
    for r, out in enumerate(rank_pools.get(2).run(_attributes, perform, sp)):
        sharded = {"allreduce": True, "sequence_parallel": "unset", "tensor_model_parallel": True}
        assert out["col.w"] == sharded | {"partition_dim": 0, "partition_stride": 2}
        assert out["col.b"] == sharded | {"partition_dim": 0, "partition_stride": 2}
        assert out["row.w"] == sharded | {"partition_dim": 1, "partition_stride": 1}
        assert out["emb.w"] == sharded | {"partition_dim": 0, "partition_stride": 1}
        assert out["row.b"] == {
            "tensor_model_parallel": False,
            "partition_dim": -1,
            "partition_stride": 1,
            "allreduce": True,
            "sequence_parallel": sp,
        }
        # shards are unique on every rank; the replicated row bias counts on TP rank 0 only
        assert out["dup"] == [True, True, True, r == 0, True]


def _expert_tags(ep: int, etp: int) -> dict[str, list[bool]]:
    pgc = world(2, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    try:
        cfg = config(
            2,
            expert_model_parallel_size=ep,
            expert_tensor_parallel_size=etp,
            sequence_parallel=True,
        )
        tags: dict[str, list[bool]] = {}
        for is_expert in (False, True):
            with warnings.catch_warnings():  # an expert-TP group of one rank disables SP
                warnings.simplefilter("ignore", UserWarning)
                col = tpl.ColumnParallelLinear(
                    8, 16, config=cfg, init_method=_init, is_expert=is_expert, pg_collection=pgc
                )
            row = row_parallel(
                16, 8, cfg, _init, skip_bias_add=True, is_expert=is_expert, pg_collection=pgc
            )
            params = (col.weight, col.bias, row.weight, row.bias)
            tags[str(is_expert)] = [bool(getattr(p, "allreduce", "unset")) for p in params]
            tags[f"{is_expert} sp"] = [bool(getattr(row.bias, "sequence_parallel", False))]
        return tags
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(
    ("ep", "etp", "expert_allreduce"), [(1, 2, True), (1, 1, False), (2, 1, False)]
)
def test_expert_allreduce_tag(
    rank_pools: RankPools, ep: int, etp: int, expert_allreduce: bool
) -> None:
    """``allreduce = not (is_expert and (ep > 1 or etp != tp))`` on every weight and bias
    (Megatron-Core's ``use_expert_pgs`` in ColumnParallelLinear / RowParallelLinear,
    megatron/core/tensor_parallel/layers.py). TP = 2 on 2 ranks: an expert layer with
    EP = 1 and ETP = 1 ≠ TP is reduced over the expert-DP group (False), one with ETP = TP
    and EP = 1 like a dense layer (True); dense layers are always True.

    Under sequence parallelism a dense Row bias is tagged ``sequence_parallel`` (finalize
    sums it over TP) and an expert Row bias is not — mc's deliberate difference from
    Megatron, which tags it too and so double-counts it (see test_parity_experts.py)."""
    for out in rank_pools.get(2).run(_expert_tags, ep, etp):
        assert out == {
            "False": [True] * 4,
            "True": [expert_allreduce] * 4,
            "False sp": [True],
            "True sp": [False],
        }


def _device_init(is_expert: bool, use_default: bool) -> dict[str, Any]:
    pgc = world(2)
    try:
        cfg = config(2, use_cpu_initialization=False)
        tracker = tpl.model_parallel_cuda_manual_seed(SEED, pg_collection=pgc, device="cpu")
        col = tpl.ColumnParallelLinear(
            8,
            16,
            config=cfg,
            init_method=_init,
            is_expert=is_expert,
            pg_collection=pgc,
            rng_tracker=None if use_default else tracker,
            device="cpu",
        )
        assert col.weight is not None
        # the default generator was seeded with SEED and the init drew from the tracker
        return {"w": col.weight.detach(), "next_default": torch.rand(3)}
    finally:
        clear_cuda_rng_tracker()
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("use_default", [False, True], ids=["explicit", "default"])
@pytest.mark.parametrize("is_expert", [False, True])
def test_device_init_draws_from_the_tracker_stream(
    rank_pools: RankPools, is_expert: bool, use_default: bool
) -> None:
    """2 ranks, TP = 2 = expert TP, EP = 1: tp_rank = etp_rank = r, ep_rank = 0. With
    ``rng_tracker=None`` the layer uses the tracker ``model_parallel_cuda_manual_seed``
    registered (Megatron's layers read its global tracker): the same weights."""
    for r, out in enumerate(rank_pools.get(2).run(_device_init, is_expert, use_default)):
        seed = SEED + 1024 + r if is_expert else SEED + 2718 + r
        expected = torch.empty(8, 8)
        torch.manual_seed(seed)
        _init(expected)
        assert torch.equal(out["w"], expected)
        assert torch.equal(
            out["next_default"], torch.rand(3, generator=torch.Generator().manual_seed(SEED))
        )


class _Group:
    """The rank and size a GTP shard's ``group`` reports."""

    def __init__(self, size: int, rank: int) -> None:
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def test_cpu_init_of_a_gtp_shard_takes_its_rows() -> None:
    # TP rank 0 of 2 owns master rows 0-4 of [10, 3]; over 2 gtp_remat ranks those 5 rows
    # are padded to 6, so gtp rank 1 holds rows 3-4 and one zero row.
    shard = torch.empty(3, 3)
    shard.is_gtp_weight_remat = True  # type: ignore[attr-defined]
    shard.group = _Group(2, 1)  # type: ignore[attr-defined]
    master = _initialize_affine_weight_cpu(
        shard,
        10,
        3,
        5,
        0,
        lambda t: t.copy_(torch.arange(30.0).reshape(10, 3)),
        return_master_weight=True,
        rank=0,
        world_size=2,
    )
    assert master is not None
    assert torch.equal(shard, torch.cat([master[3:5], torch.zeros(1, 3)]))
