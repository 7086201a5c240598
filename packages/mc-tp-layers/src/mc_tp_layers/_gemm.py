"""The GEMMs of a linear layer: forward with an optional output dtype, and weight gradients.

Weight gradients either fill a fresh tensor (:func:`_wgrad_gemm`) or accumulate into
``weight.main_grad`` (:func:`accumulate_wgrad`): apex's ``fused_weight_gradient_mlp_cuda``
kernel when it is importable and the tensors are on CUDA, ``main_grad.addmm_`` otherwise.
Both compute ``main_grad += grad_outputᵀ · input`` with fp32 accumulation, so the numbers
agree up to summation order.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["_grad_accum_fusion_available", "_linear_forward", "_te_gemm_available", "_wgrad_gemm"]


def _import_apex_kernel() -> ModuleType | None:
    try:
        return importlib.import_module("fused_weight_gradient_mlp_cuda")
    except ImportError:
        return None


def _import_te_gemm() -> tuple[Callable[..., Any], Callable[[], torch.Tensor]] | None:
    """Transformer Engine's ``general_gemm`` and its cuBLAS workspace getter, if importable."""
    try:
        gemm_module = importlib.import_module("transformer_engine.pytorch.cpp_extensions")
        base_module = importlib.import_module("transformer_engine.pytorch.module.base")
        return gemm_module.general_gemm, base_module.get_workspace
    except (ImportError, AttributeError):
        return None


_APEX_KERNEL = _import_apex_kernel()
_TE_GEMM = _import_te_gemm()
_te_gemm_available: bool = _TE_GEMM is not None
"""True when Transformer Engine's ``general_gemm`` is importable (used for ``output_dtype``
on CUDA; the exact torch path otherwise)."""
_grad_accum_fusion_available: bool = _APEX_KERNEL is not None
"""True when apex's fused weight-gradient kernel is importable (mc falls back to addmm_)."""

_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}


def _wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if _FLOAT_WIDTH.get(a, 0) >= _FLOAT_WIDTH.get(b, 0) else b


def _linear_forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype | None,
) -> torch.Tensor:
    """``input · weightᵀ + bias``, returned in ``output_dtype`` (default: the input's).

    With an ``output_dtype`` different from the input's: on CUDA with Transformer Engine
    importable, TE's ``general_gemm`` (as Megatron: layout ``TN``, operands in their own
    dtype, fp32 accumulation, output written in ``output_dtype``; the bias is added
    after, in fp32, then rounded); otherwise the torch path: both operands are converted
    to the wider of the two dtypes (exact: every bf16/fp16 value is an fp32 value), the
    GEMM runs there with fp32 accumulation and the result is cast to ``output_dtype``.
    The two differ only in summation order (and, for an output narrower than the input,
    one rounding of the bias add).
    """
    if output_dtype is None or output_dtype == input.dtype:
        return F.linear(input, weight, bias)
    if _TE_GEMM is not None and input.is_cuda:
        return _te_linear_forward(_TE_GEMM, input, weight, bias, output_dtype)
    compute = _wider(input.dtype, output_dtype)
    wide_bias = None if bias is None else bias.to(compute)
    return F.linear(input.to(compute), weight.to(compute), wide_bias).to(output_dtype)


def _te_linear_forward(
    te: tuple[Callable[..., Any], Callable[[], torch.Tensor]],
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """``input · weightᵀ (+ bias)`` by TE's ``general_gemm`` in ``output_dtype``.

    ``general_gemm(A=weight [n, k], B=input [m, k], layout="TN")`` computes ``B · Aᵀ``
    ([m, n]); ``input`` is flattened to 2-D and the leading dims restored after.
    """
    general_gemm, get_workspace = te
    flat = input.reshape(-1, input.shape[-1])
    gemm_out: torch.Tensor = general_gemm(
        weight, flat, get_workspace(), out_dtype=output_dtype, layout="TN"
    )[0]
    out = gemm_out.view(*input.shape[:-1], weight.shape[0])
    if bias is None:
        return out
    return (out.float() + bias.float()).to(output_dtype)


def _wgrad_gemm(
    out: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
) -> torch.Tensor:
    """``out ← grad_outputᵀ · total_input`` (2-D operands); return ``out``.

    ``out`` may be wider than the operands (bf16 in, fp32 out): they are converted to
    ``out.dtype`` first (exact), so the products and the sum are in ``out.dtype``.
    """
    if grad_output.dtype != out.dtype or total_input.dtype != out.dtype:
        grad_output, total_input = grad_output.to(out.dtype), total_input.to(out.dtype)
    torch.mm(grad_output.t(), total_input, out=out)
    return out


def accumulate_wgrad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
) -> None:
    """``main_grad += grad_outputᵀ · total_input`` (apex kernel on CUDA, else ``addmm_``)."""
    if _APEX_KERNEL is not None and main_grad.is_cuda:
        if main_grad.dtype == torch.float32:
            _APEX_KERNEL.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            return
        if main_grad.dtype in (torch.float16, torch.bfloat16):
            _APEX_KERNEL.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
            return
    if grad_output.dtype != main_grad.dtype or total_input.dtype != main_grad.dtype:
        grad_output, total_input = grad_output.to(main_grad.dtype), total_input.to(main_grad.dtype)
    main_grad.addmm_(grad_output.t(), total_input)
