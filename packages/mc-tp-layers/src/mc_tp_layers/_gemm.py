"""The GEMMs of a linear layer: forward with an optional output dtype, and weight gradients.

Weight gradients either fill a fresh tensor (:func:`_wgrad_gemm`) or accumulate into
``weight.main_grad`` (:func:`accumulate_wgrad`): apex's ``fused_weight_gradient_mlp_cuda``
kernel when it is importable and the tensors are on CUDA; on CUDA without apex, torch's
mixed-dtype GEMM (bf16/fp16 operands on the tensor cores, fp32 accumulation and output:
``torch.addmm(main_grad, ..., out_dtype=torch.float32, out=main_grad)`` in place, or on
torch versions that refuse an fp32 accumulator there, ``torch.mm(..., out_dtype=...)``
then an add); ``main_grad.addmm_`` on operands widened to ``main_grad``'s dtype otherwise
(exact, but an fp32 GEMM: on a GPU many times slower than the tensor-core one). All
compute ``main_grad += grad_outputᵀ · input`` with fp32 accumulation, so the numbers agree
up to summation order.

Optional kernels (:func:`backends` reports which are active): Transformer Engine's
``general_gemm`` for ``output_dtype`` and apex's fused weight-gradient kernel. Both are
probed once, at import; any failure to import (ImportError when absent, OSError when CUDA
libraries are missing, RuntimeError from TE's meta package without a framework build)
means "not available", never a failed import of mc. A TE whose ``general_gemm`` does not
accept mc's call (an older or newer API) is not used: mc warns once, naming the versions it
supports (:data:`TE_SUPPORTED_VERSIONS`), and keeps the torch path.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
import warnings
from collections.abc import Callable
from types import ModuleType
from typing import Any, Literal

import torch
import torch.nn.functional as F

__all__ = ["TE_SUPPORTED_VERSIONS", "accumulate_wgrad", "backends"]

TE_SUPPORTED_VERSIONS = ">=2.20.2,<2.21"
"""The Transformer Engine releases mc's TE path is tested against: the bound of the ``te``
extra of mc-tp-layers (``pip install "mc-tp-layers[te]"``), and the release whose
``general_gemm`` signature the CPU tests check."""

TEGemm = Callable[..., Any]
"""Transformer Engine's ``general_gemm`` (or a stand-in with its signature)."""

_TE_GEMM_MODULE = "transformer_engine.pytorch.cpp_extensions"
_APEX_MODULE = "fused_weight_gradient_mlp_cuda"


def _import_optional(name: str, import_module: Callable[[str], ModuleType]) -> ModuleType | None:
    """``name`` imported, or None on any failure: an optional CUDA extension that cannot
    load (absent, CUDA libraries missing, a meta package without its build) is absent."""
    try:
        return import_module(name)
    except Exception:
        return None


