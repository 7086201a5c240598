"""Conformance with Megatron-LM's ``tests/unit_tests/tensor_parallel/test_layers.py``.

Upstream calls the linear functions with ``tp_group=None`` (or with ``None`` in the
``tp_group`` position), so they use the global TP group; here a default collection is
registered and the functions get no group either. Upstream's Transformer-Engine tests map
to existing mc tests:

- ``test_linear_with_grad_accumulation_supports_fp32_output_and_bf16_backward``: fp32
  output of bf16 operands, bf16 input and weight gradients:
  ``test_linear_functions.py::test_output_dtype_fp32_from_bf16`` (mc's exact torch path on
  CPU, the same numbers TE must give).
- ``test_linear_fp32_output_is_bitwise_exact_for_integer_bf16_operands``:
  ``test_linear_functions.py::test_gemm_helpers_widen_exactly``.
- ``test_linear_fp32_output_matches_plain_te_general_gemm``:
  ``test_linear_functions.py::test_te_wrapper_reshapes_and_adds_bias`` (the call mc makes,
  against a stand-in with TE's contract) and ``test_cuda.py::
  test_output_dtype_through_transformer_engine`` (the real kernel; needs CUDA and TE).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import mc_groups as mg
from mc_groups.testing import RankPools
from mc_tp_layers.linear import (
    linear_with_frozen_weight,
    linear_with_grad_accumulation_and_async_allreduce,
)
from mc_tp_layers.mappings import gather_from_tensor_model_parallel_region
from mc_tp_layers_tests._helpers import assert_close, backward, randn, world

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _default_dtypes() -> dict[str, Any]:
    pgc = world(1, set_default=True)
    try:
        out = {}
        for dtype in DTYPES:
            x = randn(4, 3, 16, seed=1).to(dtype)
            w = randn(32, 16, seed=2).to(dtype)
            y = linear_with_grad_accumulation_and_async_allreduce(
                x, w, None, False, False, False, tp_group=None, output_dtype=None
            )
            out[str(dtype)] = y.detach()
        return out
    finally:
        mg.destroy_model_parallel(pgc)


def test_linear_default_output_dtype_preserves_input_dtype(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_layers.py::test_linear_default_output_dtype_preserves_input_dtype``.

    With ``output_dtype=None`` the output keeps the input's dtype (fp16, bf16, fp32) and
    equals ``F.linear`` (``torch.testing.assert_close``'s default tolerance for the dtype),
    with the TP group taken from the default collection (TP = 1).
    """  # noqa: E501
    for res in rank_pools.get(2).run(_default_dtypes):
        for dtype in DTYPES:
            x = randn(4, 3, 16, seed=1).to(dtype)
            w = randn(32, 16, seed=2).to(dtype)
            y = res[str(dtype)]
            assert y.dtype == dtype
            torch.testing.assert_close(y, F.linear(x, w))


def _frozen(tp: int, allreduce_dgrad: bool) -> dict[str, Any]:
    pgc = world(tp, set_default=True)
    try:
        x = torch.eye(8).requires_grad_()
        weight = torch.ones(8 // tp, 8)
        bias = torch.zeros(8 // tp)
        with mg.record_collectives() as log:
            # Upstream's positional call: None lands in the tp_group and grad_output_buffer
            # positions, so the default TP group is used.
            y = linear_with_frozen_weight(
                x, weight, bias, False, allreduce_dgrad, False, None, None
            )
            y = gather_from_tensor_model_parallel_region(y)
            backward(y, torch.ones_like(y))
        assert x.grad is not None
        return {"y": y.detach(), "dx": x.grad, "ops": [(e.op, e.group_ranks) for e in log]}
    finally:
        mg.destroy_model_parallel(pgc)


@pytest.mark.parametrize(("tp", "allreduce_dgrad"), [(1, False), (2, True)])
def test_linear_with_frozen_weight(rank_pools: RankPools, tp: int, allreduce_dgrad: bool) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_layers.py::test_LinearWithFrozenWeight``.

    Identity input ``[8, 8]``, an all-ones weight split over TP, a zero bias: the gathered
    output is all ones and ``d(Σ y)/dx`` is 8 everywhere. At TP > 1 each rank's dgrad is
    ``8 / TP`` per entry and ``allreduce_dgrad`` sums it over the TP group (one
    all-reduce, after the output all-gather). Upstream runs TP = 1 and TP = 8; here TP = 1
    and TP = 2 (the world size of the pool).
    """
    for res in rank_pools.get(2).run(_frozen, tp, allreduce_dgrad):
        assert torch.equal(res["y"], torch.ones(8, 8))
        assert torch.equal(res["dx"], 8 * torch.ones(8, 8))
        expected = [] if tp == 1 else [("all_gather", (0, 1)), ("all_reduce", (0, 1))]
        assert res["ops"] == expected


def _frozen_3d(d: dict[str, torch.Tensor]) -> dict[str, Any]:
    pgc = world(1, set_default=True)
    try:
        x = d["x"].clone().requires_grad_()
        y = linear_with_frozen_weight(x, d["w"], d["b"], False, False, False, None, None)
        backward(y, torch.ones_like(y))
        return {"y": y.detach(), "dx": x.grad}
    finally:
        mg.destroy_model_parallel(pgc)


def test_linear_with_frozen_weight_3d_input_matches_torch_linear(rank_pools: RankPools) -> None:
    """Follows ``tests/unit_tests/tensor_parallel/test_layers.py::test_LinearWithFrozenWeight_3d_input_matches_torch_linear``.

    A ``[4, 3, 8]`` input through a frozen ``[6, 8]`` weight with bias: output and input
    gradient of ``Σ y`` equal ``F.linear``'s (1e-5 relative, ``_helpers``).
    """  # noqa: E501
    d = {"x": randn(4, 3, 8, seed=1), "w": randn(6, 8, seed=2), "b": randn(6, seed=3)}
    x = d["x"].clone().requires_grad_()
    ref = F.linear(x, d["w"], d["b"])
    backward(ref, torch.ones_like(ref))
    assert x.grad is not None
    for res in rank_pools.get(2).run(_frozen_3d, d):
        assert_close(res["y"], ref, "frozen 3-D output")
        assert_close(res["dx"], x.grad, "frozen 3-D input grad")
