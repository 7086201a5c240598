"""sharded_state_dict through torch.distributed.checkpoint: save at TP=2, load at TP=1/4.

The saving world builds the three layers with CPU init from one seed (so its shards are
slices of known master weights, strided with stride 2) and biases set to ``arange``;
the loading worlds build them from zeros and load. Every loaded shard must equal the
matching slice of the master weight (``torch.equal``: DCP copies bytes, no arithmetic).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import config, world

SEED = 77


def _init(t: torch.Tensor) -> None:
    torch.nn.init.normal_(t, std=0.5)


def _strided(full: torch.Tensor, w: int, r: int, stride: int, dim: int) -> torch.Tensor:
    blocks = full.chunk(w * stride, dim=dim)
    return torch.cat([blocks[j * w + r] for j in range(stride)], dim=dim)


def _layers(pgc: mg.ProcessGroupCollection, init: Any) -> dict[str, torch.nn.Module]:
    cfg = config(pgc.require("tp", "test").size())
    torch.manual_seed(SEED)
    col = tpl.ColumnParallelLinear(8, 16, config=cfg, init_method=init, stride=2, pg_collection=pgc)
    torch.manual_seed(SEED)
    row = tpl.RowParallelLinear(
        16,
        8,
        config=cfg,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        stride=2,
        pg_collection=pgc,
    )
    torch.manual_seed(SEED)
    emb = tpl.VocabParallelEmbedding(16, 8, init_method=init, config=cfg, pg_collection=pgc)
    return {"col.": col, "row.": row, "emb.": emb}


def _state(layers: dict[str, torch.nn.Module]) -> dict[str, Any]:
    sd: dict[str, Any] = {}
    for prefix, layer in layers.items():
        sd.update(layer.sharded_state_dict(prefix=prefix))  # type: ignore[operator]
    return sd


def _save(path: str) -> None:
    pgc = world(2)
    try:
        r = pgc.require("tp", "test").rank()
        layers = _layers(pgc, _init)
        with torch.no_grad():
            layers["col."].bias.copy_(_strided(torch.arange(16.0), 2, r, 2, 0))  # type: ignore[operator]
            layers["row."].bias.copy_(torch.arange(8.0))  # type: ignore[operator]
        dcp_save(_state(layers), checkpoint_id=path)
    finally:
        mg.destroy_model_parallel(pgc)


def _load(path: str, tp: int) -> dict[str, torch.Tensor]:
    pgc = world(tp)
    try:
        layers = _layers(pgc, torch.nn.init.zeros_)
        dcp_load(_state(layers), checkpoint_id=path)
        return {
            prefix + name: p.detach().clone()
            for prefix, layer in layers.items()
            for name, p in layer.named_parameters()
        }
    finally:
        mg.destroy_model_parallel(pgc)


def _master(rows: int, cols: int) -> torch.Tensor:
    torch.manual_seed(SEED)
    master = torch.empty(rows, cols)
    _init(master)
    return master


@pytest.mark.parametrize("tp", [1, 4])
def test_save_at_tp2_load_at_other_sizes(rank_pools: RankPools, tmp_path: Path, tp: int) -> None:
    path = str(tmp_path / "ckpt")
    rank_pools.get(2).run(_save, path)
    col, row, emb = _master(16, 8), _master(8, 16), _master(16, 8)
    world_size = max(tp, 2)
    for rank, out in enumerate(rank_pools.get(world_size).run(_load, path, tp)):
        r = rank % tp
        assert torch.equal(out["col.weight"], _strided(col, tp, r, 2, 0))
        assert torch.equal(out["col.bias"], _strided(torch.arange(16.0), tp, r, 2, 0))
        assert torch.equal(out["row.weight"], _strided(row, tp, r, 2, 1))
        assert torch.equal(out["row.bias"], torch.arange(8.0))
        assert torch.equal(out["emb.weight"], emb.chunk(tp, 0)[r])


def _refusals() -> list[str]:
    pgc = world(1, gtp_remat_size=2)
    try:
        cfg = config(1, gtp_remat_size=2)
        col = tpl.ColumnParallelLinear(4, 4, config=cfg, init_method=_init, pg_collection=pgc)
        messages = []
        for offsets in (((0, 1, 2),), ()):
            try:
                col.sharded_state_dict(sharded_offsets=offsets)
                messages.append("no error")
            except NotImplementedError as err:
                messages.append(str(err))
        return messages
    finally:
        mg.destroy_model_parallel(pgc)


def test_unsupported_options_are_refused(rank_pools: RankPools) -> None:
    for offsets, gtp in rank_pools.get(2).run(_refusals):
        assert "sharded_offsets=((0, 1, 2),)" in offsets
        assert "gtp_remat shard" in gtp
