"""Grad-buffer memory overhead of the two layouts for GPT-like parameter lists.

Prints, for data-parallel sizes 1, 8 and 64, ``grad-buffer bytes / (params × grad-dtype
bytes)``: what the layout costs over the gradients themselves. The default layout has no
padding (exactly 1.0); the distributed-optimizer layout pads each param start to 64
elements and each bucket end to lcm(dp, 128) (or lcm(dp, 128, 2**16) with
``pad_buckets_for_high_nccl_busbw``) and must stay within 1.01.

Two models: GPT-2 small (hidden 768: every param size is a multiple of 64, so the
distributed-optimizer layout only pads bucket ends) and the same 12-block shape at hidden
1000 / ffn 4000, whose 1000-element norms and biases each cost up to 63 elements of start
padding. The params live on the ``meta`` device, so real ``ParamAndGradBuffer`` objects are built
(their ``grad_data`` has the true numel and dtype) without allocating memory. Bucket size
is Megatron DDP's default, max(40M, 1M·dp) elements. Exits 1 if a bound is violated.

    python benchmarks/buffer_memory.py
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from mc_buffers.build import build_param_and_grad_buffers

VOCAB, SEQ, LAYERS = 50257, 1024, 12
MODELS = {"gpt2-small (h768)": (768, 3072), "odd (h1000)": (1000, 4000)}
DP_SIZES = (1, 8, 64)
DEFAULT_BOUND, DIST_OPT_BOUND = 1.0, 1.01


def _p(*shape: int) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, device="meta", dtype=torch.bfloat16))


def _block(h: int, ffn: int) -> list[torch.nn.Parameter]:
    return [
        _p(h),  # ln1 weight, bias
        _p(h),
        _p(3 * h, h),  # fused qkv
        _p(3 * h),
        _p(h, h),  # attention projection
        _p(h),
        _p(h),  # ln2 weight, bias
        _p(h),
        _p(ffn, h),  # fc1
        _p(ffn),
        _p(h, ffn),  # fc2
        _p(h),
    ]


def gpt_params(hidden: int, ffn: int) -> list[torch.nn.Parameter]:
    """Word and position embeddings, 12 transformer blocks, final norm, untied LM head."""
    params = [_p(VOCAB, hidden), _p(SEQ, hidden)]
    for _ in range(LAYERS):
        params += _block(hidden, ffn)
    return [*params, _p(hidden), _p(hidden), _p(VOCAB, hidden)]


@dataclass(frozen=True)
class Row:
    """One measured configuration."""

    model: str
    params: int
    layout: str
    dp: int
    buckets: int
    padding_elements: int
    ratio: float
    bound: float | None


def measure(model: str, layout: str, dp: int) -> Row:
    """Build ``model``'s buffers for ``layout`` at data-parallel size ``dp``; measure them."""
    params = gpt_params(*MODELS[model])
    buffers = build_param_and_grad_buffers(
        params,
        bucket_size=max(40_000_000, 1_000_000 * dp),
        data_parallel_size=dp,
        use_distributed_optimizer=layout != "default",
        grad_reduce_in_fp32=True,
        pad_buckets_for_high_nccl_busbw=layout == "dist-opt + busbw",
    )
    numel = sum(p.numel() for p in params)
    grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers.values())
    ideal = numel * torch.finfo(torch.float32).bits // 8
    bound = {"default": DEFAULT_BOUND, "dist-opt": DIST_OPT_BOUND}.get(layout)
    return Row(
        model=model,
        params=numel,
        layout=layout,
        dp=dp,
        buckets=sum(len(b.buckets) for b in buffers.values()),
        padding_elements=sum(b.grad_data.numel() for b in buffers.values()) - numel,
        ratio=grad_bytes / ideal,
        bound=bound,
    )


def _violates(row: Row) -> bool:
    if row.bound is None:
        return False
    return row.ratio != 1.0 if row.bound == DEFAULT_BOUND else row.ratio > row.bound


def _format(row: Row) -> str:
    if row.bound is None:
        bound = "(info)"
    else:
        bound = f"== {row.bound}" if row.bound == DEFAULT_BOUND else f"<= {row.bound}"
    return (
        f"| {row.model} | {row.params:,} | {row.layout} | {row.dp} | {row.buckets} "
        f"| {row.padding_elements:,} | {row.ratio:.6f} | {bound} |"
    )


def main() -> int:
    """Print the table; return 1 when a row breaks its bound."""
    print("bf16 params, fp32 grad buffers, bucket_size = max(40M, 1M·dp) elements")
    print(
        "| model | params | layout | dp | buckets | padding (elements) "
        "| grad bytes / (params × 4) | bound |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---|")
    rows = [
        measure(model, layout, dp)
        for model in MODELS
        for layout in ("default", "dist-opt", "dist-opt + busbw")
        for dp in DP_SIZES
    ]
    for row in rows:
        print(_format(row))
    bad = [row for row in rows if _violates(row)]
    for row in bad:
        print(f"BOUND VIOLATED: {row}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
