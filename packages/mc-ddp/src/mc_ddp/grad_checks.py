"""Gradient checks a bucket group runs before its collective (never after: a NaN reduced
over data-parallel ranks poisons every replica and hides which rank produced it)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from mc_buffers import ParamAndGradBucket

__all__ = ["LargeGradMonitor", "NonFiniteGradError", "check_finite_grads"]

LARGE_GRAD_FACTOR = 10.0
"""A bucket norm above this multiple of the bucket's earlier maximum draws a warning."""


class NonFiniteGradError(RuntimeError):
    """A bucket held NaN or Inf before its data-parallel collective."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _first_bad_param(bucket: ParamAndGradBucket) -> torch.nn.Parameter | None:
    for param in bucket.params_list:
        start, end = bucket.param_to_index[param]
        if not torch.isfinite(bucket.grad_data[start:end]).all():
            return param
    return None


def _describe(param: torch.nn.Parameter | None, names: Mapping[torch.nn.Parameter, str]) -> str:
    if param is None:
        return "padding between params (no param)"
    return f"'{names.get(param, '<unnamed>')}' (shape {tuple(param.shape)})"


def check_finite_grads(
    buckets: Sequence[ParamAndGradBucket],
    names: Mapping[torch.nn.Parameter, str],
    where: str,
) -> None:
    """Raise :class:`NonFiniteGradError` naming the rank, the bucket and the first bad
    param (in bucket order) when any bucket's ``grad_data`` holds NaN or Inf."""
    for bucket in buckets:
        if torch.isfinite(bucket.grad_data).all():
            continue
        kind = "NaN" if torch.isnan(bucket.grad_data).any() else "Inf"
        bad = _describe(_first_bad_param(bucket), names)
        raise NonFiniteGradError(
            f"rank {_rank()}: {kind} in the local gradients of {where}, bucket "
            f"{bucket.bucket_id}, before the data-parallel collective; first bad param: {bad}"
        )


class LargeGradMonitor:
    """Warns when a bucket's local grad norm exceeds ``LARGE_GRAD_FACTOR`` × the largest
    norm that bucket had in earlier checks (the first check only records)."""

    def __init__(self, num_buckets: int) -> None:
        self._largest: list[float | None] = [None] * num_buckets

    def check(self, buckets: Sequence[ParamAndGradBucket], where: str) -> None:
        """Compare each bucket's norm with its history, warn, then record it."""
        for i, bucket in enumerate(buckets):
            norm = float(bucket.grad_data.float().norm())
            largest = self._largest[i]
            if largest is not None and largest > 0 and norm > LARGE_GRAD_FACTOR * largest:
                warnings.warn(
                    f"rank {_rank()}: unexpectedly large gradients in {where}, bucket "
                    f"{bucket.bucket_id}: norm {norm:.4g} > {LARGE_GRAD_FACTOR:g} × the "
                    f"largest earlier norm {largest:.4g}",
                    RuntimeWarning,
                    stacklevel=3,
                )
            self._largest[i] = norm if largest is None else max(largest, norm)
