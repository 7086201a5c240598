"""Agreement at construction: the ranks that will reduce gradients together compare how they
built their :class:`~mc_ddp.DistributedDataParallel`, once, before anything is allocated.

Why: every rank of a reduction group must lay its gradients out alike. A ``bucket_size``,
a hidden size or ``grad_reduce_in_fp32`` that differs on one rank gives buckets of other
sizes or dtypes (an abort inside gloo, or every rank waiting until the group's timeout);
``overlap_grad_reduce``, ``use_distributed_optimizer`` or ``check_for_nan_in_grad`` on one
rank only issue other collectives (hang); ``calculate_per_token_loss`` on one rank changes
its pre-scaling, and params registered in another order put other params at the same
offsets: silently wrong gradients, no error at all.

What is compared (each a field of the record; values are short strings):

- ``config.calculate_per_token_loss``, every field of the ``DistributedDataParallelConfig``,
  ``disable_bucketing`` and the resolved bucket size;
- the params, in registration order: name, shape and dtype of each (dense ones over
  ``dp_cp``, expert ones over ``expt_dp``), and the number of expert params (so that the
  ranks of ``dp_cp`` agree on whether an expert exchange follows);
- per buffer: its key (param dtype → grad dtype), buckets, elements (padded and unpadded)
  and a digest of every param's ``(start, end, bucket)``: the layout the collectives use.

Mechanism: :func:`mc_groups.agree` over ``dp_cp``, then, with expert params, over
``expt_dp``: one exchange of an 8-byte fingerprint of the whole record each (not recorded by
:func:`mc_groups.record_collectives`, so the collective counts of a run do not change).
When the fingerprints differ the ranks exchange their records (only then) and every rank
raises the same :class:`DataParallelAgreementError` (an :class:`mc_groups.AgreementError`),
naming each field that differs, its values and the global ranks holding each (for a list,
its first differing entry). Nothing is allocated or changed before. Per step: nothing.
Groups of one rank compare nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping, Sequence
from numbers import Integral

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import FullParamLayout, PerBufferParamLayout
from mc_ddp.config import DistributedDataParallelConfig
from mc_groups import param_attrs

__all__ = ["DataParallelAgreementError"]

Param = torch.nn.Parameter
Record = dict[str, str | tuple[str, ...]]

_MAX_LINES = 12


class DataParallelAgreementError(mg.AgreementError):
    """The ranks of a data-parallel group built their ``DistributedDataParallel``
    differently; raised by every rank of the group, before anything is allocated."""


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _plain(value: object) -> str:
    if isinstance(value, (list, tuple)):
        return repr(tuple(value))
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, Integral):
        return repr(int(value))  # numpy ints and ints alike
    return repr(value)


def _params(named: Sequence[tuple[str, Param]]) -> tuple[str, ...]:
    return tuple(f"'{n}' {tuple(p.shape)} {_dtype(p.dtype)}" for n, p in named)


def _layout(layout: PerBufferParamLayout, names: Mapping[Param, str]) -> str:
    placed = sorted(
        (start, end, bucket, names.get(p, "<unnamed>"))
        for p, (start, end, bucket) in layout.param_index_map.items()
    )
    text = "|".join([repr(layout.bucket_indices), repr(layout.per_bucket_numel_unpadded)])
    text += "|" + repr(placed)
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    return (
        f"{len(layout.bucket_indices)} bucket(s), {layout.numel} elements "
        f"({layout.numel_unpadded} unpadded), layout {digest}"
    )


def build_record(
    *,
    calculate_per_token_loss: bool,
    ddp_config: DistributedDataParallelConfig,
    disable_bucketing: bool,
    bucket_size: int | None,
    named: Sequence[tuple[str, Param]],
    layout: FullParamLayout,
    expert: bool,
    expert_count: int,
) -> Record:
    """What the ranks of one reduction group must agree on (``expert`` selects the buffers
    and params of that kind); see the module notes."""
    record: Record = {"config.calculate_per_token_loss": repr(calculate_per_token_loss)}
    for field in dataclasses.fields(ddp_config):
        record[f"ddp_config.{field.name}"] = _plain(getattr(ddp_config, field.name))
    record["disable_bucketing"] = repr(disable_bucketing)
    record["bucket size (resolved)"] = repr(bucket_size)
    kind = "expert" if expert else "dense"
    names = {p: n for n, p in named}
    members = [(n, p) for n, p in named if param_attrs.is_expert_param(p) == expert]
    record[f"{kind} params"] = _params(members)
    if not expert:
        record["expert params (count)"] = str(expert_count)
    keys = [k for k in layout.layouts if k.is_expert_parallel == expert]
    record[f"{kind} buffers (param dtype -> grad dtype)"] = tuple(
        f"{_dtype(k.param_dtype)} -> {_dtype(k.grad_dtype)}" for k in keys
    )
    record[f"{kind} buffer layouts"] = tuple(_layout(layout.layouts[k], names) for k in keys)
    return record


def agree(group: dist.ProcessGroup, group_name: str, record: Record) -> None:
    """Every rank of ``group`` holds the same ``record``, else every rank raises
    :class:`DataParallelAgreementError` (see the module notes)."""
    try:
        mg.agree(group, f"DistributedDataParallel over {group_name}", record)
    except mg.AgreementError as err:
        raise DataParallelAgreementError(
            _message(group_name, err), err.what, err.group_ranks, err.differences
        ) from None


def _message(group_name: str, err: mg.AgreementError) -> str:
    lines = [f"  {difference.describe()}" for difference in err.differences]
    if len(lines) > _MAX_LINES:
        lines = [*lines[:_MAX_LINES], f"  ... and {len(lines) - _MAX_LINES} more"]
    return "\n".join(
        [
            f"DistributedDataParallel: the ranks {list(err.group_ranks)} of group {group_name} "
            "were built differently, so their gradient collectives would not match (a hang, "
            "an abort inside the backend, or silently wrong gradients); nothing was allocated "
            "and no gradient reduced. Fields that differ:",
            *lines,
            "Build the DistributedDataParallel alike on every rank of the group: the same "
            "config, ddp_config, disable_bucketing and module (the same params, registered "
            "in the same order, with the same shapes and dtypes).",
        ]
    )
