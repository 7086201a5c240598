r"""How a pipeline stage calls its chunk, and what it is told about its place.

``torch.distributed.pipelining`` calls a stage's module with one tensor: the micro-batch's
inputs on the first stage, the previous stage's output elsewhere; the module returns one
tensor: its output for the next stage, or on the last stage what the loss function reads.
A :class:`StageForward` maps that convention onto a model's own ``forward``::

    forward(module, x, stage) -> tensor
        module: the chunk (its mc DistributedDataParallel wrapper: call it, not .module)
        x:      [b, ...] inputs on the first stage, the previous stage's output elsewhere
        stage:  StageInfo(index, num_stages, chunk): which global stage this is

:func:`call_module` (``module(x)``) fits a model whose stages take and return tensors
(torchtitan's models, whose ``forward`` skips missing modules); :func:`hf_causal_lm_forward`
(an :class:`HFCausalLMForward`) fits a ``transformers`` causal LM split by
:func:`mc_train.split_model` (token ids into the first stage, hidden states as
``inputs_embeds`` into the others, the ``logits`` field out: the LM head's output on the
last stage, the hidden states where the head was removed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from mc_groups.argcheck import check_int, type_name
from mc_groups.errors import InputTypeError

__all__ = [
    "HFCausalLMForward",
    "StageForward",
    "StageInfo",
    "call_module",
    "hf_causal_lm_forward",
]


@dataclass(frozen=True)
class StageInfo:
    """Where a chunk sits in the pipeline.

    Attributes:
        index: its global stage, ``chunk · P + p`` on pipeline rank ``p`` of ``P``.
        num_stages: stages in the pipeline, ``P · V`` with ``V`` chunks per rank.
        chunk: its position among this rank's chunks (Megatron's ``vp_stage``).
    """

    index: int
    num_stages: int
    chunk: int

    @property
    def is_first(self) -> bool:
        """The stage that takes the micro-batch's inputs."""
        return self.index == 0

    @property
    def is_last(self) -> bool:
        """The stage whose output the loss function reads."""
        return self.index == self.num_stages - 1


class StageForward(Protocol):
    """Calls a chunk on one micro-batch (module notes)."""

    def __call__(self, module: nn.Module, x: torch.Tensor, stage: StageInfo) -> torch.Tensor:
        """The chunk's output for ``x`` (one tensor)."""
        ...


def _tensor(out: object, stage: StageInfo, how: str) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise InputTypeError(
            f"stage {stage.index}: {how} returned {type_name(out)}, but a pipeline stage "
            "passes one tensor on; give build_pipeline a forward= that returns one (e.g. "
            "mc_train.hf_causal_lm_forward for a transformers model)"
        )
    return out


def call_module(module: nn.Module, x: torch.Tensor, stage: StageInfo) -> torch.Tensor:
    """``module(x)``: for chunks whose ``forward`` takes and returns one tensor."""
    return _tensor(module(x), stage, "module(x)")


@dataclass(frozen=True)
class HFCausalLMForward:
    """A stage of a ``transformers`` causal LM (a :class:`StageForward`):
    ``module(input_ids=x)`` on the first stage, ``module(inputs_embeds=x)`` on the others
    (``use_cache=False``), returning the output's ``logits`` (the hidden states where
    :func:`mc_train.split_model` removed the LM head).

    A later stage derives positions (rotary embeddings, the causal mask) from ``x``'s length.
    With sequence parallelism over ``W`` TP ranks (the sequence split from the first block
    on, ``[b, s/W, h]`` between stages), give ``sequence_parallel_size=W``: the later stages
    then get ``position_ids = 0 .. W·len - 1``, the whole sequence's.

    Attributes:
        sequence_parallel_size: ``W``, the TP size the activations between stages are
            split over along the sequence (1: they hold the whole sequence).
    """

    sequence_parallel_size: int = 1

    def __post_init__(self) -> None:
        check_int("sequence_parallel_size", self.sequence_parallel_size)

    def __call__(self, module: nn.Module, x: torch.Tensor, stage: StageInfo) -> torch.Tensor:
        """The chunk's logits (or hidden states) for one micro-batch."""
        kwargs: dict[str, Any] = {"use_cache": False}
        if stage.is_first:
            out = module(input_ids=x, **kwargs)
        else:
            if self.sequence_parallel_size > 1:
                length = x.shape[1] * self.sequence_parallel_size
                kwargs["position_ids"] = torch.arange(length, device=x.device).unsqueeze(0)
            out = module(inputs_embeds=x, **kwargs)
        logits = getattr(out, "logits", None)
        if logits is None:  # a base model (no LM head): its last hidden state
            logits = getattr(out, "last_hidden_state", out)
        return _tensor(logits, stage, "the transformers model")


hf_causal_lm_forward = HFCausalLMForward()
""":class:`HFCausalLMForward` without sequence parallelism between stages."""
