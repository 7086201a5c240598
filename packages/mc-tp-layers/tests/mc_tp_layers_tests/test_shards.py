"""The shard converter (:mod:`mc_tp_layers.shards`): full ↔ TP shard, round trips bit-exact.

Without a world: the split arithmetic against slices written by hand (stride 1 and 2, rows
and columns, gtp_remat rows with padding). On 4 ranks, one grid in one world:

- a model of mc's layers (VocabParallelEmbedding, Column at stride 1 and 2, Row at stride
  1 and 2, a replicated LayerNorm), CPU-initialised from one seed at TP=1 and at TP=2
  (same master weights): ``full_state_dict`` at TP=2 equals the TP=1 model's
  ``state_dict`` (``torch.equal``: gathering copies bytes), one all-gather over TP per split
  param and nothing else; ``load_full_state_dict`` of that state dict into a zero-initialised
  TP=2 model gives every shard of the CPU-initialised one, and gathering it again the same
  full tensors (full → shard → full);
- the same at TP=2 × gtp_remat=2 (Column/Row weights cut again over gtp_remat, with padding
  rows): one all-gather over gtp_remat, then one over TP, per sharded weight;
- a ``parallelize``'d module (embedding, packed colwise, rowwise) against the original's
  state dict, and back into a fresh parallelized copy, and into one parallelized on the
  meta device and materialised with ``to_empty`` (whose new params keep mc's attributes);
- a plain module: its state dict as it is; a TP-marked param of a module without a
  ``tp_group`` needs the argument (a ``ValueError`` naming it), and with it is gathered.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers.gtp import gtp_local_rows
from mc_tp_layers.layers import set_tensor_model_parallel_attributes
from mc_tp_layers.shards import join_shards, split_full
from mc_tp_layers_tests._helpers import config, row_parallel, world

SEED = 31


def test_split_full_against_hand_slices() -> None:
    full = torch.arange(32.0).reshape(8, 4)
    # stride 1, rows over 2 ranks
    assert torch.equal(split_full(full, 0, 1, 2), full[4:8])
    # stride 2 (two fused parts of 4 rows), rank 1 of 2: rows 2-3 of each part
    assert torch.equal(split_full(full, 0, 1, 2, stride=2), full[[2, 3, 6, 7]])
    # columns, stride 2 over 2 ranks: rank 0 keeps columns 0 and 2
    assert torch.equal(split_full(full, 1, 0, 2, stride=2), full[:, [0, 2]])
    assert torch.equal(split_full(full, -1, 3, 4), full[:, 3:4])
    for dim, stride, world_size in ((0, 2, 2), (1, 2, 2), (0, 1, 4), (0, 4, 2)):
        shards = [split_full(full, dim, r, world_size, stride) for r in range(world_size)]
        assert torch.equal(join_shards(shards, dim, stride), full)
    with pytest.raises(ValueError, match=r"cannot be split along dim 0 into stride=3"):
        split_full(full, 0, 0, 2, stride=3)
    # gtp_remat: 5 rows over 2 ranks -> 3 rows each, one zero row padding rank 1
    rows = torch.arange(10.0).reshape(5, 2)
    assert torch.equal(gtp_local_rows(rows, 0, 2), rows[0:3])
    assert torch.equal(gtp_local_rows(rows, 1, 2), torch.cat([rows[3:5], torch.zeros(1, 2)]))


class _MCModel(torch.nn.Module):
    """mc's layers at any TP (and gtp_remat) size, CPU-initialised from the master weights."""

    def __init__(self, pgc: mg.ProcessGroupCollection, cfg: mg.ModelParallelConfig, init: Any):
        super().__init__()
        torch.manual_seed(SEED)
        self.emb = tpl.VocabParallelEmbedding(
            16, 8, init_method=init, config=cfg, pg_collection=pgc
        )
        self.col = tpl.ColumnParallelLinear(8, 12, config=cfg, init_method=init, pg_collection=pgc)
        self.qkv = tpl.ColumnParallelLinear(
            8, 16, config=cfg, init_method=init, stride=2, pg_collection=pgc
        )
        self.row = row_parallel(12, 6, cfg, init, pg_collection=pgc)
        self.row2 = row_parallel(16, 8, cfg, init, stride=2, pg_collection=pgc)
        self.norm = torch.nn.LayerNorm(8)
        tp = pgc.require("tp", "test")
        r, w = mg.group_rank(tp), mg.group_size(tp)
        biases = {  # biases start at zero: give them values, sliced by hand
            "col": torch.arange(12.0).view(w, -1)[r],
            "qkv": torch.arange(100.0, 116.0).view(2, w, -1)[:, r].reshape(-1),
            "row": torch.arange(200.0, 206.0),
            "row2": torch.arange(300.0, 308.0),
            "norm": torch.arange(400.0, 408.0),
        }
        with torch.no_grad():
            for name, value in biases.items():
                self.get_submodule(name).get_parameter("bias").copy_(value)


def _init(t: torch.Tensor) -> None:
    torch.nn.init.normal_(t, std=0.5)


