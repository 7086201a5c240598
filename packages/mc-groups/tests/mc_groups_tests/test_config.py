"""ModelParallelConfig: Megatron defaults, and each validation rule with its message."""

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


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"tensor_model_parallel_size": 0}, ValueError, ["tensor_model_parallel_size=0"]),
        ({"tensor_model_parallel_size": 2.0}, TypeError, ["tensor_model_parallel_size=2.0"]),
        ({"sequence_parallel": 1}, TypeError, ["sequence_parallel=1"]),
        ({"sequence_parallel": True}, ValueError, ["sequence_parallel", "tensor_model_parallel"]),
        ({"fp16": True, "bf16": True}, ValueError, ["fp16", "bf16"]),
        ({"params_dtype": "float32"}, TypeError, ["params_dtype='float32'"]),
        ({"wgrad_deferral_limit": -1}, ValueError, ["wgrad_deferral_limit=-1"]),
        (
            {"virtual_pipeline_model_parallel_size": 2},
            ValueError,
            ["virtual_pipeline_model_parallel_size=2", "pipeline_model_parallel_size"],
        ),
        ({"tp_comm_overlap": True}, ValueError, ["tp_comm_overlap"]),
        ({"gtp_remat_size": True}, TypeError, ["gtp_remat_size=True"]),
    ],
)
def test_validation(kwargs: dict[str, object], error: type[Exception], words: list[str]) -> None:
    with pytest.raises(error) as info:
        ModelParallelConfig(**kwargs)  # type: ignore[arg-type]
    for word in words:
        assert word in str(info.value)


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
