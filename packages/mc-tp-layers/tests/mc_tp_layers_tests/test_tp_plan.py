"""``mc_tp_layers.tp_plan`` without a world: the style names (``transformers``' ``tp_plan``
vocabulary), the plan-entry errors, the argument checks of ``parallelize`` (before any group
is read), and the shard / unshard index arithmetic (:mod:`mc_tp_layers.shards`, which the converted
layers cut with) against slices written by hand.
The conversion itself, sequence parallelism and the bad plans that need a TP group run on
ranks in integration_tests/test_parallelize_hf.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_tp_layers import tp_plan
from mc_tp_layers.shards import join_shards, split_full
from mc_tp_layers.tp_plan import _styles


def _loose(value: object) -> Any:
    return value


def test_transformers_style_names_resolve() -> None:
    names = set(tp_plan.style_names())
    assert {
        "colwise",
        "rowwise",
        "colwise_gather_output",
        "colwise_rep",
        "rowwise_split_input",
        "rowwise_rep",
        "packed_colwise",
        "embedding_rowwise",
        "sequence_parallel",
    } <= names
    assert _styles.resolve("p", "colwise_rep") == (tp_plan.Colwise(gather_output=True),)
    assert _styles.resolve("p", "packed_colwise") == (tp_plan.Colwise(parts=2),)
    assert _styles.resolve("p", "rowwise_rep") == (tp_plan.Rowwise(split_input=True),)
    both = _styles.resolve("p", ("sequence_gather", tp_plan.Colwise()))
    assert both == (tp_plan.SequenceGather(), tp_plan.Colwise())


@pytest.mark.parametrize(
    ("value", "error", "words"),
    [
        (
            "local_colwise",
            ValueError,
            ["plan['p']", "'local_colwise'", "does not offer", "colwise"],
        ),
        ((), ValueError, ["plan['p'] is empty"]),
        (3, TypeError, ["plan['p']", "3", "style name"]),
        (("colwise", "rowwise"), ValueError, ["replaces the module twice", "keep one"]),
    ],
)
def test_bad_plan_entries_name_the_pattern(value: object, error: type, words: list[str]) -> None:
    with pytest.raises(error) as info:
        _styles.resolve("p", value)
    for word in words:
        assert word in str(info.value)


def test_parallelize_checks_arguments_first() -> None:
    linear = torch.nn.Linear(4, 4)
    cfg = mg.ModelParallelConfig()
    pgc = mg.ProcessGroupCollection()
    with pytest.raises(TypeError, match="module must be a torch"):
        tpl.parallelize(_loose("model"), {"x": "colwise"}, config=cfg, pg_collection=pgc)
    with pytest.raises(TypeError, match="non-empty mapping"):
        tpl.parallelize(linear, {}, config=cfg, pg_collection=pgc)
    with pytest.raises(TypeError, match="ProcessGroupCollection"):
        tpl.parallelize(linear, {"x": "colwise"}, config=cfg, pg_collection=_loose(None))
    with pytest.raises(ValueError, match="sequence_dim=2"):
        tpl.parallelize(linear, {"x": "colwise"}, config=cfg, pg_collection=pgc, sequence_dim=2)
    with pytest.raises(TypeError, match="lacks"):
        tpl.parallelize(linear, {"x": "colwise"}, config=_loose(object()), pg_collection=pgc)


def test_shard_rows_of_packed_blocks_and_back() -> None:
    full = torch.arange(24.0).reshape(12, 2)  # [gate (6 rows); up (6 rows)]
    shards = [split_full(full, 0, r, 3, stride=2) for r in range(3)]
    # rank r: gate rows [2r, 2r+2) then up rows [6+2r, 6+2r+2)
    assert torch.equal(shards[1], torch.cat([full[2:4], full[8:10]]))
    assert torch.equal(join_shards(shards, 0, stride=2), full)
    assert torch.equal(split_full(full, 0, 2, 3), full[8:12])
    assert torch.equal(split_full(full.T, 1, 1, 2), full.T[:, 6:12])
