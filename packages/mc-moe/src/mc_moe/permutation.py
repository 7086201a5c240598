r"""Tokens grouped by expert and back: Megatron-Core's ``moe_utils.permute`` / ``unpermute``
/ ``sort_chunks_by_idxs`` on their dropless, unfused path (no communication).

A routing map ``M`` (``[T, E]`` bool, ``M[t, e]``: token ``t`` goes to expert ``e``) orders
the ``T·k`` (token, expert) pairs by expert, and within an expert by token::

    sorted_indices = [t for e in range(E) for t in range(T) if M[t, e]]
    permute:    P[i] = X[sorted_indices[i]]                          (``[T·k, H]``)
    unpermute:  Y[t] = Σ_{i: sorted_indices[i] = t} p_i · P[i]       (``p_i``: the pair's
                                                                      routing weight)

so the rows an expert computes are contiguous and the combine is one ``index_add``. Both
are differentiable in the tokens and the weights (autograd's ``index_select`` /
``index_add``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from mc_groups.errors import InputValueError

__all__ = [
    "Permuted",
    "permute",
    "routing_map_from_top_k",
    "sort_chunks_by_idxs",
    "unpermute",
]


class Permuted(NamedTuple):
    """What :func:`permute` returns: the rows grouped by expert, their routing weights (None
    without ``probs``) and the source token of each row."""

    tokens: torch.Tensor
    probs: torch.Tensor | None
    sorted_indices: torch.Tensor


def routing_map_from_top_k(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``transformers``' routing (``top_k_index`` / ``top_k_weights``, ``[T, k]``: each
    token's experts and weights) as Megatron's: the routing map ``[T, E]`` (bool) and the
    dense probabilities ``[T, E]`` (zero off the map; differentiable in the weights)."""
    tokens = top_k_index.shape[0]
    index = top_k_index.long()
    routing_map = torch.zeros(tokens, num_experts, dtype=torch.bool, device=index.device)
    routing_map.scatter_(1, index, True)
    zeros = top_k_weights.new_zeros(tokens, num_experts)
    return routing_map, zeros.scatter(1, index, top_k_weights)


def permute(
    tokens: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor | None = None
) -> Permuted:
    """Rows of ``tokens`` (``[T, H]``) grouped by expert (module notes); ``probs``
    (``[T, E]``) gives each row its routing weight."""
    pairs = routing_map.t().nonzero()  # (expert, token), expert-major, tokens in order
    sorted_indices = pairs[:, 1]
    permuted_probs = None if probs is None else probs.t()[routing_map.t()]
    return Permuted(tokens.index_select(0, sorted_indices), permuted_probs, sorted_indices)


def unpermute(
    permuted_tokens: torch.Tensor,
    sorted_indices: torch.Tensor,
    restore_shape: Sequence[int],
    probs: torch.Tensor | None = None,
    routing_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """The inverse of :func:`permute`: each row, scaled by its routing weight when ``probs``
    (``[T, E]``, with the ``routing_map`` that permuted them) is given, added into its source
    token's row of a zero ``restore_shape`` tensor. The sum runs in the weights' dtype when
    they are wider (Megatron: fp32 routing weights promote the rows), cast back at the end."""
    rows = permuted_tokens
    if probs is not None:
        if routing_map is None:
            raise InputValueError("unpermute: probs need the routing_map that permuted the tokens")
        rows = rows * probs.t()[routing_map.t()].unsqueeze(-1)
    out = rows.new_zeros(tuple(restore_shape))
    return out.index_add(0, sorted_indices, rows).to(permuted_tokens.dtype)


def sort_chunks_by_idxs(
    input: torch.Tensor, split_sizes: Sequence[int], sorted_idxs: Sequence[int]
) -> torch.Tensor:
    """``input`` cut along dim 0 into ``split_sizes`` chunks, concatenated in the order
    ``sorted_idxs`` (Megatron's regrouping of received tokens by local expert)."""
    chunks = torch.split(input, list(split_sizes), dim=0)
    return torch.cat([chunks[i] for i in sorted_idxs], dim=0)
