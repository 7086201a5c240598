"""Step 4: non-tensor-parallel grads over tp (SUM for sequence-parallel and q/k layer norms,
and for params marked ``sum_gradients_across_tp_domain`` with or without SP; AVG for params
marked ``average_gradients_across_tp_domain``; the SUM mark refused with the AVG mark or on
a TP shard, and a ``sequence_parallel`` mark while sequence parallelism is off (a mark
finalize would ignore: Megatron-LM #7452, issue 41), before any collective).

Localizes which params each config switch selects, the ``main_grad``/``grad`` fallback,
the per-dtype flat buffers, the SUM-then-AVG schedule on the tp group only, and a DTensor
grad (sharded over dp, FSDP2's) reduced over tp shard by shard: each TP peer holds the same
dp shard, so no gather over dp (test_grad_access.py holds the gather round trip). Grads are
``2**rank`` (exact sums and halves), so results are compared exactly.

Layout: 4 ranks, tp = 2 × dp = 2, rank = tp_rank + 2·dp_rank; tp groups {0, 1}, {2, 3}, so
the tp partner of rank r is r XOR 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

import mc_groups as mg
from mc_finalize import (
    _allreduce_layernorm_grads,
    _allreduce_non_tensor_model_parallel_grads,
    finalize_model_grads,
)
from mc_finalize_tests._helpers import Cfg, Chunk, add_param, first, layout, rank, records
from mc_groups.collection import set_default_collection
from mc_groups.testing import RankPools

LABEL = "non-tensor-parallel grads"


def _chunk(cfg: Cfg) -> Chunk:
    """Norms marked ``sequence_parallel=cfg.sequence_parallel``, as Megatron's layers do."""
    r, sp = rank(), cfg.sequence_parallel
    chunk = Chunk(cfg)
    add_param(chunk, "ln.weight", 2**r, sequence_parallel=sp)
    add_param(chunk, "attn.q_layernorm.weight", 2**r)
    add_param(chunk, "attn.k_layernorm.bias", 2**r, main_grad=False)  # grad, not main_grad
    add_param(chunk, "ln16.weight", 2**r, dtype=torch.bfloat16, sequence_parallel=sp)
    add_param(chunk, "avg.weight", 2**r, average_gradients_across_tp_domain=True)
    add_param(
        chunk,
        "both.weight",
        2**r,
        average_gradients_across_tp_domain=True,
        sequence_parallel=True,
    )
    add_param(chunk, "plain.weight", 2**r)
    add_param(chunk, "summed.weight", 2**r, sum_gradients_across_tp_domain=True)
    add_param(chunk, "frozen.weight", 2**r, requires_grad=False, sequence_parallel=True)
    add_param(chunk, "empty.weight", None, sequence_parallel=sp)
    return chunk


def _values(chunk: Chunk) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, param in chunk.named_parameters():
        has_grad = getattr(param, "main_grad", param.grad) is not None
        out[name] = first(param) if has_grad else None
    return out


def _tp_cases() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(tensor_model_parallel_size=2) as pgc:
        for name, cfg in {
            "sp_qk": Cfg(sequence_parallel=True, qk_layernorm=True),
            "neither": Cfg(),
        }.items():
            chunk = _chunk(cfg)
            with mg.record_collectives() as log:
                _allreduce_non_tensor_model_parallel_grads([chunk], cfg, pgc.tp)
            out[name] = {"values": _values(chunk), "log": records(log)}
        chunk = _chunk(Cfg(sequence_parallel=True))
        set_default_collection(pgc)
        _allreduce_layernorm_grads([chunk], Cfg(sequence_parallel=True))  # legacy alias
        out["alias"] = _values(chunk)
    with layout() as pgc:  # tp = 1: nothing to do
        chunk = _chunk(Cfg(sequence_parallel=True, qk_layernorm=True))
        with mg.record_collectives() as log:
            _allreduce_non_tensor_model_parallel_grads([chunk], chunk.config, pgc.tp)
        out["tp1"] = {"values": _values(chunk), "log": records(log)}
    out["refused"] = _refused_marks()
    return out


def _refused_marks() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(tensor_model_parallel_size=2) as pgc:
        refused: dict[str, dict[str, Any]] = {
            "with_avg": {"sum_gradients_across_tp_domain": True},
            "on_shard": {"sum_gradients_across_tp_domain": True},
            "sp_mark_without_sp": {"sequence_parallel": True},
        }
        refused["with_avg"]["average_gradients_across_tp_domain"] = True
        refused["on_shard"]["tensor_model_parallel"] = True
        for name, marks in refused.items():
            chunk = _chunk(Cfg())
            add_param(chunk, "bad.weight", 1.0, **marks)
            with mg.record_collectives() as log:
                try:
                    _allreduce_non_tensor_model_parallel_grads([chunk], chunk.config, pgc.tp)
                except ValueError as err:
                    out[name] = (type(err).__name__, str(err), len(log))
        chunk = _chunk(Cfg())  # the same mark at the first finalize: nothing runs
        add_param(chunk, "bad.weight", 1.0, sequence_parallel=True)
        with mg.record_collectives(status_exchanges=True) as log:
            try:
                finalize_model_grads([chunk], None, pgc)
            except ValueError as err:
                out["finalize"] = (str(err), len(log), chunk.sync_calls)
    return out