def _te_call(
    weight: torch.Tensor, input_2d: torch.Tensor, out_dtype: torch.dtype
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional and keyword arguments of mc's one call to TE's ``general_gemm``:
    ``A = weight [n, k]``, ``B = input [m, k]``, layout ``TN`` (``out = B · Aᵀ``),
    written in ``out_dtype``; every other parameter at TE's default (no workspace: TE 2.x
    allocates its cuBLAS workspace itself)."""
    return (weight, input_2d), {"out_dtype": out_dtype, "layout": "TN"}


def _te_gemm_signature_problem(general_gemm: object) -> str | None:
    """None when ``general_gemm`` accepts mc's call (:func:`_te_call`), else why not.

    Binds the call against the signature (no kernel runs), so a parameter that became
    required (TE 1.x/early 2.x's ``workspace``) or a renamed keyword is caught before the
    first forward, not as a TypeError inside it.
    """
    if not callable(general_gemm):
        return "it has no general_gemm function"
    try:
        signature = inspect.signature(general_gemm)
    except (TypeError, ValueError) as err:
        return f"the signature of general_gemm cannot be read ({err})"
    probe = torch.empty(0)
    args, kwargs = _te_call(probe, probe, torch.float32)
    try:
        signature.bind(*args, **kwargs)
    except TypeError as err:
        return (
            f"general_gemm{signature} does not accept mc's call "
            f"general_gemm(A, B, out_dtype=..., layout='TN'): {err}"
        )
    return None


def _te_version() -> str:
    for dist_name in ("transformer-engine", "transformer_engine"):
        try:
            return importlib.metadata.version(dist_name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def _load_te_gemm(
    import_module: Callable[[str], ModuleType] = importlib.import_module,
) -> TEGemm | None:
    """TE's ``general_gemm`` when TE imports and its API is one mc supports; else None
    (with a warning when TE imported but its API is not supported: the module probes once,
    at import, so a process sees it once)."""
    module = _import_optional(_TE_GEMM_MODULE, import_module)
    if module is None:
        return None
    general_gemm = getattr(module, "general_gemm", None)
    problem = _te_gemm_signature_problem(general_gemm)
    if problem is None:
        return general_gemm
    warnings.warn(
        f"Transformer Engine {_te_version()} is installed but not used by mc_tp_layers: "
        f"{problem}. mc supports transformer-engine{TE_SUPPORTED_VERSIONS} "
        '(pip install "mc-tp-layers[te]"); output_dtype falls back to the exact torch path.',
        RuntimeWarning,
        stacklevel=2,
    )
    return None


_APEX_KERNEL = _import_optional(_APEX_MODULE, importlib.import_module)
_TE_GEMM = _load_te_gemm()
_te_gemm_available: bool = _TE_GEMM is not None
"""True when Transformer Engine's ``general_gemm`` is importable and has the supported API
(used for ``output_dtype`` on CUDA; the exact torch path otherwise)."""
_grad_accum_fusion_available: bool = _APEX_KERNEL is not None
"""True when apex's fused weight-gradient kernel is importable (mc falls back to a torch
GEMM accumulating into main_grad)."""


def backends() -> dict[str, bool]:
    """Which optional kernels this process uses (probed once, at import).

    - ``"transformer_engine_gemm"``: TE's ``general_gemm`` computes linear layers with an
      ``output_dtype`` different from the input's on CUDA. False when TE is not installed,
      cannot load (no CUDA libraries) or has an API mc does not support (a warning at
      import says which versions are: :data:`TE_SUPPORTED_VERSIONS`).
    - ``"apex_fused_wgrad"``: apex's ``fused_weight_gradient_mlp_cuda`` accumulates weight
      gradients into ``main_grad`` on CUDA (``gradient_accumulation_fusion``). False when
      apex was not built with ``--cuda_ext``; mc then uses a torch GEMM, same numbers up to
      summation order.

    Either False changes speed, never results beyond summation order: the fallbacks are
    tested against the same references.
    """
    return {
        "transformer_engine_gemm": _TE_GEMM is not None,
        "apex_fused_wgrad": _APEX_KERNEL is not None,
    }


_FLOAT_WIDTH = {torch.float16: 1, torch.bfloat16: 1, torch.float32: 2, torch.float64: 3}
_HALF = (torch.float16, torch.bfloat16)
MixedGemm = Literal["addmm", "mm", "none"]
"""How torch multiplies bf16/fp16 operands into fp32 on a device: ``"addmm"``, accumulating
in place (``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``, newer torch);
``"mm"``, into a fresh fp32 tensor (``torch.mm(a, b, out_dtype=torch.float32)``; torch
versions whose ``addmm`` wants the accumulator in the operands' dtype); ``"none"``, not at
all (CPU; torch before 2.8)."""


def _wider(a: torch.dtype, b: torch.dtype) -> torch.dtype:
    return a if _FLOAT_WIDTH.get(a, 0) >= _FLOAT_WIDTH.get(b, 0) else b


@functools.cache
def _probe_mixed_gemm(device: torch.device) -> MixedGemm:
    """One 1×1 GEMM per device and process (memoised: a fact of torch and the device)."""
    one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
    acc = torch.zeros(1, 1, dtype=torch.float32, device=device)
    try:
        torch.addmm(acc, one, one, out_dtype=torch.float32, out=acc)
        return "addmm"
    except (RuntimeError, TypeError):
        pass
    try:
        torch.mm(one, one, out_dtype=torch.float32)
        return "mm"
    except (RuntimeError, TypeError):
        return "none"


def _mixed_gemm(device: torch.device) -> MixedGemm:
    """Which mixed-dtype GEMM torch runs on ``device`` (probed once per device with a 1×1
    GEMM; CPU has none: its kernels take one dtype)."""
    if device.type != "cuda":
        return "none"
    return _probe_mixed_gemm(device)


def _mixed_operands(out_dtype: torch.dtype, a: torch.Tensor, b: torch.Tensor) -> MixedGemm:
    """The mixed GEMM for fp16/bf16 operands of one dtype into fp32, else ``"none"``."""
    if out_dtype != torch.float32 or a.dtype not in _HALF or b.dtype != a.dtype:
        return "none"
    return _mixed_gemm(a.device)


def _linear_forward(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype | None,
) -> torch.Tensor:
    """``input · weightᵀ + bias``, returned in ``output_dtype`` (default: the input's).

    With an ``output_dtype`` different from the input's: on CUDA with Transformer Engine
    available (:func:`backends`), TE's ``general_gemm`` (as Megatron: layout ``TN``,
    operands in their own dtype, fp32 accumulation, output written in ``output_dtype``;
    the bias is added after, in fp32, then rounded); otherwise the torch path: both
    operands are converted to the wider of the two dtypes (exact: every bf16/fp16 value is
    an fp32 value), the GEMM runs there with fp32 accumulation and the result is cast to
    ``output_dtype``. The two differ only in summation order (and, for an output narrower
    than the input, one rounding of the bias add).
    """
    if output_dtype is None or output_dtype == input.dtype:
        return F.linear(input, weight, bias)
    if _TE_GEMM is not None and input.is_cuda:
        return _te_linear_forward(_TE_GEMM, input, weight, bias, output_dtype)
    compute = _wider(input.dtype, output_dtype)
    wide_bias = None if bias is None else bias.to(compute)
    return F.linear(input.to(compute), weight.to(compute), wide_bias).to(output_dtype)


def _te_linear_forward(
    general_gemm: TEGemm,
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    output_dtype: torch.dtype,
) -> torch.Tensor:
    """``input · weightᵀ (+ bias)`` by TE's ``general_gemm`` in ``output_dtype``.

    ``general_gemm(A=weight [n, k], B=input [m, k], layout="TN")`` computes ``B · Aᵀ``
    ([m, n]) and returns a tuple whose first element is the output; ``input`` is flattened
    to 2-D and the leading dims restored after. The bias is added here in fp32 (TE's
    epilogue would need a bias of the output dtype).
    """
    flat = input.reshape(-1, input.shape[-1])
    args, kwargs = _te_call(weight, flat, output_dtype)
    gemm_out: torch.Tensor = general_gemm(*args, **kwargs)[0]
    out = gemm_out.view(*input.shape[:-1], weight.shape[0])
    if bias is None:
        return out
    return (out.float() + bias.float()).to(output_dtype)


def _wgrad_gemm(
    out: torch.Tensor | None, grad_output: torch.Tensor, total_input: torch.Tensor
) -> torch.Tensor:
    """``out ← grad_outputᵀ · total_input`` (2-D operands); return ``out``. ``out`` None:
    into a new tensor (operands of one dtype; no output allocated before the GEMM).

    ``out`` may be wider than the operands (bf16 in, fp32 out): on CUDA torch's
    mixed-dtype GEMM writes fp32 from bf16 operands; elsewhere they are converted to
    ``out.dtype`` first (exact), so the products and the sum are in ``out.dtype``.
    """
    if out is None:
        return grad_output.t().mm(total_input)
    if grad_output.dtype == out.dtype and total_input.dtype == out.dtype:
        return torch.mm(grad_output.t(), total_input, out=out)
    if _mixed_operands(out.dtype, grad_output, total_input) != "none":
        return torch.mm(grad_output.t(), total_input, out_dtype=out.dtype, out=out)
    grad_output, total_input = grad_output.to(out.dtype), total_input.to(out.dtype)
    return torch.mm(grad_output.t(), total_input, out=out)


def accumulate_wgrad(
    main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
) -> None:
    """``main_grad += grad_outputᵀ · total_input`` (apex kernel on CUDA when built; else
    torch's mixed-dtype ``addmm`` on CUDA; else ``addmm_`` on widened operands; while
    ``torch.compile`` traces, ``addmm_`` on widened operands, which Inductor compiles)."""
    if torch.compiler.is_compiling():
        main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))
        return
    if _APEX_KERNEL is not None and main_grad.is_cuda:
        if main_grad.dtype == torch.float32:
            _APEX_KERNEL.wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)
            return
        if main_grad.dtype in _HALF:
            _APEX_KERNEL.wgrad_gemm_accum_fp16(total_input, grad_output, main_grad)
            return
    if grad_output.dtype == main_grad.dtype and total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
        return
    mixed = _mixed_operands(main_grad.dtype, grad_output, total_input)
    if mixed == "addmm":
        torch.addmm(
            main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad
        )
        return
    if mixed == "mm":
        main_grad.add_(torch.mm(grad_output.t(), total_input, out_dtype=main_grad.dtype))
        return
    main_grad.addmm_(grad_output.t().to(main_grad.dtype), total_input.to(main_grad.dtype))
