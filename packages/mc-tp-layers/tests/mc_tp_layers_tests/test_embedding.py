"""VocabParallelEmbedding against one ``nn.Embedding`` holding the full table.

Each rank loads its vocabulary rows; the summed output must equal the full lookup and each
rank's weight grad the rows of the full grad. Lookups are copies and the TP sum adds exact
zeros from the ranks that do not own a token, so forward is exact; weight grads sum the
same terms as the reference in the same order. Tolerance: 1e-5 relative to scale
(``_helpers``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import mc_groups as mg
import mc_tp_layers as tpl
from mc_groups.testing import RankPools
from mc_tp_layers_tests._helpers import assert_close, chunk, config, ops, randn, world

V, H, BATCH, SEQ = 8, 6, 2, 4


def _embedding(table: torch.Tensor, ids: torch.Tensor, dy: torch.Tensor) -> dict[str, Any]:
    w = mg.group_size(torch.distributed.group.WORLD)  # type: ignore[arg-type]
    pgc = world(w)
    try:
        r = pgc.require("tp", "test").rank()
        out: dict[str, Any] = {}
        for rs in [False, True] if w > 1 else [False]:
            layer = tpl.VocabParallelEmbedding(
                V,
                H,
                init_method=torch.nn.init.zeros_,
                reduce_scatter_embeddings=rs,
                config=config(w, sequence_parallel=rs),
                pg_collection=pgc,
            )
            with torch.no_grad():
                layer.weight.copy_(chunk(table, w, r, 0))
            with mg.record_collectives() as fwd:
                y = layer(ids)
            grad = chunk(dy.transpose(0, 1), w, r, 0) if rs else dy
            with mg.record_collectives() as bwd:
                y.backward(grad)
            out[f"rs={rs}"] = {
                "y": y.detach(),
                "dw": layer.weight.grad,
                "fwd": ops(fwd),
                "bwd": ops(bwd),
                "range": (layer.vocab_start_index, layer.vocab_end_index),
            }
        return out
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize("w", [1, 2, 4])
def test_vocab_parallel_embedding_matches_nn_embedding(rank_pools: RankPools, w: int) -> None:
    table = randn(V, H, seed=1)
    ids = torch.tensor([[0, 3, 7, 3], [5, 1, 1, 6]])  # [batch, seq], ids from every range
    dy = randn(BATCH, SEQ, H, seed=2)
    ref = torch.nn.Embedding(V, H)
    with torch.no_grad():
        ref.weight.copy_(table)
    y_ref = ref(ids)
    y_ref.backward(dy)
    assert ref.weight.grad is not None
    results = rank_pools.get(w).run(_embedding, table, ids, dy)
    for r, res in enumerate(results):
        plain = res["rs=False"]
        assert plain["range"] == (r * V // w, (r + 1) * V // w)
        assert_close(plain["y"], y_ref, "embedding output")
        assert_close(plain["dw"], chunk(ref.weight.grad, w, r, 0), "embedding weight grad rows")
        assert (plain["fwd"], plain["bwd"]) == ((["all_reduce"], []) if w > 1 else ([], []))
        if w > 1:
            scattered = res["rs=True"]
            # [batch, seq, h] is turned sequence-first, summed and split along the sequence
            assert_close(scattered["y"], chunk(y_ref.transpose(0, 1), w, r, 0), "rs output rows")
            assert_close(scattered["dw"], chunk(ref.weight.grad, w, r, 0), "rs weight grad")
            assert (scattered["fwd"], scattered["bwd"]) == (["reduce_scatter"], ["all_gather"])