def _zero_params(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()


def _plain(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in state.items() if isinstance(v, torch.Tensor)}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Keys whose tensors differ (or that one side lacks)."""
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in a or k not in b or not torch.equal(a[k], b[k])]


def _mc_layers(tp: int, gtp: int) -> dict[str, Any]:
    """The mc-layers model at (tp, gtp) against the TP=1 model of the same seed."""
    pgc = world(1)
    try:
        ref = _plain(_MCModel(pgc, config(1), _init).state_dict())
    finally:
        mg.destroy_model_parallel(pgc)
    pgc = world(tp, gtp_remat_size=gtp)
    try:
        cfg = config(tp, gtp_remat_size=gtp)
        model = _MCModel(pgc, cfg, _init)
        with mg.record_collectives() as log:
            gathered = _plain(tpl.full_state_dict(model))
        fresh = _MCModel(pgc, cfg, _init)
        _zero_params(fresh)
        tpl.load_full_state_dict(fresh, ref)
        shards = [
            name
            for (name, p), q in zip(model.named_parameters(), fresh.parameters(), strict=True)
            if not torch.equal(p, q)
        ]
        again = _plain(tpl.full_state_dict(fresh))
        split = [n for n, p in model.named_parameters() if getattr(p, "tensor_model_parallel", 0)]
        gtp_sharded = [
            n for n, p in model.named_parameters() if getattr(p, "is_gtp_weight_remat", 0)
        ]
        return {
            "gathered": _same(gathered, ref),
            "shards": shards,
            "again": _same(again, ref),
            "ops": [(r.op, len(r.group_ranks)) for r in log],
            "split": split,
            "gtp": gtp_sharded,
        }
    finally:
        mg.destroy_model_parallel(pgc)


class _Packed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(12, 8)
        self.gate_up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(8, 8)


def _parallelized_and_plain() -> dict[str, Any]:
    pgc = world(2)
    try:
        cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2)
        plan = {"emb": "embedding_rowwise", "gate_up": "packed_colwise", "down": "rowwise"}
        torch.manual_seed(SEED)
        model, twin = _Packed(), _Packed()
        ref = _plain(model.state_dict())
        tpl.parallelize(model, plan, config=cfg, pg_collection=pgc)
        packed_shard = model.gate_up.weight.detach().clone()
        tpl.parallelize(twin, plan, config=cfg, pg_collection=pgc)
        _zero_params(twin)
        tpl.load_full_state_dict(twin, ref)
        with torch.device("meta"):
            on_meta = _Packed()
        tpl.parallelize(on_meta, plan, config=cfg, pg_collection=pgc)
        on_meta.to_empty(device="cpu")  # new params: they keep their TP attributes
        tpl.load_full_state_dict(on_meta, ref)
        out: dict[str, Any] = {
            "meta": _same(_plain(tpl.full_state_dict(on_meta)), ref),
            "parallelized": _same(_plain(tpl.full_state_dict(model)), ref),
            "loaded": _same(_plain(tpl.full_state_dict(twin)), ref),
            "packed_shard": torch.equal(packed_shard, twin.gate_up.weight),
            "rank": mg.group_rank(pgc.require("tp", "test")),
            "packed": packed_shard,
            "full_gate_up": ref["gate_up.weight"],
        }
        plain = torch.nn.Linear(4, 6)
        with mg.record_collectives() as log:
            out["plain"] = _same(_plain(tpl.full_state_dict(plain)), _plain(plain.state_dict()))
        out["plain_ops"] = len(log)
        # a module of the user's own holding rows 3r..3r+2 of a [6, 4] weight, marked split
        full = torch.arange(24.0).reshape(6, 4)
        rank = out["rank"]
        set_tensor_model_parallel_attributes(plain.weight, True, 0, 1)
        try:
            tpl.full_state_dict(plain)
            out["needs_group"] = "no error"
        except ValueError as err:
            out["needs_group"] = str(err)
        plain.weight = torch.nn.Parameter(full[3 * rank : 3 * rank + 3].clone())
        set_tensor_model_parallel_attributes(plain.weight, True, 0, 1)
        tp = pgc.require("tp", "test")
        out["own_module"] = torch.equal(tpl.full_state_dict(plain, tp)["weight"], full)
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def _grid() -> dict[str, Any]:
    torch.set_num_threads(1)
    return {
        "tp2": _mc_layers(2, 1),
        "tp2_gtp2": _mc_layers(2, 2),
        "parallelize": _parallelized_and_plain(),
    }


def test_round_trips_are_bit_exact(rank_pools: RankPools) -> None:
    for out in rank_pools.get(4).run(_grid):
        tp2 = out["tp2"]
        assert tp2["split"] == [
            "emb.weight",
            "col.weight",
            "col.bias",
            "qkv.weight",
            "qkv.bias",
            "row.weight",
            "row2.weight",
        ]
        assert tp2["gathered"] == []
        assert tp2["shards"] == []
        assert tp2["again"] == []
        assert tp2["ops"] == [("all_gather", 2)] * len(tp2["split"])
        gtp = out["tp2_gtp2"]
        assert gtp["gtp"] == ["col.weight", "qkv.weight", "row.weight", "row2.weight"]
        assert gtp["gathered"] == []
        assert gtp["shards"] == []
        assert gtp["again"] == []
        # each gtp_remat weight: its rows over gtp_remat, then the TP shards
        per_param = [
            [("all_gather", 2), ("all_gather", 2)] if n in gtp["gtp"] else [("all_gather", 2)]
            for n in gtp["split"]
        ]
        assert gtp["ops"] == [op for ops in per_param for op in ops]
        par = out["parallelize"]
        assert par["parallelized"] == []
        assert par["meta"] == []
        assert par["loaded"] == []
        assert par["packed_shard"]
        r, gate_up = par["rank"], par["full_gate_up"]  # [gate (8 rows); up (8 rows)]
        assert torch.equal(
            par["packed"], torch.cat([gate_up[4 * r : 4 * r + 4], gate_up[8 + 4 * r :][:4]])
        )
        assert par["plain"] == []
        assert par["plain_ops"] == 0
        assert "weight is a tensor-parallel shard" in par["needs_group"]
        assert "pass tp_group=" in par["needs_group"]
        assert par["own_module"]
