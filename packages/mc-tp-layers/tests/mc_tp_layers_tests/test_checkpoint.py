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
from mc_groups.collection import clear_default_collection
from mc_groups.testing import RankPools
from mc_tp_layers.sharded_state import gtp_sharded_tensor
from mc_tp_layers_tests._helpers import config, row_parallel, world

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
    row = row_parallel(16, 8, cfg, init, stride=2, pg_collection=pgc)
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
        col = tpl.ColumnParallelLinear(
            4, 4, config=cfg, init_method=_init, stride=2, pg_collection=pgc
        )
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


def test_gtp_sharded_tensor_refuses_a_plain_tensor() -> None:
    world_group = torch.distributed.group.WORLD  # never reached: the check comes first
    with pytest.raises(ValueError, match=r"needs a weight sharded by shard_weight_for_gtp"):
        gtp_sharded_tensor(torch.zeros(3, 2), world_group, 0)  # type: ignore[arg-type]


def test_unsupported_options_are_refused(rank_pools: RankPools) -> None:
    for offsets, gtp in rank_pools.get(2).run(_refusals):
        assert "sharded_offsets=((0, 1, 2),)" in offsets
        assert "gtp_remat shard with partition_stride=2" in gtp


def _gtp_layers(tp: int, gtp: int, init: Any) -> dict[str, torch.nn.Module]:
    """Column 8 → 6, Row 6 → 5 and Column 8 → 2 at TP = ``tp``, gtp_remat = ``gtp``,
    CPU-initialised."""
    pgc = mg.get_default_collection()
    assert pgc is not None
    cfg = config(tp, gtp_remat_size=gtp)
    torch.manual_seed(SEED)
    col = tpl.ColumnParallelLinear(8, 6, config=cfg, init_method=init, pg_collection=pgc)
    torch.manual_seed(SEED + 1)
    row = row_parallel(6, 5, cfg, init, pg_collection=pgc)
    torch.manual_seed(SEED + 2)
    # 2 rows over tp = gtp = 2: the second gtp rank holds only a padding row (an empty shard)
    small = tpl.ColumnParallelLinear(8, 2, config=cfg, init_method=init, pg_collection=pgc)
    return {"col.": col, "row.": row, "small.": small}


def _gtp_round_trip(path: str, saved: tuple[int, int], loaded: tuple[int, int]) -> dict[str, Any]:
    """Save at ``saved`` = (tp, gtp_remat), load at ``loaded``; return, per param, whether
    the loaded tensor equals the one CPU init builds at ``loaded`` (same master weights)."""
    out: dict[str, Any] = {}
    for phase, (tp, gtp) in (("save", saved), ("load", loaded)):
        pgc = world(tp, gtp_remat_size=gtp, set_default=True)
        try:
            expected = _gtp_layers(tp, gtp, _init)
            if phase == "save":
                with torch.no_grad():
                    for layer in expected.values():
                        layer.bias.fill_(3.0)  # type: ignore[operator]
                with mg.record_collectives() as log:
                    state = _state(expected)
                # one mesh all-gather per gtp weight, over the TP group (none at TP = 1 or
                # without gtp_remat)
                out["mesh_ops"] = [(r.op, len(r.group_ranks)) for r in log]
                dcp_save(state, checkpoint_id=path)
                continue
            got = _gtp_layers(tp, gtp, torch.nn.init.zeros_)
            dcp_load(_state(got), checkpoint_id=path)
            for prefix, layer in got.items():
                for name, p in layer.named_parameters():
                    want = expected[prefix].get_parameter(name).detach()
                    if name == "bias":
                        want = torch.full_like(want, 3.0)
                    out[prefix + name] = (tuple(p.shape), torch.equal(p.detach(), want))
        finally:
            clear_default_collection()
            mg.destroy_model_parallel(pgc)
    return out


@pytest.mark.parametrize(
    ("saved", "loaded"),
    [((2, 2), (1, 1)), ((2, 2), (1, 2)), ((1, 2), (2, 2)), ((2, 1), (2, 2)), ((2, 2), (2, 2))],
)
def test_gtp_remat_checkpoint_round_trip(
    rank_pools: RankPools, tmp_path: Path, saved: tuple[int, int], loaded: tuple[int, int]
) -> None:
    """gtp_remat shards are stored without their padding rows (the column weight's 3 TP-local
    rows over 2 gtp ranks: 2 + 1 plus one zero row; the row weight's 5: 3 + 2 plus one), so
    a checkpoint loads across TP and gtp_remat sizes; every loaded shard, padding included,
    equals what CPU init builds at the loading layout (torch.equal: DCP copies bytes)."""
    results = rank_pools.get(4).run(_gtp_round_trip, str(tmp_path / "ckpt"), saved, loaded)
    for out in results:
        mesh_ops = out.pop("mesh_ops")
        tp, gtp = saved  # gtp weights on a TP group of more than one rank need the mesh
        assert mesh_ops == ([("all_gather_object", tp)] * 3 if tp > 1 and gtp > 1 else [])
        assert set(out) == {
            f"{layer}.{name}" for layer in ("col", "row", "small") for name in ("weight", "bias")
        }
        assert all(equal for _, equal in out.values()), out
    tp, gtp = loaded
    shapes = results[0]
    assert shapes["col.weight"][0] == (-(-6 // tp // gtp), 8)
    assert shapes["row.weight"][0] == (-(-5 // gtp), 6 // tp)
