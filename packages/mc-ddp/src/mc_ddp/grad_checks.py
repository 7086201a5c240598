"""Gradient checks a bucket group runs before its collective (never after: a NaN reduced
over data-parallel ranks poisons every replica and hides which rank produced it).

The non-finite check is agreed on: a rank that finds NaN/Inf and raises alone would leave
its peers blocked in the bucket collective until the group's timeout (then failing with a
"connection closed" far from the cause). With ``groups`` every rank first shares its local
finding (rank, kind, bucket, first bad param) through one small all-gather per group, and
every rank raises the same :class:`NonFiniteGradError` naming each offending rank, bucket
and param, before any gradient is reduced.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers.buffer import ParamAndGradBucket
from mc_groups.argcheck import check_group, check_int, check_str, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["LargeGradMonitor", "NonFiniteGradError", "check_finite_grads"]

LARGE_GRAD_FACTOR = 10.0
"""A bucket norm above this multiple of the bucket's earlier maximum draws a warning."""

_KINDS = ("finite", "NaN", "Inf")
_NO_PARAM = -1


class NonFiniteGradError(RuntimeError):
    """A bucket held NaN or Inf before its data-parallel collective."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _first_bad_param(bucket: ParamAndGradBucket) -> int:
    """Index in ``bucket.params_list`` of the first param holding NaN/Inf (-1: padding)."""
    for index, param in enumerate(bucket.params_list):
        start, end = bucket.param_to_index[param]
        if not torch.isfinite(bucket.grad_data[start:end]).all():
            return index
    return _NO_PARAM


def _local_finding(buckets: Sequence[ParamAndGradBucket]) -> list[int]:
    """``[rank, kind, bucket position, param index]``; kind 0 when every grad is finite."""
    for position, bucket in enumerate(buckets):
        if torch.isfinite(bucket.grad_data).all():
            continue
        kind = 1 if torch.isnan(bucket.grad_data).any() else 2
        return [_rank(), kind, position, _first_bad_param(bucket)]
    return [_rank(), 0, 0, _NO_PARAM]


def _describe_param(
    buckets: Sequence[ParamAndGradBucket],
    position: int,
    index: int,
    names: Mapping[torch.nn.Parameter, str],
) -> str:
    if index == _NO_PARAM:
        return "padding between params (no param)"
    if not (0 <= position < len(buckets) and 0 <= index < len(buckets[position].params_list)):
        return f"#{index} of bucket position {position} (not in this rank's buckets)"
    param = buckets[position].params_list[index]
    return f"'{names.get(param, '<unnamed>')}' (shape {tuple(param.shape)})"


def _bucket_id(buckets: Sequence[ParamAndGradBucket], position: int) -> str:
    return str(buckets[position].bucket_id) if 0 <= position < len(buckets) else f"#{position}"


def _share(
    finding: list[int],
    groups: Sequence[dist.ProcessGroup],
    where: str,
    device: torch.device,
) -> list[list[int]]:
    """Every rank's finding, through one all-gather per group (each rank of a later group
    contributes everything its earlier groups gathered)."""
    table = torch.tensor([finding], dtype=torch.int64, device=device)
    for group in groups:
        shape = (mg.group_size(group), *table.shape)
        gathered = torch.empty(shape, dtype=torch.int64, device=device)
        mg.all_gather(gathered.view(-1), table.view(-1), group, label=f"non-finite check {where}")
        table = gathered.view(-1, len(finding))
    return [[int(v) for v in row] for row in table.tolist()]


def check_finite_grads(
    buckets: Sequence[ParamAndGradBucket],
    names: Mapping[torch.nn.Parameter, str],
    where: str,
    *,
    groups: Sequence[dist.ProcessGroup] = (),
) -> None:
    """Raise :class:`NonFiniteGradError` when a bucket's ``grad_data`` holds NaN or Inf.

    Without ``groups``: only the rank that found it raises, naming itself, the bucket and
    the first bad param (in bucket order). With ``groups`` (the reduction group, then the
    inter-instance group if any): one all-gather of 4 int64 per rank and group (label
    ``"non-finite check <where>"``) first, then every rank raises, naming every offending
    rank with its bucket and param (param names are read from this rank's own buckets: the
    replicas hold the same params).
    """
    _check_arguments(buckets, names, where, groups)
    finding = _local_finding(buckets)
    if not groups:
        if finding[1]:
            raise NonFiniteGradError(_own_text(finding, buckets, names, where))
        return
    device = buckets[0].grad_data.device
    bad = [row for row in _share(finding, groups, where, device) if row[1]]
    if not bad:
        return
    summary = "; ".join(
        f"rank {r}: {_KINDS[k]} in bucket {_bucket_id(buckets, b)}, first bad param "
        f"{_describe_param(buckets, b, i, names)}"
        for r, k, b, i in sorted(bad)
    )
    tail = (
        f"non-finite local gradients on rank(s) {sorted(row[0] for row in bad)}: {summary}. "
        "Every data-parallel rank of this bucket group raises this error; nothing was reduced"
    )
    if finding[1]:
        raise NonFiniteGradError(f"{_own_text(finding, buckets, names, where)}; {tail}")
    raise NonFiniteGradError(f"rank {finding[0]}: {where} was not reduced: {tail}")


def check_buckets(buckets: object) -> list[ParamAndGradBucket]:
    """A non-empty sequence of :class:`~mc_buffers.buffer.ParamAndGradBucket` (a bucket group's, or
    the checks'), as a list."""
    if isinstance(buckets, str) or not isinstance(buckets, Sequence) or not buckets:
        raise InputTypeError(
            f"buckets must be a non-empty sequence of ParamAndGradBucket, got {buckets!r}"
        )
    for i, bucket in enumerate(buckets):
        if not isinstance(bucket, ParamAndGradBucket):
            raise InputTypeError(f"buckets[{i}] is a {type_name(bucket)}, not a ParamAndGradBucket")
    return list(buckets)


def _check_arguments(buckets: object, names: object, where: object, groups: object) -> None:
    checked = check_buckets(buckets)
    if not isinstance(names, Mapping):
        raise InputTypeError(f"names must map params to names, got {type_name(names)}")
    check_str("where", where)
    if isinstance(groups, (str, dist.ProcessGroup)) or not isinstance(groups, Sequence):
        raise InputTypeError(f"groups={groups!r} must be a sequence of process groups")
    for i, group in enumerate(groups):
        check_group(f"groups[{i}]", group)
    offloaded = [b.bucket_id for b in checked if b.is_grad_data_offloaded]
    if offloaded:
        raise RuntimeError(
            f"check_finite_grads: the grad buffer of bucket(s) {offloaded} is offloaded; "
            "restore it (ddp.restore_grad_buffers()) first"
        )


def _own_text(
    finding: list[int],
    buckets: Sequence[ParamAndGradBucket],
    names: Mapping[torch.nn.Parameter, str],
    where: str,
) -> str:
    rank, kind, position, index = finding
    return (
        f"rank {rank}: {_KINDS[kind]} in the local gradients of {where}, bucket "
        f"{buckets[position].bucket_id}, before the data-parallel collective; first bad "
        f"param: {_describe_param(buckets, position, index, names)}"
    )


class LargeGradMonitor:
    """Warns when a bucket's local grad norm exceeds ``LARGE_GRAD_FACTOR`` × the largest
    norm that bucket had in earlier checks (the first check only records)."""

    def __init__(self, num_buckets: int) -> None:
        self._largest: list[float | None] = [None] * check_int("num_buckets", num_buckets)

    def check(self, buckets: Sequence[ParamAndGradBucket], where: str) -> None:
        """Compare each bucket's norm with its history, warn, then record it."""
        given: object = buckets  # a caller may pass anything
        if isinstance(given, str) or not isinstance(given, Sequence):
            raise InputTypeError(f"buckets={given!r} must be a sequence of ParamAndGradBucket")
        if len(given) != len(self._largest) or not all(
            isinstance(b, ParamAndGradBucket) for b in given
        ):
            raise InputValueError(
                f"LargeGradMonitor.check: buckets must be the {len(self._largest)} "
                f"ParamAndGradBucket(s) it was built for, got {buckets!r}"
            )
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
