"""Conformance with Megatron-LM's ``tests/unit_tests/tensor_parallel/test_tp_attrs_without_init.py``,
and the TP-group fallback those tests rely on.

Upstream builds every layer without ``tp_group`` or ``pg_collection`` after
``initialize_model_parallel(tensor_model_parallel_size=2)``: the layers fall back to the
global TP group. Here the TP = 2 collection is registered as the default and the layers
get no group either; their shards are half the full size, which only the default's
2-rank group gives. With no default registered, mc refuses such a layer with a clear error
(Megatron would read its uninitialised global state).

Already held elsewhere: the attributes with ``use_cpu_initialization=True``
(``test_initialization.py::test_tp_attributes_are_set_with_or_without_initialisation``),
``copy_tensor_model_parallel_attributes`` keeping ``is_qkv`` / ``qkv_split_shapes`` and
``copy_gtp_attributes`` keeping ``allreduce`` and ``is_gtp_weight_remat``
(``test_attributes.py::test_copies_keep_qkv_and_expert_tags``) and ``pad_length``
(``test_attributes.py::test_pad_count_needs_pad_length_and_group``), and the expert
layers' ``allreduce=False`` at TP = 2, expert TP = 1
(``test_initialization.py::test_expert_allreduce_tag``).
"""  # noqa: E501

from __future__ import annotations

from typing import Any

import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.collection import clear_default_collection
from mc_groups.testing import RankPools
from mc_tp_layers.layers import param_is_not_tensor_parallel_duplicate
from mc_tp_layers_tests._helpers import config, row_parallel, world

Z = torch.nn.init.zeros_
NAMES = ("tensor_model_parallel", "partition_dim", "partition_stride")


def _layers_without_init_or_groups() -> dict[str, Any]:
    pgc = world(2, set_default=True)
    try:
        out: dict[str, Any] = {}
        for cpu in (True, False):
            # use_cpu_initialization=False with no RNG tracker: nothing is initialised, so
            # none is needed.
            cfg = config(2, use_cpu_initialization=cpu, perform_initialization=False)
            emb = tpl.VocabParallelEmbedding(16, 8, init_method=Z, config=cfg)
            col = tpl.ColumnParallelLinear(8, 8, config=cfg, init_method=Z, bias=True)
            row = row_parallel(8, 8, cfg, Z)
            with torch.no_grad():
                row.weight.zero_()
                assert row.bias is not None
                row.bias.zero_()
            with mg.record_collectives() as log:
                row(torch.ones(2, 1, 4))
            out[f"cpu={cpu}"] = {
                name: {
                    "attrs": tuple(getattr(layer.weight, n, None) for n in NAMES),
                    "shape": tuple(layer.weight.shape),  # type: ignore[union-attr]
                    "device": str(layer.weight.device),  # type: ignore[union-attr]
                }
                for name, layer in (("emb", emb), ("col", col), ("row", row))
            } | {"row_forward": [(e.op, e.group_ranks) for e in log]}
        clear_default_collection()
        try:
            tpl.ColumnParallelLinear(8, 8, config=config(2), init_method=Z)
            out["without_default"] = "no error"
        except ValueError as err:
            out["without_default"] = str(err)
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_tp_attrs_without_init_and_default_group(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_tp_attrs_without_init.py::
    TestTPAttributesWithoutInitialization::test_vocab_parallel_embedding_tp_attrs_no_init``,
    ``::test_column_parallel_linear_tp_attrs_no_init`` and
    ``::test_row_parallel_linear_tp_attrs_no_init`` (each for ``use_cpu_init`` True and
    False).

    With ``perform_initialization=False`` every weight still carries
    ``tensor_model_parallel=True``, ``partition_stride=1`` and ``partition_dim`` 0 for the
    embedding and the column layer, 1 for the row layer. Built without groups under a
    registered TP = 2 default: the embedding holds 8 of 16 rows, the column layer 4 of 8
    output rows, the row layer 4 of 8 input columns (on CPU: a gloo world), and the row
    layer's forward all-reduces over the default's TP group. Without a default the layer
    is refused, naming the ways to pass a group.
    """
    shapes = {"emb": (8, 8), "col": (4, 8), "row": (8, 4)}
    dims = {"emb": 0, "col": 0, "row": 1}
    for res in rank_pools.get(2).run(_layers_without_init_or_groups):
        for cpu in (True, False):
            out = res[f"cpu={cpu}"]
            for name in ("emb", "col", "row"):
                assert out[name]["attrs"] == (True, dims[name], 1), (cpu, name)
                assert out[name]["shape"] == shapes[name], (cpu, name)
                assert out[name]["device"] == "cpu"
            assert out["row_forward"] == [("all_reduce", (0, 1))]
        message = res["without_default"]
        assert "tp_group=" in message
        assert "pg_collection=" in message
        assert "set_default=True" in message


def _duplicate_filter() -> dict[str, bool]:
    pgc = world(2, expert_tensor_parallel_size=1)
    try:
        param = torch.empty(1)
        plain = param_is_not_tensor_parallel_duplicate(param, pgc.tp)
        param.allreduce = False  # type: ignore[attr-defined]
        expert = param_is_not_tensor_parallel_duplicate(
            param, tp_group=pgc.tp, expert_tp_group=pgc.expt_tp
        )
        given_tp = param_is_not_tensor_parallel_duplicate(param, tp_group=pgc.tp)
        return {"plain": plain, "expert": expert, "given_tp": given_tp}
    finally:
        mg.destroy_model_parallel(pgc)


def test_non_allreduce_param_uses_expert_tp_group_for_duplicate_filter(
    rank_pools: RankPools,
) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_tp_attrs_without_init.py::
    test_non_allreduce_param_uses_expert_tp_group_for_duplicate_filter``.

    A parameter without TP attributes counts once over the TP group: on TP rank 1 it is a
    duplicate. Marked ``allreduce=False`` (reduced over the expert-DP group) it is filtered
    over the expert TP group instead, where every rank is rank 0 (expert TP = 1): kept.
    Upstream hands duck-typed objects with a ``rank()``; mc takes real process groups
    (TP = 2, expert TP = 1 on 2 ranks: rank 1 is TP rank 1 and expert-TP rank 0).
    """
    results = rank_pools.get(2).run(_duplicate_filter)
    assert [res["plain"] for res in results] == [True, False]
    assert [res["expert"] for res in results] == [True, True]
    # without expert_tp_group the given tp_group decides, for expert params too (Megatron's
    # `if not allreduce and expert_tp_group is not None`; else `tp_group.rank() == 0`)
    assert [res["given_tp"] for res in results] == [True, False]