def _dtensor_case() -> dict[str, Any]:
    """A 5-element SP grad, sharded over dp (3 + 2 rows); its full value is 10·tp + arange(5)."""
    with layout(tensor_model_parallel_size=2) as pgc:
        return _dtensor_reduce(pgc)


def _dtensor_reduce(pgc: mg.ProcessGroupCollection) -> dict[str, Any]:
    assert pgc.dp is not None
    assert pgc.tp is not None
    mesh = DeviceMesh.from_group(pgc.dp, "cpu")
    full = torch.arange(5.0) + 10 * pgc.tp.rank()
    chunk = Chunk(Cfg(sequence_parallel=True))
    param = add_param(chunk, "ln.weight", None, shape=(5,), sequence_parallel=True)
    sharded = distribute_tensor(full, mesh, [Shard(0)], src_data_rank=None)
    sharded.tag = "kept"  # type: ignore[attr-defined]
    param.main_grad = sharded  # type: ignore[attr-defined]
    with mg.record_collectives() as log:
        _allreduce_non_tensor_model_parallel_grads([chunk], chunk.config, pgc.tp)
    result = param.main_grad  # type: ignore[attr-defined]
    assert isinstance(result, DTensor)
    return {
        "local": result.to_local().tolist(),
        "placements": [str(p) for p in result.placements],
        "tag": getattr(result, "tag", None),
        "log": records(log),
    }


def test_tp2_sum_avg_fallbacks_and_dtensor(rank_pools: RankPools) -> None:
    for r, out in enumerate(rank_pools.get(4).run(_tp_cases)):
        tp = (r & ~1, r | 1)
        total = float(2**r + 2 ** (r ^ 1))
        own = float(2**r)
        assert out["sp_qk"]["values"] == {
            "ln.weight": total,
            "attn.q_layernorm.weight": total,
            "attn.k_layernorm.bias": total,
            "ln16.weight": total,
            "avg.weight": total / 2,
            "both.weight": total / 2,  # the AVG mark wins
            "plain.weight": own,
            "summed.weight": total,
            "frozen.weight": own,
            "empty.weight": None,
        }
        assert out["sp_qk"]["log"] == [
            ("all_reduce", "sum", tp, "float32", 12, LABEL),  # ln, q/k_layernorm, summed
            ("all_reduce", "sum", tp, "bfloat16", 3, LABEL),
            ("all_reduce", "avg", tp, "float32", 6, LABEL),  # avg, both
        ]
        neither = out["neither"]["values"]
        assert (neither["avg.weight"], neither["both.weight"]) == (total / 2, total / 2)
        assert neither["ln.weight"] == neither["attn.q_layernorm.weight"] == own
        assert neither["summed.weight"] == total  # summed without SP too
        assert out["neither"]["log"] == [
            ("all_reduce", "sum", tp, "float32", 3, LABEL),
            ("all_reduce", "avg", tp, "float32", 6, LABEL),
        ]
        refused = out["refused"]
        assert refused["with_avg"][0] == "InputValueError"
        assert "marked both sum_gradients_across_tp_domain" in refused["with_avg"][1]
        assert refused["on_shard"][0] == "InputValueError"
        assert "tensor-parallel shard" in refused["on_shard"][1]
        assert refused["sp_mark_without_sp"][0] == "InputValueError"
        sp_error = refused["sp_mark_without_sp"][1]
        assert "model[0] param 'bad.weight' is marked sequence_parallel=True" in sp_error
        assert "config.sequence_parallel is False" in sp_error
        assert "mark_sum_gradients_across_tp_domain(param)" in sp_error
        # before any collective
        assert (
            refused["with_avg"][2]
            == refused["on_shard"][2]
            == refused["sp_mark_without_sp"][2]
            == 0
        )
        message, collectives, syncs = refused["finalize"]
        assert "'bad.weight' is marked sequence_parallel=True" in message
        assert (collectives, syncs) == (0, [])  # no collective, no finish_grad_sync
        assert out["alias"]["ln.weight"] == total
        assert out["alias"]["attn.q_layernorm.weight"] == own  # qk_layernorm off
        assert all(v in (own, None) for v in out["tp1"]["values"].values())
        assert out["tp1"]["log"] == []


def test_dtensor_grad_reduced_shard_by_shard(rank_pools: RankPools) -> None:
    for r, dt in enumerate(rank_pools.get(4).run(_dtensor_case)):
        tp, dp = (r & ~1, r | 1), (r % 2, r % 2 + 2)
        dp_rank = r // 2
        # Σ over tp of (10·t + arange(5)) = 10 + 2·arange(5); dp rank d keeps chunk d.
        expected = torch.chunk(torch.arange(5.0) * 2 + 10, 2)[dp_rank].tolist()
        assert dt["local"] == expected
        assert dt["placements"] == ["S(0)"]
        assert dt["tag"] == "kept"
        # the mesh (dp) meets tp only at this rank: each TP peer holds the same dp chunk,
        # reduced as it is (3 rows on dp rank 0, 2 on dp rank 1), no gather over dp
        assert dt["log"] == [("all_reduce", "sum", tp, "float32", 3 - dp_rank, LABEL)]
        assert all(group != dp for _, _, group, *_ in dt["log"])
