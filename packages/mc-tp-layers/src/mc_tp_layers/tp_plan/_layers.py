r"""mc's layers built from an existing ``nn.Linear`` / ``nn.Embedding``: each rank keeps its
shard of the current weight (no initialisation, no RNG tracker), the module keeps the
original's state-dict names (``weight``, ``bias``; no ``_extra_state``) and returns a plain
tensor as the original did.

Shards (W ranks, rank r; torch stores a linear's weight as ``[out, in]``)::

    colwise   weight rows   [out/W, in]   bias split [out/W]
              packed in p equal blocks: rank r keeps [block_1,r; …; block_p,r]
    rowwise   weight cols   [out, in/W]   bias whole [out] (added once, after the sum)
    embedding table rows    [V/W, h]

On the meta device nothing is copied: each rank allocates only its shard, on meta
(materialise with ``module.to_empty(device=...)``, then
:func:`~mc_tp_layers.tp_plan.load_full_state_dict`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mc_groups import ProcessGroupCollection
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputValueError
from mc_tp_layers._config import check_layer_config
from mc_tp_layers.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _keep_param_attributes,
)
from mc_tp_layers.mappings import scatter_to_tensor_model_parallel_region
from mc_tp_layers.shards import local_shard
from mc_tp_layers.tp_plan import _sequence
from mc_tp_layers.tp_plan._styles import Colwise, Rowwise

__all__: list[str] = []


@dataclass(frozen=True)
class Setup:
    """What every converted layer of one ``parallelize`` call shares."""

    config: TransformerConfigLike
    pg_collection: ProcessGroupCollection
    tp_group: dist.ProcessGroup
    sequence_parallel: bool
    sequence_dim: int

    def layer_config(self, dtype: torch.dtype, sequence_parallel: bool) -> TransformerConfigLike:
        """The user's config with the source's dtype, no init and ``sequence_parallel``."""
        changes: dict[str, Any] = {
            "params_dtype": dtype,
            "perform_initialization": False,
            "sequence_parallel": sequence_parallel,
        }
        config: Any = self.config  # any object with the attributes (see TransformerConfigLike)
        if dataclasses.is_dataclass(config) and not isinstance(config, type):
            return check_layer_config(dataclasses.replace(config, **changes))
        derived = copy.copy(config)
        for field, value in changes.items():
            setattr(derived, field, value)
        return check_layer_config(derived)

    def linear_args(
        self, source: torch.nn.Linear, name: str, sequence_parallel: bool
    ) -> dict[str, Any]:
        """The keyword arguments of a parallel linear built from ``source`` (its dtype,
        device and bias; no initialisation)."""
        weight = source.weight
        return {
            "config": self.layer_config(weight.dtype, sequence_parallel),
            "init_method": _untouched,
            "bias": source.bias is not None,
            "pg_collection": self.pg_collection,
            "name": name,
            "device": weight.device,
        }


def _untouched(_weight: torch.Tensor) -> None:
    """The init method of a layer built from existing weights (never called)."""


def _fill(target: torch.Tensor, full: torch.Tensor, requires_grad: bool, group: Any) -> None:
    """``target`` (a split param, its attributes set) takes its piece of ``full``."""
    if target.device.type != "meta" and full.device.type != "meta":
        with torch.no_grad():
            target.copy_(local_shard(target, full, group))
    target.requires_grad_(requires_grad)


class ConvertedModule(torch.nn.Module):
    """A layer built from an existing module (mixed into each of them): it keeps that
    module's state-dict keys. Its params carry mc's TP attributes, so
    :mod:`mc_tp_layers.shards` cuts and joins them like any mc layer's.

    The linear layers' base class adds ``_extra_state`` to the state dicts it loads (for
    Transformer-Engine checkpoints); a converted layer keeps ``nn.Linear``'s keys, so that
    key is dropped before loading.
    """

    tp_group: dist.ProcessGroup

    def copy_from(self, source: torch.nn.Linear) -> None:
        """This rank's piece of a linear ``source``'s weight and bias."""
        bias = getattr(self, "bias", None)
        _fill(
            self.get_parameter("weight"), source.weight, source.weight.requires_grad, self.tp_group
        )
        if source.bias is not None and bias is not None:
            _fill(bias, source.bias, source.bias.requires_grad, self.tp_group)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """``torch.nn.Module._apply`` keeping each param's attributes (``to_empty`` after
        parallelizing on meta replaces every param)."""
        before = dict(self._parameters)
        applied = super()._apply(fn, recurse)  # type: ignore[no-untyped-call]
        _keep_param_attributes(self, before)
        return applied

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        unexpected: list[str] = args[-2]  # (local_metadata, strict, missing, unexpected, errors)
        if (
            prefix + "_extra_state" in unexpected
            and state_dict.get(prefix + "_extra_state") is None
        ):
            unexpected.remove(prefix + "_extra_state")


class ColwiseLinear(ColumnParallelLinear, ConvertedModule):
    """A :class:`ColumnParallelLinear` holding rank r's rows of an ``nn.Linear``.

    ``in_block``: a ``sequence_gather`` entry on this module or a parent makes its input
    enter the TP region there, whose backward (reduce-scatter under SP, else all-reduce)
    sums the TP ranks' partial input grads once for every layer of the block; the layer
    then runs without its own ``dX`` all-reduce, and its input must be that tensor.
    """

    get_extra_state = torch.nn.Module.get_extra_state
    set_extra_state = torch.nn.Module.set_extra_state

    def __init__(
        self, source: torch.nn.Linear, style: Colwise, setup: Setup, name: str, in_block: bool
    ) -> None:
        super().__init__(
            source.in_features,
            source.out_features,
            gather_output=style.gather_output,
            stride=style.parts,
            disable_grad_reduce=in_block,
            **setup.linear_args(source, name, False),
        )
        self.parts = style.parts
        self.qualified_name = name
        self.needs_block_input = in_block and style.block_input
        self.copy_from(source)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``nn.Linear``'s contract: ``[..., out/W]`` (``[..., out]`` when gathering)."""
        if self.needs_block_input and not _sequence.is_block_input(input_):
            raise InputValueError(
                f"{self.qualified_name} (colwise) sits in a block with 'sequence_gather' but "
                "its input is not the tensor that entered the block (the block computes "
                "something before calling it); move the 'sequence_gather' entry onto this "
                "module: ('sequence_gather', <its colwise style>)"
            )
        if input_.dim() > 3:  # nn.Linear takes any leading dims (MLA's [b, 1, s, latent])
            output, _ = super().forward(input_.reshape(-1, input_.shape[-1]))
            return output.view(*input_.shape[:-1], output.shape[-1])
        output, _ = super().forward(input_)
        return output


