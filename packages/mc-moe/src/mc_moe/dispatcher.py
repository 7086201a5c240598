r"""Token dispatch over the expert-parallel group: Megatron-Core's
``MoEAlltoAllTokenDispatcher`` (dropless), on mc's groups and collective layer.

Each rank routes its own tokens (its data-parallel batch; under sequence parallelism its
part of the sequence). ``P`` = EP size, ``Q`` = expert-TP size, ``E`` experts, ``L = E/P``
local experts (rank ``p`` of ``ep`` holds experts ``p·L … p·L + L − 1``), ``T`` local
tokens, top-``k`` routing. One MoE layer, in issue order::

    1. permute      the T·k (token, expert) rows grouped by expert           local
    2. counts       every rank's tokens per expert: all-gather of E int64     over tp_ep (P·Q)
                    → input_splits [P] (rows to each ep rank), output_splits [P] (rows from
                    each), output_splits_tp [Q] (rows each etp peer receives), tokens per
                    local expert [L]
    3. dispatch     the rows to the ranks of their experts                    all-to-all, ep
    4. gather       (Q > 1) every etp peer's rows                            all-gather, expt_tp
    5. sort         rows regrouped by local expert (chunks [Q][P][L] → [L][Q][P]) local
    6. experts      each local expert on its contiguous rows                  (the caller's)
    7. unsort       back to [Q][P][L]                                         local
    8. scatter      (Q > 1) partial sums of the etp peers summed, each keeps  reduce-scatter,
                    its rows                                                  expt_tp
    9. combine      the rows back to the ranks that routed them               all-to-all, ep
   10. unpermute    each token's k rows, weighted by their routing weights,  local
                    summed into its row

Backward runs 9 → 3 the other way (all-to-all, all-gather for 8, reduce-scatter for 4,
all-to-all), so one layer costs 1 all-gather of counts + 2 all-to-alls each way (+ 1
all-gather and 1 reduce-scatter each way at Q > 1). The bytes of each token all-to-all are
``T·k × H × dtype size`` (the rows this rank sends, itself included). Nothing is exchanged
on a group of one rank; with P = Q = 1 this is a local loop over the experts.

Differences from Megatron-Core, on purpose: the routing weights are applied on the routing
rank at step 10 (Megatron's ``unpermute(probs=...)``) instead of being sent with the tokens
and applied by the experts: the same sum, one all-to-all fewer each way; the token
collectives are ``mc_tp_layers``' autograd mappings (``all_to_all``,
``gather_from_sequence_parallel_region``, ``reduce_scatter_to_sequence_parallel_region``),
so their records carry that package's labels (``tp all-to-all``, ``tp gather dim 0``, …)
on the ``ep`` / ``expt_tp`` groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_moe.permutation import (
    permute,
    routing_map_from_top_k,
    sort_chunks_by_idxs,
    unpermute,
)
from mc_tp_layers.mappings import (
    all_to_all,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)

__all__ = ["TokenDispatcher"]

# The local experts: (rows [N, H] grouped by local expert, rows per local expert [L]) →
# outputs [N, H] in the same order (at Q > 1 each etp peer returns its partial sum).
_ExpertCompute = Callable[[torch.Tensor, Sequence[int]], torch.Tensor]

COUNTS_LABEL = "moe token counts"


@dataclass(frozen=True)
class _Splits:
    """The sizes of one dispatch (host ints)."""

    input_splits: list[int]  # [P] rows this rank sends to each ep rank
    output_splits: list[int]  # [P] rows it receives from each
    output_splits_tp: list[int]  # [Q] rows each etp peer received (gather sizes)
    chunk_sizes: list[int]  # [Q·P·L] rows per (etp peer, ep source, local expert)
    tokens_per_local_expert: list[int]  # [L]


class TokenDispatcher:
    """The all-to-all dispatch of one MoE layer (module notes) over ``ep`` and ``expt_tp``.

    Args:
        num_experts: ``E``, a multiple of the EP size (checked by the caller).
        ep: the expert-parallel group (this rank holds E / P experts, P its size).
        expt_tp: the expert tensor-parallel group (each expert split over it).
        tp_ep: the group of both (``expt_tp`` fastest, as ``mc_groups`` builds it).
    """

    def __init__(
        self,
        num_experts: int,
        ep: dist.ProcessGroup,
        expt_tp: dist.ProcessGroup,
        tp_ep: dist.ProcessGroup,
    ) -> None:
        self.num_experts = num_experts
        self.ep, self.expt_tp, self.tp_ep = ep, expt_tp, tp_ep
        self.ep_size, self.tp_size = mg.group_size(ep), mg.group_size(expt_tp)
        self.num_local_experts = num_experts // self.ep_size
        self.first_local_expert = mg.group_rank(ep) * self.num_local_experts
        chunks = torch.arange(self.num_local_experts * self.tp_size * self.ep_size)
        # [Q·P, L] → [L, Q·P] and back (Megatron's sort_input_by_local_experts / restore_...)
        self._sort = chunks.reshape(-1, self.num_local_experts).T.ravel().tolist()
        self._restore = chunks.reshape(self.num_local_experts, -1).T.ravel().tolist()

    def __call__(
        self,
        hidden_states: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        experts: _ExpertCompute,
    ) -> torch.Tensor:
        """``Σ_j w_tj · expert_{e_tj}(x_t)`` for each of this rank's tokens ``x_t``
        (``hidden_states`` ``[T, H]``; ``top_k_index`` / ``top_k_weights`` ``[T, k]``, global
        expert ids), with the experts wherever they live (module notes). ``experts`` computes the
        local experts: ``(rows [N, H] grouped by local expert, rows per local expert)`` →
        their outputs in the same order (at expert TP > 1, this rank's partial sums)."""
        routing_map, probs = routing_map_from_top_k(top_k_index, top_k_weights, self.num_experts)
        permuted = permute(hidden_states, routing_map)
        out = self.grouped(permuted.tokens, routing_map.sum(dim=0), experts)
        return unpermute(
            out, permuted.sorted_indices, hidden_states.shape, probs=probs, routing_map=routing_map
        )

    def grouped(
        self, rows: torch.Tensor, tokens_per_expert: torch.Tensor, experts: _ExpertCompute
    ) -> torch.Tensor:
        """Steps 2-9 on rows already grouped by global expert (step 1 done by the caller:
        torchtitan's MoE module sorts its rows before its experts): ``rows`` ``[N, H]``,
        ``tokens_per_expert`` ``[E]`` (rows per expert, in order); the experts' outputs for
        those rows, in the same order."""
        splits = self._splits(tokens_per_expert)
        out = self._dispatch(rows, splits)
        return self._combine(experts(out, splits.tokens_per_local_expert), splits)

    def _splits(self, tokens_per_expert: torch.Tensor) -> _Splits:
        """Step 2: one all-gather of every tp_ep rank's tokens per expert, read on the host
        once (one device-to-host copy per layer forward; the sizes below are derived from
        it on the device first)."""
        p, q, n = self.ep_size, self.tp_size, self.num_local_experts
        local = tokens_per_expert.to(torch.int64)
        if p * q == 1:
            counts = local.tolist()
            return _Splits(counts, counts, [sum(counts)], counts, counts)
        gathered = local.new_empty(p * q * self.num_experts)
        mg.all_gather(gathered, local, self.tp_ep, label=COUNTS_LABEL)
        # [P, Q, E] in tp_ep rank order (expt_tp fastest) → [Q, P, E]
        table = gathered.view(p, q, self.num_experts).transpose(0, 1)
        first = self.first_local_expert
        mine = table[:, :, first : first + n]  # [Q, P, L] rows for my local experts
        per_rank = mine.sum(dim=2)  # [Q, P]
        parts = (
            local.view(p, n).sum(dim=1),  # input_splits [P]
            per_rank[mg.group_rank(self.expt_tp)],  # output_splits [P]
            per_rank.sum(dim=1),  # output_splits_tp [Q]
            mine.reshape(-1),  # chunk_sizes [Q·P·L]
            mine.sum(dim=(0, 1)),  # tokens_per_local_expert [L]
        )
        values = torch.cat(parts).tolist()
        ends = list(accumulate(part.numel() for part in parts))
        return _Splits(*(values[a:b] for a, b in zip([0, *ends[:-1]], ends, strict=True)))

    def _dispatch(self, rows: torch.Tensor, splits: _Splits) -> torch.Tensor:
        """Steps 3-5: to the experts' ranks, gathered over expt_tp, grouped by local expert."""
        if self.ep_size > 1:
            rows = all_to_all(self.ep, rows, splits.output_splits, splits.input_splits)
        if self.tp_size > 1:
            rows = gather_from_sequence_parallel_region(
                rows, True, self.expt_tp, output_split_sizes=splits.output_splits_tp
            )
        if self.num_local_experts > 1 and self.ep_size * self.tp_size > 1:
            rows = sort_chunks_by_idxs(rows, splits.chunk_sizes, self._sort)
        return rows

    def _combine(self, rows: torch.Tensor, splits: _Splits) -> torch.Tensor:
        """Steps 7-9: back to [Q][P][L] order, summed over expt_tp, back to their ranks."""
        if self.num_local_experts > 1 and self.ep_size * self.tp_size > 1:
            by_expert = torch.tensor(splits.chunk_sizes).view(-1, self.num_local_experts)
            rows = sort_chunks_by_idxs(rows, by_expert.T.ravel().tolist(), self._restore)
        if self.tp_size > 1:
            rows = reduce_scatter_to_sequence_parallel_region(
                rows, self.expt_tp, input_split_sizes=splits.output_splits_tp
            )
        if self.ep_size > 1:
            rows = all_to_all(self.ep, rows, splits.input_splits, splits.output_splits)
        return rows
