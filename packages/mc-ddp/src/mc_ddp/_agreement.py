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
  and a digest of every param's ``(start, end, bucket)``: the layout the collectives use;
- the params' **values** (a checksum of each param's bits): a param whose values differ
  across the ranks that average its gradient would train each replica away from the
  others with no error. The common case is an expert weight left untagged: its shards
  differ across the expert-parallel ranks, and untagged it counts as dense and is averaged
  over ``dp_cp``; tagged ``allreduce=False`` it is compared (and reduced) over ``expt_dp``,
  where the shards are the same expert. Values that differ are an error when the rest of
  the model shows the ranks initialised it alike (some param that is not constant agrees);
  when every param differs (the model was initialised per rank, e.g. without a common seed,
  as Megatron's ``data_parallel_random_init`` does before ``broadcast_params()``) it is a
  warning. The checksum of a param of ``n`` elements whose
  bits read as integers ``b_i`` is ``(Σ b_i, Σ (i + 1) · b_i) mod 2^64``, computed on the
  param's device in chunks, read back once for all params. Params on the meta device and
  DTensors (sharded by design) are not compared. ``check_param_values=False`` turns the
  comparison off (a model initialised differently per rank on purpose and made equal by
  ``broadcast_params()`` after wrapping, as Megatron's ``data_parallel_random_init``).

Mechanism: :func:`mc_groups.cross_check` over ``dp_cp``, then, with expert params, over
``expt_dp``: one exchange of an 8-byte fingerprint of the whole record each (the values'
checksums ride in it: no exchange of their own) (not recorded by
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
import warnings
from collections.abc import Mapping, Sequence
from numbers import Integral
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import FullParamLayout, PerBufferParamLayout
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
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


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_CHUNK = 1 << 22  # elements per step of the checksum (64 MiB of int64 temporaries)


class Checksum(NamedTuple):
    """A param's values in a few bytes: ``text`` (compared across ranks) and whether every
    element is the same number (``constant``: zeros, ones; such a param agrees across ranks
    whatever the seed, so its agreement says nothing about how the model was initialised)."""

    text: str
    constant: bool


def value_checksums(params: Sequence[Param]) -> list[Checksum | None]:
    """One checksum per param (module notes), None for a param that is not compared (meta
    device, DTensor, an element size without an integer view). One device-to-host read."""
    sums: list[torch.Tensor | None] = []
    for param in params:
        data = param.detach()
        kind = _INT_OF_SIZE.get(data.element_size())
        if data.device.type == "meta" or type(data) is not torch.Tensor or kind is None:
            sums.append(None)
            continue
        bits = data.reshape(-1).view(kind)
        total = torch.zeros(3, dtype=torch.int64, device=bits.device)
        for start in range(0, bits.numel(), _CHUNK):
            chunk = bits[start : start + _CHUNK].to(torch.int64)
            weight = torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device)
            total[0] += chunk.sum()
            total[1] += (chunk * weight).sum()
        total[2] = (bits.amin() == bits.amax()).to(torch.int64)
        sums.append(total)
    present = [t.cpu() for t in sums if t is not None]
    host = iter(torch.stack(present).tolist()) if present else iter(())
    out: list[Checksum | None] = []
    for t in sums:
        if t is None:
            out.append(None)
            continue
        first, weighted, constant = next(host)
        out.append(Checksum(f"{first % 2**64:016x}{weighted % 2**64:016x}", bool(constant)))
    return out


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
    checksums: Mapping[Param, Checksum | None] | None = None,
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
    for name, param in members if checksums is not None else ():
        value = checksums.get(param) if checksums is not None else None
        if value is not None:
            record[f"{_VALUES}'{name}'"] = value.text
    return record


def telling_fields(
    named: Sequence[tuple[str, Param]], checksums: Mapping[Param, Checksum | None] | None
) -> frozenset[str]:
    """The value fields whose agreement says the ranks initialised the model alike: params
    compared and not constant (a constant param agrees whatever the seed)."""
    if checksums is None:
        return frozenset()
    return frozenset(
        f"{_VALUES}'{name}'"
        for name, param in named
        if (value := checksums.get(param)) is not None and not value.constant
    )


_VALUES = "values of "
"""The prefix of a param's checksum field (the error names the param by it)."""


def agree(
    group: dist.ProcessGroup,
    group_name: str,
    record: Record,
    telling: frozenset[str] = frozenset(),
) -> None:
    """Every rank of ``group`` holds the same ``record``, else every rank raises
    :class:`DataParallelAgreementError` (see the module notes). Params' values that differ
    while no ``telling`` value field agrees (the whole model initialised per rank) are
    accepted with a warning; every rank reads the same differences, so every rank decides
    alike."""
    try:
        mg.cross_check(group, f"DistributedDataParallel over {group_name}", record)
    except mg.AgreementError as err:
        differing = {d.field for d in err.differences}
        values = {f for f in differing if f.startswith(_VALUES)}
        agreeing = telling - differing
        if values == differing and not agreeing:
            warnings.warn(
                f"DistributedDataParallel over {group_name}: the values of every param differ "
                f"across the ranks {list(err.group_ranks)} (the model was initialised per "
                "rank); their gradients are averaged over the group: make the params equal "
                "(ddp.broadcast_params()) before training",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        raise DataParallelAgreementError(
            _message(group_name, err), err.what, err.group_ranks, err.differences
        ) from None


def _message(group_name: str, err: mg.AgreementError) -> str:
    values = [d.field.removeprefix(_VALUES) for d in err.differences if d.field.startswith(_VALUES)]
    others = [d for d in err.differences if not d.field.startswith(_VALUES)]
    lines = [f"  {difference.describe()}" for difference in others]
    if values:
        lines.append(
            f"  the values of {len(values)} param(s) differ across the ranks: "
            f"{', '.join(values[:_MAX_LINES])}{' and more' if len(values) > _MAX_LINES else ''}"
        )
    if len(lines) > _MAX_LINES:
        lines = [*lines[:_MAX_LINES], f"  ... and {len(lines) - _MAX_LINES} more"]
    fix = []
    if values:
        fix.append(
            f"Their gradients would be averaged over {group_name} while the params differ: "
            "tag an expert param (its shards differ across expert-parallel ranks) with "
            "mc_groups.param_attrs.mark_allreduce(param, False) so that DDP reduces it over "
            "expt_dp; otherwise initialise the params alike on every rank (the same seed), or "
            "pass check_param_values=False when they are made equal after wrapping "
            "(ddp.broadcast_params())."
        )
    fix.append(
        "Build the DistributedDataParallel alike on every rank of the group: the same "
        "config, ddp_config, disable_bucketing and module (the same params, registered "
        "in the same order, with the same shapes and dtypes)."
    )
    return "\n".join(
        [
            f"DistributedDataParallel: the ranks {list(err.group_ranks)} of group {group_name} "
            "were built differently, so their gradient collectives would not match (a hang, "
            "an abort inside the backend, or silently wrong gradients); nothing was allocated "
            "and no gradient reduced. Fields that differ:",
            *lines,
            *fix,
        ]
    )
