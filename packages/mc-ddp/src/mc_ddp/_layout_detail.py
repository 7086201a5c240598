"""What a bucket group's collectives carry, in words: shown in collective errors and
compared by mc_groups' opt-in schedule check (``detail=``), so that ranks whose buckets
hold different params (e.g. params registered in a different order) are told apart even
when the buckets have the same size."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from mc_buffers import ParamAndGradBucket

Param = torch.nn.Parameter

_SHOWN = 3
"""Params named per bucket; the digest covers all of them."""


def bucket_layout_detail(buckets: Sequence[ParamAndGradBucket], names: Mapping[Param, str]) -> str:
    """``bucket 0: 6 params '4.bias' (4,), '4.weight' (4, 16), '2.bias' (16,) and 3 more;
    layout 1f0c…`` per bucket (``"; "``-joined; ``1 param`` for one).

    The 16-hex-digit layout digest (BLAKE2b) covers every param's name, shape and
    ``(start, end)`` in the bucket and the bucket's size, so two ranks agree on it exactly
    when their buckets map the same elements to the same params. Computed once per bucket
    group (construction), not per collective.
    """
    return "; ".join(_one_bucket(bucket, names) for bucket in buckets)


def _one_bucket(bucket: ParamAndGradBucket, names: Mapping[Param, str]) -> str:
    params = bucket.params_list
    entries = [
        f"{names.get(p, '<unnamed>')}:{tuple(p.shape)}:{bucket.param_to_index[p]}" for p in params
    ]
    text = "|".join([str(bucket.grad_data.numel()), *entries])
    digest = hashlib.blake2b(text.encode(), digest_size=8).hexdigest()
    shown = ", ".join(f"'{names.get(p, '<unnamed>')}' {tuple(p.shape)}" for p in params[:_SHOWN])
    more = f" and {len(params) - _SHOWN} more" if len(params) > _SHOWN else ""
    count = f"{len(params)} param{'' if len(params) == 1 else 's'}"
    return f"bucket {bucket.bucket_id}: {count} {shown}{more}; layout {digest}"
