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

Mechanism: one exchange of an 8-byte fingerprint (BLAKE2b of the whole record) over
``dp_cp``, then, with expert params, one over ``expt_dp``; through
:func:`mc_groups.schedule_check.verify_schedule` (point to point on its own tag on gloo,
one all-gather elsewhere; not recorded by :func:`mc_groups.record_collectives`, so the
collective counts of a run do not change). When the fingerprints differ the ranks exchange
their records (:func:`mc_groups.all_gather_objects`, only then) and every rank raises the
same :class:`DataParallelAgreementError`, naming each field that differs, its values and the
global ranks holding each. Nothing is allocated or changed before. Per step: nothing.
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
from mc_groups.errors import InputValueError
from mc_groups.schedule_check import PlannedCollective, verify_schedule

__all__ = ["DataParallelAgreementError"]

Param = torch.nn.Parameter
Record = dict[str, str | tuple[str, ...]]

_KIND = "ddp agreement"
_MAX_LINES = 12


class DataParallelAgreementError(InputValueError):
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


def _fingerprint(record: Record) -> str:
    text = "\n".join(f"{name}={value!r}" for name, value in record.items())
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _exchange_device(group: dist.ProcessGroup) -> torch.device:
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(group: dist.ProcessGroup, group_name: str, record: Record) -> None:
    """Every rank of ``group`` holds the same ``record``, else every rank raises
    :class:`DataParallelAgreementError` (see the module notes)."""
    if mg.group_size(group) == 1:
        return
    planned = PlannedCollective(
        kind=_KIND, payload=f"{len(record)} fields", label=group_name, detail=_fingerprint(record)
    )
    try:
        verify_schedule(group, planned, _exchange_device(group))
    except mg.CollectiveScheduleError as err:
        variants = [line for line in str(err).splitlines() if line.startswith("  rank(s) ")]
        if not all(f"{_KIND} '{group_name}'" in line for line in variants):
            raise  # a peer was about to run another collective: its error says which
        records = mg.all_gather_objects(record, group, label=f"{_KIND} {group_name} values")
        ranks = list(mg.group_ranks(group))
        raise DataParallelAgreementError(_message(group_name, ranks, records)) from None


def _by_value(values: Sequence[tuple[str, int]]) -> str:
    merged: dict[str, list[int]] = {}
    for value, rank in values:
        merged.setdefault(value, []).append(rank)
    return "; ".join(f"{value} on rank(s) {ranks}" for value, ranks in merged.items())


def _difference(name: str, values: Sequence[tuple[object, int]]) -> str | None:
    shown = [(v if isinstance(v, (str, tuple)) else repr(v), r) for v, r in values]
    if len({v for v, _ in shown}) == 1:
        return None
    if not all(isinstance(v, tuple) for v, _ in shown):
        return f"{name}: {_by_value([(str(v), r) for v, r in shown])}"
    rows = [(v, r) for v, r in shown if isinstance(v, tuple)]
    lengths = {len(v) for v, _ in rows}
    if len(lengths) > 1:
        return f"{name}: {_by_value([(f'{len(v)} entries', r) for v, r in rows])}"
    index = next(i for i in range(len(rows[0][0])) if len({v[i] for v, _ in rows}) > 1)
    return f"{name}, entry #{index}: {_by_value([(v[index], r) for v, r in rows])}"


def _message(group_name: str, ranks: list[int], records: list[object]) -> str:
    typed = [r if isinstance(r, dict) else {} for r in records]
    names: list[str] = []
    for record in typed:
        names += [n for n in record if n not in names]
    lines = []
    for name in names:
        values = [(record.get(name, "(absent)"), ranks[i]) for i, record in enumerate(typed)]
        line = _difference(name, values)
        if line is not None:
            lines.append(f"  {line}")
    if len(lines) > _MAX_LINES:
        lines = [*lines[:_MAX_LINES], f"  ... and {len(lines) - _MAX_LINES} more"]
    return "\n".join(
        [
            f"DistributedDataParallel: the ranks {ranks} of group {group_name} were built "
            "differently, so their gradient collectives would not match (a hang, an abort "
            "inside the backend, or silently wrong gradients); nothing was allocated and no "
            "gradient reduced. Fields that differ:",
            *lines,
            "Build the DistributedDataParallel alike on every rank of the group: the same "
            "config, ddp_config, disable_bucketing and module (the same params, registered "
            "in the same order, with the same shapes and dtypes).",
        ]
    )
