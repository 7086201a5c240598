r"""``colwise_rmsnorm``: an RMS norm over a width that a ``colwise`` layer split over TP.

OLMo-2 normalises q and k over all heads (``q_norm``: ``RMSNorm(heads × head_dim)``) right
after ``q_proj`` / ``k_proj``. With those projections ``colwise``, rank r holds
``x_r = x[..., r·n/W : (r+1)·n/W]``; the mean square of the whole row is the TP sum of the
parts' sums of squares::

    ms  = (Σ_r Σ_j x_r,j²) / n                 forward: one all-reduce of [..., 1] (fp32)
    y_r = (w_r · x_r · rsqrt(ms + eps)).to(x.dtype)

Backward: each rank's grad of ``ms`` holds only its own heads' part; the true grad is their
sum, one all-reduce of ``[..., 1]`` (``reduce_from`` then ``copy_to``: forward all-reduce,
backward all-reduce). The weight part's grad is complete on its rank (no finalize sum).
"""

from __future__ import annotations

import copy

import torch

from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_groups.param_attrs import set_tensor_model_parallel_attributes
from mc_tp_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from mc_tp_layers.tp_plan._layers import ConvertedModule, Setup, _fill

__all__: list[str] = []

_EPS_NAMES = ("variance_epsilon", "eps")


def check_rmsnorm(label: str, module: torch.nn.Module, world: int) -> None:
    """Refuse ``module`` unless it is an RMS norm mc can split: one 1-D ``weight``, an
    ``eps``, a width divisible by ``world``, and ``weight · x / sqrt(mean(x²) + eps)`` on a
    random input (a CPU copy with random weights; no communication, the global RNG
    untouched)."""
    params = dict(module.named_parameters())
    weight = params.get("weight")
    if weight is None or weight.dim() != 1 or len(params) != 1:
        raise InputTypeError(
            f"{label}: colwise_rmsnorm converts an RMS norm with one 1-D weight, but this "
            f"{type_name(module)} has parameters {sorted(params)}; keep the module replicated"
        )
    eps = _eps(module)
    if eps is None:
        raise InputTypeError(
            f"{label}: colwise_rmsnorm reads the norm's epsilon from one of {_EPS_NAMES}, "
            f"which this {type_name(module)} lacks; keep the module replicated"
        )
    width = weight.numel()
    if width % world:
        raise InputValueError(
            f"{label}: the norm's width {width} is not divisible by the TP size {world}; "
            "choose a TP size that divides it"
        )
    generator = torch.Generator().manual_seed(0)
    probe = copy.deepcopy(module).to_empty(device="cpu").float()
    x = torch.randn(3, width, generator=generator)
    with torch.no_grad():
        probe.get_parameter("weight").copy_(torch.randn(width, generator=generator))
        got = probe(x)
        squares = x.pow(2).sum(-1, keepdim=True)
        want = _normalise(x, probe.get_parameter("weight"), eps, squares, width)
    if not isinstance(got, torch.Tensor) or not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
        raise InputValueError(
            f"{label}: this {type_name(module)} does not compute weight · x / sqrt(mean(x²) "
            f"+ eps) (eps={eps}) on a random input (a (1 + weight) scale or a different "
            "formula?), which colwise_rmsnorm would replace it with; keep the projections "
            "'colwise_gather_output' and the norm replicated"
        )


def _eps(module: torch.nn.Module) -> float | None:
    for name in _EPS_NAMES:
        value = getattr(module, name, None)
        if isinstance(value, float) and not isinstance(value, bool):
            return value
    return None


def _normalise(
    x: torch.Tensor, weight: torch.Tensor, eps: float, sum_of_squares: torch.Tensor, width: int
) -> torch.Tensor:
    """``weight · x · rsqrt(sum_of_squares / width + eps)`` in fp32, cast back to ``x``'s
    dtype (OLMo-2's order: the weight multiplies in fp32)."""
    hidden = x.float()
    hidden = hidden * torch.rsqrt(sum_of_squares / width + eps)
    return (weight * hidden).to(x.dtype)


class ColwiseRMSNormLayer(ConvertedModule):
    """Rank r's part of an RMS norm whose input is a ``colwise`` layer's split output."""

    def __init__(self, source: torch.nn.Module, setup: Setup, name: str) -> None:
        super().__init__()
        weight = source.get_parameter("weight")
        self.tp_group = setup.tp_group
        self.qualified_name = name
        self.width = weight.numel()
        eps = _eps(source)
        assert eps is not None  # checked before any change
        self.eps = eps
        world = int(self.tp_group.size())
        self.weight = torch.nn.Parameter(
            torch.empty(self.width // world, dtype=weight.dtype, device=weight.device)
        )
        # part r of the weight: the channels the ``colwise`` layer before it keeps
        set_tensor_model_parallel_attributes(self.weight, True, 0, 1)
        _fill(self.weight, weight, weight.requires_grad, self.tp_group)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., n/W]`` normalised by the whole row's mean square (one all-reduce)."""
        if hidden_states.shape[-1] != self.weight.numel():
            raise InputValueError(
                f"{self.qualified_name} (colwise_rmsnorm) got [..., {hidden_states.shape[-1]}]"
                f" but holds {self.weight.numel()} of {self.width} channels: its input must "
                "be the split output of a 'colwise' layer of the same width"
            )
        local = hidden_states.float().pow(2).sum(-1, keepdim=True)
        total = reduce_from_tensor_model_parallel_region(local, self.tp_group)
        total = copy_to_tensor_model_parallel_region(total, self.tp_group)
        return _normalise(hidden_states, self.weight, self.eps, total, self.width)

    def extra_repr(self) -> str:
        return f"{self.weight.numel()} of {self.width}, eps={self.eps}"
