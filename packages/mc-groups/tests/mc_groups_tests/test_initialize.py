"""initialize_model_parallel on real gloo worlds: every group against the rank generator.

Bad layouts (``validate_sizes`` and ``initialize_model_parallel`` on a world, errors raised
before any group exists) are in the package's bad-input catalogue, ``test_bad_input.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups import validate_sizes
from mc_groups.pipeline_stages import get_pipeline_next_rank, get_pipeline_prev_rank
from mc_groups.rank_generator import RankGenerator
from mc_groups.testing import RankPools, error_kind


def _expected(world: int, kw: dict[str, Any]) -> dict[str, list[list[int]]]:
    """Each role's groups computed from the rank generator (the reference)."""
    tp, pp = kw.get("tensor_model_parallel_size", 1), kw.get("pipeline_model_parallel_size", 1)
    cp, ep = kw.get("context_parallel_size", 1), kw.get("expert_model_parallel_size", 1)
    etp = kw.get("expert_tensor_parallel_size") or tp
    gtp, egtp = kw.get("gtp_remat_size", 1), kw.get("expert_gtp_remat_size", 1)
    dp, edp = world // (tp * pp * cp * gtp), world // (etp * ep * pp * egtp)
    d = RankGenerator(tp, 1, dp, pp, cp, gtp_remat=gtp)
    e = RankGenerator(etp, ep, edp, pp, 1, gtp_remat=egtp, is_expert=True)
    pps = d.get_ranks("pp")
    return {
        "tp": d.get_ranks("tp"),
        "pp": pps,
        "cp": d.get_ranks("cp"),
        "dp": d.get_ranks("dp"),
        "mp": d.get_ranks("tp-gtp_remat-pp"),
        "tp_cp": d.get_ranks("tp-cp"),
        "dp_cp": d.get_ranks("dp-cp"),
        # spans gtp_remat, as Megatron-Core's parallel_state builds it ('tp-gtp_remat-dp-cp')
        "tp_dp_cp": d.get_ranks("tp-gtp_remat-dp-cp"),
        "gtp_remat": d.get_ranks("gtp_remat"),
        "dp_cp_gtp_remat": d.get_ranks("dp-cp-gtp_remat"),
        "ep": e.get_ranks("ep"),
        "expt_tp": e.get_ranks("tp"),
        "tp_ep": e.get_ranks("tp-ep"),
        "tp_ep_pp": e.get_ranks("tp-ep-pp"),
        "expt_dp": e.get_ranks("dp"),
        "expt_gtp_remat": e.get_ranks("gtp_remat"),
        "expt_dp_gtp_remat": e.get_ranks("dp-gtp_remat"),
        "embd": [sorted({g[0], g[-1]}) for g in pps],
        "pos_embd": [[g[0]] for g in pps],
    }


def _my_groups(kw: dict[str, Any]) -> dict[str, list[int] | None]:
    pgc = mg.initialize_model_parallel(**kw)
    try:
        return {name: list(dist.get_process_group_ranks(g)) for name, g in pgc.items()}
    finally:
        mg.destroy_model_parallel(pgc)