class RowwiseLinear(RowParallelLinear, ConvertedModule):
    """A :class:`RowParallelLinear` holding rank r's columns of an ``nn.Linear`` (bias whole).

    Under sequence parallelism its output is reduce-scattered along the sequence dim (the
    layer's own dim-0 reduce-scatter, with a batch-first input transposed around it; a 2-D
    ``[tokens, h]`` input along its tokens). With
    ``split_input`` under sequence parallelism the input (the whole sequence, inside a
    ``sequence_gather`` block) is split along its last dim here (backward: all-gather), as
    Megatron's layer would without sequence parallelism, which it refuses to combine.
    """

    get_extra_state = torch.nn.Module.get_extra_state
    set_extra_state = torch.nn.Module.set_extra_state

    def __init__(self, source: torch.nn.Linear, style: Rowwise, setup: Setup, name: str) -> None:
        self_split = style.split_input and setup.sequence_parallel
        super().__init__(
            source.in_features,
            source.out_features,
            input_is_parallel=not style.split_input or self_split,
            skip_bias_add=False,
            **setup.linear_args(source, name, setup.sequence_parallel),
        )
        self.sequence_dim = setup.sequence_dim
        self.split_here = self_split
        self.copy_from(source)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        """``nn.Linear``'s contract: ``[..., out]`` (this rank's part of the sequence under SP)."""
        if self.split_here:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.tp_group)
        if self.sequence_parallel and self.sequence_dim != 0 and input_.dim() > 2:
            moved = input_.transpose(0, self.sequence_dim).contiguous()
            return super().forward(moved)[0].transpose(0, self.sequence_dim)
        output, _ = super().forward(input_)
        return output


class VocabEmbedding(VocabParallelEmbedding, ConvertedModule):
    """A :class:`VocabParallelEmbedding` holding rank r's rows of an ``nn.Embedding``.

    Its output is all-reduced (every rank gets the full ``[b, s, h]``, so a model that
    derives positions from the embeddings' length still sees the whole sequence; split it
    with a ``sequence_scatter`` entry). ``padding_idx`` keeps ``nn.Embedding``'s meaning: that
    row gets no gradient. ``embed_scale``: the rows are multiplied by it (cast to the table's
    dtype), as Gemma's scaled word embedding does.
    """

    def __init__(
        self,
        source: torch.nn.Embedding,
        setup: Setup,
        name: str,
        embed_scale: float | None = None,
    ) -> None:
        weight = source.weight
        super().__init__(
            source.num_embeddings,
            source.embedding_dim,
            init_method=_untouched,
            config=setup.layer_config(weight.dtype, False),
            pg_collection=setup.pg_collection,
            device=weight.device,
        )
        self.padding_idx = source.padding_idx
        self.scalar_embed_scale = embed_scale
        _fill(self.weight, weight, weight.requires_grad, self.tp_group)
        self.share_weight(self.weight)

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        """The full ``[..., h]`` embeddings (times ``embed_scale`` when the source scaled them)."""
        output: torch.Tensor = super().forward(input_)
        if self.scalar_embed_scale is None:
            return output
        return output * torch.tensor(self.scalar_embed_scale).to(self.weight.dtype)

    def share_weight(self, weight: torch.nn.Parameter) -> None:
        """Use ``weight`` (a tied layer's shard of the same table; ``parallelize`` refuses a
        tied table with ``padding_idx``), keeping ``padding_idx``'s row without gradient."""
        self.weight = weight
        local_pad = None if self.padding_idx is None else self.padding_idx - self.vocab_start_index
        if local_pad is not None and 0 <= local_pad < self.num_embeddings_per_partition:
            weight.register_hook(_zero_row(local_pad))  # type: ignore[no-untyped-call]


def _zero_row(row: int) -> Any:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        grad[row] = 0
        return grad

    return hook
