r"""``VocabParallelEmbedding``: an embedding table split along the vocabulary.

::

    table E [V, h]  =  [ E_1 ; E_2 ; … ; E_W ]      rank r holds rows [r·V/W, (r+1)·V/W)
    rank r: out_r[t] = E_r[id_t - r·V/W]  if id_t is in its range, else 0
    out = Σ_r out_r                                   (all-reduce), or, with
                                                      reduce_scatter_embeddings, a
                                                      reduce-scatter along the sequence

Collectives (W > 1): forward one all-reduce (or one reduce-scatter of ``[s, b, h]``, the
``[b, s]`` ids transposed to sequence-first); backward none (or one all-gather along dim
0).

Ids must lie in ``[0, V)`` at every TP size (``F.embedding``'s rule; without the check an
id outside would embed to zeros at TP > 1). On CPU that is a ``ValueError`` before any
collective; on a device an asynchronous device assert, which costs no host
synchronisation (see :mod:`mc_tp_layers._index_range`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mc_groups import ProcessGroupCollection, param_attrs
from mc_groups.argcheck import check_flag, check_int, type_name
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers import _layer_base as base
from mc_tp_layers._index_range import check_index_range
from mc_tp_layers._layer_base import TensorParallelModule
from mc_tp_layers._tp_groups import resolve_tp_group
from mc_tp_layers._validate import check_divisible, check_sequence
from mc_tp_layers.initialization import InitMethod, WeightInit, check_init
from mc_tp_layers.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from mc_tp_layers.random import RNGStatesTracker

__all__ = ["VocabParallelEmbedding"]


class VocabParallelEmbedding(TensorParallelModule):
    """Embedding parallelized in the vocabulary dimension (see the module notes).

    Args:
        num_embeddings: V, the vocabulary size; must divide by the TP size.
        embedding_dim: h, the hidden size.
        init_method: fills the table in place.
        reduce_scatter_embeddings: reduce-scatter the ``[s, b, h]`` output along the
            sequence (sequence parallelism) instead of all-reducing ``[b, s, h]``.
        config: the layer config (:class:`mc_groups.TransformerConfigLike`).
        tp_group: the tensor-parallel group (default: ``pg_collection``'s, then the
            default collection's).
        pg_collection: groups to read ``tp`` from.
        rng_tracker: the RNG tracker for device initialisation (mc addition).
        device: where to allocate (mc addition).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        init_method: InitMethod,
        reduce_scatter_embeddings: bool = False,
        config: TransformerConfigLike,
        tp_group: dist.ProcessGroup | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.reduce_scatter_embeddings = check_flag(
            "reduce_scatter_embeddings", reduce_scatter_embeddings
        )
        tracker = base.check_tracker(rng_tracker)
        explicit_device = base.check_device(device)
        self.tp_group = resolve_tp_group(tp_group, pg_collection, what="VocabParallelEmbedding")
        rank, world = int(self.tp_group.rank()), int(self.tp_group.size())
        self.num_embeddings_per_partition = check_divisible(
            num_embeddings,
            world,
            "num_embeddings",
            "pad the vocabulary to a multiple of it (Megatron's make-vocab-size-divisible-by)",
        )
        check_int("embedding_dim", embedding_dim)
        check_init(init_method)
        self.vocab_start_index = rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        target = base.layer_device(explicit_device, self.config, self.tp_group)
        init = WeightInit(self.config, init_method, tracker, self.tp_group)
        init.check_tracker()
        shape = (self.num_embeddings_per_partition, embedding_dim)
        what = (
            f"VocabParallelEmbedding(num_embeddings={num_embeddings}, "
            f"embedding_dim={embedding_dim})"
        )
        self.weight = base.new_parameter(shape, self.config, target, what)
        init.run(self.weight, (num_embeddings, embedding_dim), 0, 1)
        param_attrs.mark_allreduce(self.weight, True)
        self._record_construction(
            {
                "num_embeddings": num_embeddings,
                "embedding_dim": embedding_dim,
                "reduce_scatter_embeddings": self.reduce_scatter_embeddings,
            }
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """Embeddings of the token ids ``input_`` (``[b, s]``), summed over the TP ranks.

        Returns ``[b, s, h]``, or ``[s/W, b, h]`` with ``reduce_scatter_embeddings``. Ids
        outside ``[0, num_embeddings)`` are an error (see the module notes). The first
        forward first compares this TP group's pending layer constructions (see
        :mod:`mc_tp_layers.agreement`).
        """
        ids = self._checked(self._check_ids, input_)
        world = int(self.tp_group.size())
        if world > 1:
            outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
            local = (ids - self.vocab_start_index).masked_fill(outside, 0)
            output_parallel = F.embedding(local, self.weight).masked_fill(
                outside.unsqueeze(-1), 0.0
            )
        else:
            output_parallel = F.embedding(ids, self.weight)
        if self.reduce_scatter_embeddings:
            sequence_first = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(sequence_first, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)

    def _check_ids(self, input_: object) -> torch.Tensor:
        if not isinstance(input_, torch.Tensor):
            raise InputTypeError(
                f"input_ must be a torch.Tensor of token ids, got {type_name(input_)}"
            )
        if input_.dtype not in (torch.int64, torch.int32):
            raise InputTypeError(
                f"input_ holds {input_.dtype}; token ids must be an integer tensor "
                "(torch.int64 or torch.int32)"
            )
        if input_.device != self.weight.device:
            raise InputValueError(
                f"input_ is on {input_.device} but the embedding table is on "
                f"{self.weight.device}; move the ids there (ids.to(device))"
            )
        if self.reduce_scatter_embeddings:
            if input_.dim() != 2:
                raise InputValueError(
                    f"reduce_scatter_embeddings needs ids of shape [batch, sequence], got "
                    f"{tuple(input_.shape)}"
                )
            check_sequence(input_.transpose(0, 1), int(self.tp_group.size()))
        check_index_range(
            input_,
            self.num_embeddings,
            "input_",
            "token id(s)",
            f"ids index the num_embeddings={self.num_embeddings} rows of the vocabulary; map "
            "unknown or padding tokens to an id inside it",
        )
        return input_

    def extra_repr(self) -> str:
        """Sizes and TP degree."""
        return (
            f"num_embeddings={self.num_embeddings}, embedding_dim={self.embedding_dim}, "
            f"TP={self.tp_group.size()}, reduce_scatter_embeddings={self.reduce_scatter_embeddings}"
        )