LAYOUTS_4 = [
    {"tensor_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 2},
    {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
    {"context_parallel_size": 2},
    {"tensor_model_parallel_size": 2, "context_parallel_size": 2},
    {"expert_model_parallel_size": 2},
    {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2},
    {"gtp_remat_size": 2},
    {"expert_gtp_remat_size": 2, "expert_model_parallel_size": 2},
    {"pipeline_model_parallel_size": 4},
    {"tensor_model_parallel_size": 2, "order": "tp-pp-dp"},
]


@pytest.mark.parametrize(
    "kw", LAYOUTS_4, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items())
)
def test_four_ranks_match_rank_generator(rank_pools: RankPools, kw: dict[str, Any]) -> None:
    results = rank_pools.get(4).run(_my_groups, kw)
    gen_kw = {k: v for k, v in kw.items() if k != "order"}
    expected = _expected(4, gen_kw) if "order" not in kw else None
    for rank, mine in enumerate(results):
        if expected is None:
            # tp-pp-dp with tp=2 (pp=1, dp=2): rank = tp + 2·dp, as the default order.
            assert mine["tp"] == [[0, 1], [2, 3]][rank // 2]
            assert mine["dp"] == [[0, 2], [1, 3]][rank % 2]
            continue
        for role, groups in expected.items():
            mine_role = next((g for g in groups if rank in g), None)
            assert mine.get(role) == mine_role, (rank, role)


@pytest.mark.parametrize(
    "kw", [{"tensor_model_parallel_size": 2}, {}, {"pipeline_model_parallel_size": 2}]
)
def test_two_ranks_match_rank_generator(rank_pools: RankPools, kw: dict[str, Any]) -> None:
    results = rank_pools.get(2).run(_my_groups, kw)
    expected = _expected(2, kw)
    for rank, mine in enumerate(results):
        for role, groups in expected.items():
            assert mine.get(role) == next((g for g in groups if rank in g), None), (rank, role)
        assert mine["world"] == [0, 1]


def test_middle_pipeline_stage_has_no_embedding_group(rank_pools: RankPools) -> None:
    results = rank_pools.get(4).run(_my_groups, {"pipeline_model_parallel_size": 4})
    assert [r.get("embd") for r in results] == [[0, 3], None, None, [0, 3]]
    assert [r.get("pos_embd") for r in results] == [[0], None, None, None]


def test_distributed_optimizer_instances(rank_pools: RankPools) -> None:
    # dp_cp = [0,1,2,3]; two instances of 2 ranks: intra [0,1] [2,3]; inter links shard
    # position 0 → [0,2], position 1 → [1,3]; an instance's ranks are world blocks of 2.
    results = rank_pools.get(4).run(_my_groups, {"num_distributed_optimizer_instances": 2})
    assert [r["intra_dp_cp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["inter_dist_opt"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["intra_dist_opt"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    # experts (ep = 1): expt_dp = dp_cp, cut and linked the same way
    assert [r["intra_expt_dp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["inter_expt_dp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    # ep = 2: expt_dp groups of 2 ranks, one rank per instance; the inter group is expt_dp
    results = rank_pools.get(4).run(
        _my_groups, {"num_distributed_optimizer_instances": 2, "expert_model_parallel_size": 2}
    )
    for rank, r in enumerate(results):
        assert r["intra_expt_dp"] == [rank]
        expt_dp = r["expt_dp"]
        assert expt_dp is not None
        assert len(expt_dp) == 2
        assert r["inter_expt_dp"] == expt_dp


def _pipeline_facts() -> tuple[bool, bool, int, int, bool]:
    pgc = mg.initialize_model_parallel(pipeline_model_parallel_size=4)
    try:
        return (
            mg.is_pipeline_first_stage(pgc),
            mg.is_pipeline_last_stage(pgc),
            get_pipeline_next_rank(pgc),
            get_pipeline_prev_rank(pgc),
            mg.is_pipeline_last_stage(pgc, vp_stage=0, vp_size=2),
        )
    finally:
        mg.destroy_model_parallel(pgc)


def test_pipeline_helpers(rank_pools: RankPools) -> None:
    assert rank_pools.get(4).run(_pipeline_facts) == [
        (True, False, 1, 3, False),
        (False, False, 2, 0, False),
        (False, False, 3, 1, False),
        (False, True, 0, 2, False),
    ]


def _default_collection_roundtrip() -> tuple[bool, bool]:
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2, set_default=True)
    was_set = mg.get_default_collection() is pgc
    mg.destroy_model_parallel(pgc)
    return was_set, mg.get_default_collection() is None


def test_default_collection_is_optional(rank_pools: RankPools) -> None:
    assert rank_pools.get(2).run(_default_collection_roundtrip) == [(True, True)] * 2


def test_validate_sizes_derives_dp() -> None:
    s = validate_sizes(
        16,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        context_parallel_size=2,
        expert_model_parallel_size=4,
    )
    # dp = 16 / (tp 2 · cp 2 · pp 2) = 2; edp = 16 / (etp 2 · ep 4 · pp 2) = 1 (etp = tp)
    assert (s.dp, s.expert_dp, s.etp) == (2, 1, 2)


def test_not_initialised_says_how() -> None:
    if dist.is_initialized():
        pytest.skip("this process already has a default group")
    with pytest.raises(ValueError, match="init_process_group"):
        mg.initialize_model_parallel()


def _disagreeing_layout(kw_by_rank: list[dict[str, Any]]) -> tuple[str, str, int, float]:
    """Each rank calls initialize_model_parallel with its own arguments; what it raised, how
    many process groups exist before and after (nothing may be created), and the world
    group's sum afterwards (it must still work)."""
    me = dist.get_rank()
    before = len(dist.distributed_c10d._world.pg_map)
    try:
        mg.destroy_model_parallel(mg.initialize_model_parallel(**kw_by_rank[me]))
        kind, text = "no error", ""
    except ValueError as err:
        kind, text = error_kind(err), str(err)
    created = len(dist.distributed_c10d._world.pg_map) - before
    t = torch.ones(1)
    world = dist.group.WORLD
    assert world is not None
    mg.all_reduce(t, world)
    return kind, text, created, float(t)


def test_ranks_that_pass_different_layouts_all_raise_the_same_error(
    rank_pools: RankPools,
) -> None:
    # tp 2 on rank 0, 1 on rank 1: both layouts are valid on 2 ranks, so only comparing
    # them finds it; before, rank 0 waited in new_group for a group rank 1 never created.
    tp = [{"tensor_model_parallel_size": 2}, {"tensor_model_parallel_size": 1}]
    outs = rank_pools.get(2).run(_disagreeing_layout, tp)
    assert [o[0] for o in outs] == ["ValueError"] * 2
    assert outs[0][1] == outs[1][1]  # the same message on every rank
    for word in ("tensor_model_parallel_size", "rank(s) [0]: 2", "rank(s) [1]: 1"):
        assert word in outs[0][1], outs[0][1]
    assert "order" not in outs[0][1].split("Every rank")[0]  # only the field that differs
    assert [(o[2], o[3]) for o in outs] == [(0, 2.0), (0, 2.0)]
    # order (and pp) differ: the strings are shown, both fields named
    orders = [
        {"pipeline_model_parallel_size": 2, "order": "tp-pp-dp"},
        {"pipeline_model_parallel_size": 1, "order": "tp-dp-pp"},
    ]
    outs = rank_pools.get(2).run(_disagreeing_layout, orders)
    text = outs[0][1]
    assert outs[1][1] == text
    for word in ("pipeline_model_parallel_size (rank(s) [0]: 2; rank(s) [1]: 1)", "order"):
        assert word in text, text
    assert "'tp-pp-dp'" in text
    assert "'tp-dp-pp'" in text
    assert [(o[2], o[3]) for o in outs] == [(0, 2.0), (0, 2.0)]


def _layout_exchange() -> list[tuple[str, str, tuple[int, ...], int]]:
    with mg.record_collectives() as log:
        pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    mg.destroy_model_parallel(pgc)
    return [(r.op, r.label, r.group_ranks, r.numel) for r in log]


def test_agreeing_ranks_compare_ten_ints_once(rank_pools: RankPools) -> None:
    # one all-gather of 10 int64 per rank before any group, then the creation barrier
    for log in rank_pools.get(2).run(_layout_exchange):
        assert log == [
            ("all_gather", "initialize_model_parallel layout", (0, 1), 10),
            ("barrier", "initialize_model_parallel", (0, 1), 0),
        ]


def _destroy_misuse() -> dict[str, Any]:
    out: dict[str, Any] = {}
    world_before = len(dist.distributed_c10d._world.pg_map)
    for name, bad in (("dict", {"tp": None}), ("none", None)):
        with mg.record_collectives() as log:
            try:
                mg.destroy_model_parallel(bad)  # type: ignore[arg-type]
            except TypeError as err:
                out[name] = (str(err), len(log))
    pgc = mg.initialize_model_parallel()
    mg.destroy_model_parallel(pgc)
    with mg.record_collectives() as log:
        try:
            mg.destroy_model_parallel(pgc)
        except RuntimeError as err:
            out["twice"] = (str(err), len(log))
    out["destroyed"] = pgc.destroyed
    out["groups"] = len(dist.distributed_c10d._world.pg_map) - world_before
    t = torch.ones(1)
    world = dist.group.WORLD
    assert world is not None
    mg.all_reduce(t, world)  # the world group survived all of it
    out["world_sum"] = float(t)
    return out


def test_destroy_refuses_what_is_not_a_live_collection_before_the_barrier(
    rank_pools: RankPools,
) -> None:
    for out in rank_pools.get(2).run(_destroy_misuse):
        assert "collection={'tp': None} must be the ProcessGroupCollection" in out["dict"][0]
        assert "collection=None must be" in out["none"][0]
        assert "already destroyed" in out["twice"][0]
        assert (out["dict"][1], out["none"][1], out["twice"][1]) == (0, 0, 0)  # no barrier
        assert out["destroyed"] is True
        assert out["groups"] == 0  # everything initialize created was destroyed, once
        assert out["world_sum"] == 2.0
