"""ModelParallelConfig: Megatron defaults and ``replace`` (each validation rule with its message
is in the bad-input catalogue, ``test_bad_input.py``)."""

from __future__ import annotations

import pytest
import torch

from mc_groups import ModelParallelConfig


def test_defaults_match_megatron() -> None:
    c = ModelParallelConfig()
    assert c.tensor_model_parallel_size == 1
    assert c.sequence_parallel is False
    assert c.params_dtype is torch.float32
    assert c.perform_initialization is True
    assert c.use_cpu_initialization is False
    assert c.gradient_accumulation_fusion is False
    assert c.wgrad_deferral_limit == 0


def test_sequence_parallel_with_tp() -> None:
    c = ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert c.sequence_parallel


def test_replace_validates() -> None:
    c = ModelParallelConfig(tensor_model_parallel_size=2)
    assert c.replace(sequence_parallel=True).sequence_parallel
    with pytest.raises(ValueError, match="no field"):
        c.replace(nonsense=1)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ModelParallelConfig().replace(sequence_parallel=True)
