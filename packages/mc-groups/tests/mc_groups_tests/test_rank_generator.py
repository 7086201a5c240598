"""Rank generator: every expectation below is derived by hand from the mixed-radix rule.

For an order ``a-b-c`` (a fastest), ``rank = a + |a|·b + |a|·|b|·c``; a group over some axes
holds the ranks that agree on all other axes, members listed with the leftmost masked axis
fastest, groups listed with the leftmost unmasked axis fastest.
"""

from __future__ import annotations

import pytest

from mc_groups.rank_generator import MAX_WORLD_SIZE, RankGenerator


def _dense(tp: int = 1, dp: int = 1, pp: int = 1, cp: int = 1, **kw: object) -> RankGenerator:
    return RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, **kw)  # type: ignore[arg-type]


def test_issue_example_tp2_pp2_dp2() -> None:
    # rank = tp + 2·dp + 4·pp
    g = _dense(tp=2, dp=2, pp=2)
    assert g.world_size == 8
    assert g.get_ranks("tp") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("pp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("tp-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_order_tp_pp_dp() -> None:
    # rank = tp + 2·pp + 4·dp
    g = _dense(tp=2, dp=2, pp=2, order="tp-pp-dp")
    assert g.get_ranks("pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("tp-dp") == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_context_parallel() -> None:
    # rank = tp + 2·cp + 4·dp
    g = _dense(tp=2, dp=2, cp=2)
    assert g.get_ranks("cp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("dp-cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert g.get_ranks("tp-cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_world16_dp4() -> None:
    # rank = tp + 2·dp + 8·pp
    g = _dense(tp=2, dp=4, pp=2)
    assert g.get_ranks("pp") == [[i, i + 8] for i in range(8)]
    assert g.get_ranks("dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert g.get_ranks("tp-pp") == [[0, 1, 8, 9], [2, 3, 10, 11], [4, 5, 12, 13], [6, 7, 14, 15]]


def test_world12_dp3() -> None:
    # rank = tp + 2·dp + 6·pp
    g = _dense(tp=2, dp=3, pp=2)
    assert g.get_ranks("dp") == [[0, 2, 4], [1, 3, 5], [6, 8, 10], [7, 9, 11]]
    assert g.get_ranks("pp") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]
    assert g.get_ranks("tp-dp") == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]


def test_rank_offset() -> None:
    g = _dense(tp=2, dp=2, rank_offset=4)
    assert g.get_ranks("tp") == [[4, 5], [6, 7]]
    assert g.get_ranks("dp") == [[4, 6], [5, 7]]


def test_expert_generator() -> None:
    # expert layout tp(etp)=1 ep=2 dp=2 pp=2: rank = ep + 2·dp + 4·pp
    g = RankGenerator(tp=1, ep=2, dp=2, pp=2, cp=1, is_expert=True)
    assert g.get_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("ep-pp") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g.get_ranks("tp") == [[r] for r in range(8)]


def test_dense_gtp_remat_sits_after_tp() -> None:
    # order becomes tp-gtp_remat-cp-ep-dp-pp: rank = tp + 2·gtp + 4·dp
    g = _dense(tp=2, dp=2, gtp_remat=2)
    assert g.order.startswith("tp-gtp_remat-cp")
    assert g.get_ranks("gtp_remat") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("dp-gtp_remat") == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_expert_gtp_remat_sits_after_ep() -> None:
    # order becomes tp-cp-ep-gtp_remat-dp-pp: rank = ep + 2·gtp + 4·dp
    g = RankGenerator(tp=1, ep=2, dp=2, pp=1, cp=1, gtp_remat=2, is_expert=True)
    assert "ep-gtp_remat-dp" in g.order
    assert g.get_ranks("ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g.get_ranks("gtp_remat") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g.get_ranks("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_explicit_gtp_remat_position_is_kept() -> None:
    # rank = tp + 2·dp + 4·gtp
    g = _dense(tp=2, dp=2, gtp_remat=2, order="tp-dp-gtp_remat")
    assert g.get_ranks("gtp_remat") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_pipeline_fastest() -> None:
    # rank = pp + 2·tp
    g = _dense(tp=2, pp=2, order="pp-tp")
    assert g.get_ranks("tp") == [[0, 2], [1, 3]]
    assert g.get_ranks("pp") == [[0, 1], [2, 3]]


def test_tp_spans_world() -> None:
    g = _dense(tp=4)
    assert g.get_ranks("tp") == [[0, 1, 2, 3]]
    assert g.get_ranks("dp") == [[0], [1], [2], [3]]
    assert g.get_ranks("pp") == [[0], [1], [2], [3]]


def test_size_one_axes_are_appended() -> None:
    g = _dense(tp=2, dp=2, order="tp-dp")
    assert g.order.split("-")[:3] == ["tp", "gtp_remat", "dp"]
    assert set(g.order.split("-")) == {"tp", "gtp_remat", "dp", "cp", "ep", "pp"}
    assert g.get_ranks("dp") == [[0, 2], [1, 3]]


def test_every_rank_in_exactly_one_group_per_token() -> None:
    g = _dense(tp=2, dp=3, pp=2, cp=2)
    for token in ("tp", "dp", "pp", "cp", "tp-pp", "dp-cp", "tp-dp-cp"):
        flat = sorted(r for group in g.get_ranks(token) for r in group)
        assert flat == list(range(g.world_size)), token


def test_world_size_is_bounded_before_anything_is_allocated() -> None:
    # exactly MAX_WORLD_SIZE ranks is a layout (2**20 = 2**10 tp × 2**10 dp); one more
    # factor of 2 is refused in the constructor, so get_ranks never enumerates 2**40 ranks
    gen = RankGenerator(tp=2**10, ep=1, dp=2**10, pp=1, cp=1)
    assert gen.world_size == MAX_WORLD_SIZE == 2**20
    with pytest.raises(ValueError, match=r"tp=1024 × dp=2048 = 2097152 ranks exceeds MAX_WORLD"):
        RankGenerator(tp=2**10, ep=1, dp=2**11, pp=1, cp=1)
    with pytest.raises(ValueError, match=r"tp=1099511627776 = 1099511627776 ranks exceeds"):
        RankGenerator(tp=2**40, ep=1, dp=1, pp=1, cp=1)
