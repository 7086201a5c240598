"""How a stage calls its chunk, without a world: ``HFCausalLMForward`` passes token ids to the
first stage and hidden states to the others, with the whole sequence's positions under
sequence parallelism (a later stage would derive them from its slice's length); the stage
module hands on a contiguous output and a contiguous input grad (gloo receives into buffers
of their strides; a sequence-parallel block's reduce-scatter along dim 1 is not contiguous).
Exact: recorded arguments and strides."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from mc_groups.errors import InputTypeError, InputValueError
from mc_train import HFCausalLMForward, StageInfo, call_module, hf_causal_lm_forward
from mc_train._pipelining import StageModule


class _Recorder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def forward(self, **kwargs: Any) -> SimpleNamespace:
        self.calls.append(kwargs)
        x = kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        return SimpleNamespace(logits=torch.zeros(2) if x is None else x.float())


def test_transformers_stages_get_ids_then_embeddings_and_positions() -> None:
    module, x = _Recorder(), torch.ones(2, 3, 4)
    ids = torch.ones(2, 6, dtype=torch.int64)
    hf_causal_lm_forward(module, ids, StageInfo(0, 2, 0))
    hf_causal_lm_forward(module, x, StageInfo(1, 2, 0))
    HFCausalLMForward(sequence_parallel_size=2)(module, x, StageInfo(1, 2, 0))
    first, later, split = module.calls
    assert set(first) == {"input_ids", "use_cache"}
    assert first["use_cache"] is False
    assert set(later) == {"inputs_embeds", "use_cache"}
    assert split["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]  # 2 ranks × 3 positions
    with pytest.raises(InputValueError, match="sequence_parallel_size=0 must be >= 1"):
        HFCausalLMForward(sequence_parallel_size=0)
    with pytest.raises(InputTypeError, match="returned tuple, but a pipeline stage passes"):
        call_module(nn.Identity().requires_grad_(), (x,), StageInfo(0, 2, 0))  # type: ignore[arg-type]


class _Transposing(nn.Module):
    """Returns and back-propagates non-contiguous tensors (as a reduce-scatter along dim 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x.transpose(0, 1).contiguous() * 2).transpose(0, 1)


def test_stage_output_and_input_grad_are_contiguous() -> None:
    stage = StageModule(_Transposing(), call_module, StageInfo(1, 2, 0))  # type: ignore[arg-type]
    x = torch.randn(3, 4, 5, requires_grad=True)
    out = stage(x)
    assert out.is_contiguous()
    (grad,) = torch.autograd.grad(
        out, x, torch.ones_like(out).transpose(0, 1).contiguous().transpose(0, 1)
    )
    assert grad.is_contiguous()
    assert torch.equal(grad, torch.full_like(x, 2.0))
