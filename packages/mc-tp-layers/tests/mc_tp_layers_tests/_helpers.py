"""Shared by the test modules: world set-up, slicing and the tolerance rule.

Tolerance: fp32 results are compared with ``rtol = 1e-5`` and ``atol = 1e-5 · max|expected|``
(1e-5 relative to the tensor's scale). TP changes only the order of the sums inside a
GEMM or across ranks; with values of order 1 and reductions over ≤ 64 terms fp32 rounding
stays below 1e-6 relative, so 1e-5 has a 10× margin and still catches a wrong slice or a
missing reduction (errors of order 1).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

import mc_groups as mg
import mc_tp_layers as tpl

RTOL = 1e-5


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str = "") -> None:
    """``actual`` equals ``expected`` within 1e-5 relative to ``expected``'s scale."""
    scale = float(expected.detach().abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(
        actual.detach().float(),
        expected.detach().float(),
        rtol=RTOL,
        atol=RTOL * max(scale, 1e-12),
        msg=lambda m: f"{what}: {m}",
    )


def world(tp: int, **kw: Any) -> mg.ProcessGroupCollection:
    """The groups of a TP = ``tp`` layout on the current world (short timeout)."""
    return mg.initialize_model_parallel(
        tensor_model_parallel_size=tp, timeout=timedelta(seconds=20), **kw
    )


def row_parallel(
    input_size: int, output_size: int, cfg: Any, init: Any, **kw: Any
) -> tpl.RowParallelLinear:
    """A ``RowParallelLinear`` as most tests build it: the input already split, the bias
    added (``bias=True, input_is_parallel=True, skip_bias_add=False`` unless ``kw`` says
    otherwise)."""
    options: dict[str, Any] = {
        "bias": True,
        "input_is_parallel": True,
        "skip_bias_add": False,
        **kw,
    }
    return tpl.RowParallelLinear(input_size, output_size, config=cfg, init_method=init, **options)


def config(tp: int, **kw: Any) -> mg.ModelParallelConfig:
    """A CPU-initialised config for TP = ``tp``."""
    kw.setdefault("use_cpu_initialization", True)
    return mg.ModelParallelConfig(tensor_model_parallel_size=tp, **kw)


def ops(log: list[mg.CollectiveRecord]) -> list[str]:
    """The operation names of a recorder log, in issue order."""
    return [r.op for r in log]


def chunk(t: torch.Tensor, parts: int, index: int, dim: int) -> torch.Tensor:
    """Part ``index`` of ``parts`` equal parts of ``t`` along ``dim`` (a contiguous copy)."""
    return t.chunk(parts, dim=dim)[index].contiguous().clone()


def randn(*shape: int, seed: int) -> torch.Tensor:
    """Deterministic normal values."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def backward(y: torch.Tensor, grad: torch.Tensor) -> None:
    """``y.backward(grad)`` (torch's method is untyped)."""
    y.backward(grad)  # type: ignore[no-untyped-call]


def grad(t: torch.Tensor) -> torch.Tensor:
    """``t.grad``, which must exist (backward reached ``t``)."""
    assert t.grad is not None
    return t.grad


def main_grad(param: torch.Tensor | None) -> torch.Tensor:
    """``param.main_grad`` (an attribute the DDP wrapper or a test attaches)."""
    assert param is not None
    grad = param.main_grad  # type: ignore[attr-defined]
    assert isinstance(grad, torch.Tensor)
    return grad
