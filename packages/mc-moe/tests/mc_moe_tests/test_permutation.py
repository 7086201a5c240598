"""Tokens grouped by expert and back (``mc_moe.permutation``), against numbers derived by
hand and against ``transformers``' per-expert loop (each expert on its tokens, weighted,
added into the token's row).

Localizes the order of the permuted rows (expert-major, tokens in order within an expert),
the routing weight each row carries, the combine, and their gradients. Exact comparisons
where nothing is summed in a different order; 1e-12 in float64 otherwise.
"""

from __future__ import annotations

import torch

from mc_moe.permutation import permute, routing_map_from_top_k, sort_chunks_by_idxs, unpermute


def _routing() -> tuple[torch.Tensor, torch.Tensor]:
    # token 0 → experts 2, 0; token 1 → 1, 2; token 2 → 0, 1 (top-2 of 3 experts)
    index = torch.tensor([[2, 0], [1, 2], [0, 1]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]], dtype=torch.float64)
    return index, weights


def test_permute_groups_rows_by_expert_then_token() -> None:
    index, weights = _routing()
    routing_map, probs = routing_map_from_top_k(index, weights, 3)
    assert routing_map.tolist() == [[True, False, True], [False, True, True], [True, True, False]]
    assert probs.tolist() == [[0.25, 0.0, 0.75], [0.0, 0.5, 0.5], [0.125, 0.875, 0.0]]
    tokens = torch.arange(6, dtype=torch.float64).view(3, 2)
    out = permute(tokens, routing_map, probs)
    # expert 0: tokens 0, 2; expert 1: tokens 1, 2; expert 2: tokens 0, 1
    assert out.sorted_indices.tolist() == [0, 2, 1, 2, 0, 1]
    assert out.tokens.tolist() == [[0, 1], [4, 5], [2, 3], [4, 5], [0, 1], [2, 3]]
    assert out.probs is not None
    assert out.probs.tolist() == [0.25, 0.125, 0.5, 0.875, 0.75, 0.5]


def test_unpermute_is_the_weighted_per_expert_loop() -> None:
    index, weights = _routing()
    weights.requires_grad_(True)
    tokens = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)  # expert e: x ↦ scale[e]·x²
    routing_map, probs = routing_map_from_top_k(index, weights, 3)
    grouped = permute(tokens, routing_map)
    counts = routing_map.sum(0).tolist()
    rows = torch.cat([scale[e] * x**2 for e, x in enumerate(torch.split(grouped.tokens, counts))])
    mine = unpermute(rows, grouped.sorted_indices, tokens.shape, probs, routing_map)
    # transformers' loop: for each expert, its tokens' outputs weighted and index_added
    ref = torch.zeros_like(tokens)
    for e in range(3):
        pos, tok = torch.where(index.t() == e)
        ref = ref.index_add(0, tok, scale[e] * tokens[tok] ** 2 * weights[tok, pos, None])
    torch.testing.assert_close(mine, ref, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(mine.sum(), (tokens, weights))
    ref_grads = torch.autograd.grad(ref.sum(), (tokens, weights))
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_sort_chunks_by_idxs_reorders_chunks() -> None:
    rows = torch.arange(6).view(6, 1)
    out = sort_chunks_by_idxs(rows, [1, 2, 0, 3], [2, 0, 3, 1])
    assert out.view(-1).tolist() == [0, 3, 4, 5, 1, 2]
