"""Steps 2 and 3: params replicated on every pipeline stage, summed over pp and virtual chunks.

Localizes the by-name accumulation over local virtual chunks, the pp all-reduce, the copy
back to every chunk, the config switches (``has_cond_embedder``, ``flextron``) and the
default-collection fallback. Grads are small integers (exact in fp32 and bf16), so results
are compared exactly.
"""

from __future__ import annotations

from typing import Any

import torch

import mc_groups as mg
from mc_finalize import _allreduce_conditional_embedding_grads, _allreduce_router_grads
from mc_finalize_tests._helpers import Cfg, Chunk, add_param, first, layout, records
from mc_groups.collection import set_default_collection
from mc_groups.testing import RankPools

VIRTUAL_CHUNKS = 2


def _chunks(cfg: Cfg, pp_rank: int) -> list[Chunk]:
    """Chunk c on stage p: cond grads 10·p + c, router grads 100·p + c, a plain param."""
    chunks = []
    for c in range(VIRTUAL_CHUNKS):
        chunk = Chunk(cfg)
        add_param(chunk, "cond.weight", 10 * pp_rank + c, pipeline_parallel=True)
        add_param(
            chunk, "cond.bias", 10 * pp_rank + c, dtype=torch.bfloat16, pipeline_parallel=True
        )
        add_param(chunk, "router.weight", 100 * pp_rank + c, flextron_router_pp_sync=True)
        add_param(chunk, "frozen.weight", 7, requires_grad=False, pipeline_parallel=True)
        add_param(chunk, "plain.weight", 5)
        chunks.append(chunk)
    return chunks


def _values(chunks: list[Chunk]) -> list[dict[str, float]]:
    return [{n: first(p) for n, p in c.named_parameters()} for c in chunks]


def _pp_steps() -> dict[str, Any]:
    out: dict[str, Any] = {}
    with layout(pipeline_model_parallel_size=4) as pgc:
        assert pgc.pp is not None
        p = pgc.pp.rank()
        for name, cfg in {
            "cond": Cfg(has_cond_embedder=True),
            "router": Cfg(flextron=True),
            "off": Cfg(),
        }.items():
            chunks = _chunks(cfg, p)
            with mg.record_collectives() as log:
                _allreduce_conditional_embedding_grads(chunks, cfg, pgc.pp)
                _allreduce_router_grads(chunks, cfg, pgc.pp)
            out[name] = {"values": _values(chunks), "log": records(log)}
        cfg = Cfg(has_cond_embedder=True, flextron=True)
        chunks = _chunks(cfg, p)
        set_default_collection(pgc)
        with mg.record_collectives() as log:
            _allreduce_conditional_embedding_grads(chunks, cfg)
            _allreduce_router_grads(chunks, cfg)
        out["default"] = {"values": _values(chunks), "log": len(log)}
        out["plain"] = _plain_linear_chunks(p, pgc.pp)
    return out


def _plain_linear_chunks(pp_rank: int, pp_group: torch.distributed.ProcessGroup) -> list[Any]:
    """Megatron's step helpers read only ``named_parameters()``, so its users (and its own
    test of this step) pass plain ``nn.Linear`` chunks with no DDP wrapper: chunk c on stage
    p gets ``main_grad = 10·p + c`` everywhere, only the weight is marked
    ``pipeline_parallel``."""
    cfg = Cfg(has_cond_embedder=True)
    chunks = [torch.nn.Linear(3, 3) for _ in range(VIRTUAL_CHUNKS)]
    for c, chunk in enumerate(chunks):
        chunk.weight.pipeline_parallel = True  # type: ignore[attr-defined]
        for param in chunk.parameters():
            param.main_grad = torch.full_like(param, 10.0 * pp_rank + c)  # type: ignore[attr-defined]
    _allreduce_conditional_embedding_grads(chunks, cfg, pp_group)  # type: ignore[arg-type]
    return [(first(c.weight), first(c.bias)) for c in chunks]  # type: ignore[arg-type]


def test_pp4_two_virtual_chunks(rank_pools: RankPools) -> None:
    # Σ over stages p = 0..3 and chunks c = 0, 1 of (10·p + c) = 10·2·6 + 4·1 = 124;
    # of (100·p + c) = 100·2·6 + 4 = 1204. Every chunk of every stage ends with the total.
    pp = (0, 1, 2, 3)
    for r, out in enumerate(rank_pools.get(4).run(_pp_steps)):
        own = [(10 * r + c, 100 * r + c) for c in range(VIRTUAL_CHUNKS)]
        for c, values in enumerate(out["cond"]["values"]):
            assert values["cond.weight"] == values["cond.bias"] == 124.0
            assert values["router.weight"] == own[c][1]
            assert (values["frozen.weight"], values["plain.weight"]) == (7.0, 5.0)
        assert out["cond"]["log"] == [
            ("all_reduce", "sum", pp, "float32", 3, "conditional embedding grads"),
            ("all_reduce", "sum", pp, "bfloat16", 3, "conditional embedding grads"),
        ]
        for c, values in enumerate(out["router"]["values"]):
            assert values["router.weight"] == 1204.0
            assert values["cond.weight"] == own[c][0]
        assert out["router"]["log"] == [("all_reduce", "sum", pp, "float32", 3, "router grads")]
        assert out["off"]["log"] == []
        assert [v["cond.weight"] for v in out["off"]["values"]] == [own[0][0], own[1][0]]
        assert out["default"]["log"] == 3  # the default collection's pp group was used
        assert all(v["router.weight"] == 1204.0 for v in out["default"]["values"])
        assert out["plain"] == [(124.0, own[0][0]), (124.0, own[1][0])]


def _single_stage_and_no_default() -> dict[str, Any]:
    cfg = Cfg(has_cond_embedder=True, flextron=True)
    chunks = _chunks(cfg, 0)
    errors = []
    with mg.record_collectives() as log:
        try:
            _allreduce_conditional_embedding_grads(chunks, cfg)
        except ValueError as err:
            errors.append(str(err))
        with layout() as pgc:  # pp = 1: nothing to reduce
            _allreduce_conditional_embedding_grads(chunks, cfg, pgc.pp)
            _allreduce_router_grads(chunks, cfg, pgc.pp)
    ops = [r.op for r in log if r.label in {"conditional embedding grads", "router grads"}]
    return {"errors": errors, "ops": ops, "values": _values(chunks)}


def test_single_stage_is_a_no_op_and_missing_default_is_an_error(rank_pools: RankPools) -> None:
    for out in rank_pools.get(2).run(_single_stage_and_no_default):
        assert len(out["errors"]) == 1
        assert "no default ProcessGroupCollection is registered" in out["errors"][0]
        assert "pg_collection.pp" in out["errors"][0]
        assert out["ops"] == []
        assert [v["cond.weight"] for v in out["values"]] == [0.0, 1.0]
