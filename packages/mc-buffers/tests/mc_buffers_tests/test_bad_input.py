"""Bad input fails fast with a ValueError/TypeError that names the argument or param.

Each case runs under ``record_collectives()`` and must leave the log empty: nothing is
issued (mc-buffers never communicates, and the error comes before any allocation).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from mc_buffers import (
    FullParamLayout,
    ParamAndGradBuffer,
    PerBufferParamLayout,
    build_param_and_grad_buffers,
    compute_default_per_buffer_param_layout,
    compute_distributed_optimizer_param_layout,
    compute_full_param_layout,
    group_params_for_buffers,
    shard_buffer,
)
from mc_buffers_tests._params import param
from mc_groups import record_collectives


def _frozen() -> object:
    a, b = param(4), param(4)
    b.requires_grad_(False)
    return ParamAndGradBuffer([a, b], param_to_name={a: "a", b: "frozen.weight"})


def _twice() -> object:
    a = param(4)
    return ParamAndGradBuffer([a, param(3), a])


def _devices() -> object:
    meta = nn.Parameter(torch.empty(4, device="meta"))
    return ParamAndGradBuffer([param(4), meta])


def _slice_view() -> object:
    base = torch.zeros(10)
    return ParamAndGradBuffer([nn.Parameter(base[2:6])])


def _strided_view() -> object:
    return ParamAndGradBuffer([nn.Parameter(torch.zeros(3, 4).t())])


def _missing_param() -> object:
    a, b = param(4), param(4)
    layout = compute_default_per_buffer_param_layout([a], None)
    return ParamAndGradBuffer([a, b], param_layout=layout, param_to_name={b: "decoder.b"})


def _extra_param() -> object:
    a, b = param(4), param(4)
    layout = compute_default_per_buffer_param_layout([a, b], None)
    return ParamAndGradBuffer([a], param_layout=layout)


def _wrong_numel() -> object:
    a = param(4)
    layout = PerBufferParamLayout({a: (0, 5, 0)}, [(0, 5)], [5])
    return ParamAndGradBuffer([a], param_layout=layout)


def _overlap() -> object:
    a, b = param(4), param(4)
    layout = PerBufferParamLayout({a: (0, 4, 0), b: (2, 6, 0)}, [(0, 8)], [6])
    return ParamAndGradBuffer([a, b], param_layout=layout)


def _gap_between_buckets() -> object:
    a, b = param(4), param(4)
    layout = PerBufferParamLayout({a: (0, 4, 0), b: (6, 10, 1)}, [(0, 4), (6, 10)], [4, 4])
    return ParamAndGradBuffer([a, b], param_layout=layout)


def _indivisible_layout() -> object:
    a = param(100)
    layout = compute_default_per_buffer_param_layout([a], None)
    return ParamAndGradBuffer(
        [a], param_layout=layout, use_distributed_optimizer=True, data_parallel_size=8
    )


def _full_layout_missing_key() -> object:
    a, b = param(4), param(4, dtype=torch.bfloat16)
    full = compute_full_param_layout(
        [a], None, 1, use_distributed_optimizer=False, grad_reduce_in_fp32=False
    )
    return build_param_and_grad_buffers([a, b], bucket_size=None, full_param_layout=full)


def _expert_without_size() -> object:
    return compute_full_param_layout(
        [param(4, allreduce=False)],
        None,
        2,
        use_distributed_optimizer=True,
        grad_reduce_in_fp32=False,
    )


def _offloaded_reset() -> object:
    buf = ParamAndGradBuffer([param(4)])
    buf.offload_to_cpu()
    buf.reset()
    return buf


CASES: dict[str, tuple[Callable[[], object], type[Exception], str]] = {
    "requires_grad": (_frozen, ValueError, "params\\[1\\] 'frozen.weight'.*requires_grad"),
    "duplicate": (_twice, ValueError, "params\\[2\\].*repeats params\\[0\\]"),
    "devices": (_devices, ValueError, "params\\[1\\].*meta.*params\\[0\\] is on cpu"),
    "slice view": (_slice_view, ValueError, "params\\[0\\].*view.*storage offset 2"),
    "strided view": (_strided_view, ValueError, "params\\[0\\].*view.*contiguous=False"),
    "layout misses": (_missing_param, ValueError, "param_layout misses 'decoder.b'"),
    "layout extra": (
        _extra_param,
        ValueError,
        "param_layout places param \\(shape \\(4,\\).*not among this buffer's params",
    ),
    "layout numel": (_wrong_numel, ValueError, "5 elements but it has 4"),
    "layout overlap": (_overlap, ValueError, "at \\[2, 6\\), overlapping .*ends at 4"),
    "layout gap": (_gap_between_buckets, ValueError, "bucket 1 spans \\[6, 10\\).*start at 4"),
    "layout dp": (_indivisible_layout, ValueError, "not divisible by the data-parallel size 8"),
    "full layout key": (_full_layout_missing_key, ValueError, "no layout for BufferKey"),
    "expert dp": (_expert_without_size, ValueError, "expert_data_parallel_size=None"),
    "empty": (lambda: ParamAndGradBuffer([]), ValueError, "params is empty"),
    "empty layout": (
        lambda: compute_default_per_buffer_param_layout([], 4),
        ValueError,
        "params is empty",
    ),
    "zero numel": (lambda: ParamAndGradBuffer([param(0)]), ValueError, "no elements"),
    "set": (lambda: ParamAndGradBuffer({param(3)}), TypeError, "ordered sequence.*set"),
    "not a tensor": (lambda: ParamAndGradBuffer([param(3), 5]), TypeError, "params\\[1\\]"),  # type: ignore[list-item]
    "bucket_size 0": (
        lambda: ParamAndGradBuffer([param(3)], bucket_size=0),
        ValueError,
        "bucket_size=0",
    ),
    "bucket_size negative": (
        lambda: compute_default_per_buffer_param_layout([param(3)], -5),
        ValueError,
        "bucket_size=-5",
    ),
    "bucket_size bool": (
        lambda: compute_distributed_optimizer_param_layout([param(3)], True, 2),
        TypeError,
        "bucket_size=True",
    ),
    "bucket_size float": (
        lambda: ParamAndGradBuffer([param(3)], bucket_size=2.5),  # type: ignore[arg-type]
        TypeError,
        "bucket_size=2.5",
    ),
    "dp 0": (
        lambda: compute_distributed_optimizer_param_layout([param(3)], None, 0),
        ValueError,
        "data_parallel_size=0",
    ),
    "dp bool": (
        lambda: ParamAndGradBuffer([param(3)], data_parallel_size=True),
        TypeError,
        "data_parallel_size=True",
    ),
    "expert dp 0": (
        lambda: compute_full_param_layout(
            [param(3)],
            None,
            1,
            use_distributed_optimizer=True,
            grad_reduce_in_fp32=False,
            expert_data_parallel_size=0,
        ),
        ValueError,
        "expert_data_parallel_size=0",
    ),
    "param dtype": (
        lambda: ParamAndGradBuffer([param(3)], param_dtype=torch.bfloat16),
        TypeError,
        "params\\[0\\].*param_dtype=torch.bfloat16",
    ),
    "grad dtype": (
        lambda: ParamAndGradBuffer([param(3)], grad_dtype=torch.int32),
        TypeError,
        "grad_dtype=torch.int32",
    ),
    "patterns str": (
        lambda: ParamAndGradBuffer(
            [param(3)], param_name_patterns_for_fp32_local_accumulation="all"
        ),
        TypeError,
        "param_name_patterns_for_fp32_local_accumulation='all'",
    ),
    "patterns without names": (
        lambda: ParamAndGradBuffer(
            [param(3)], param_name_patterns_for_fp32_local_accumulation=["*.weight"]
        ),
        ValueError,
        "param_to_name has no name for params\\[0\\]",
    ),
    "flag": (
        lambda: ParamAndGradBuffer([param(3)], use_distributed_optimizer=1),  # type: ignore[arg-type]
        TypeError,
        "use_distributed_optimizer=1",
    ),
    "grad_reduce_in_fp32": (
        lambda: group_params_for_buffers([param(3)], grad_reduce_in_fp32=None),  # type: ignore[arg-type]
        TypeError,
        "grad_reduce_in_fp32=None",
    ),
    "full layout type": (
        lambda: build_param_and_grad_buffers(
            [param(3)],
            bucket_size=None,
            full_param_layout={},  # type: ignore[arg-type]
        ),
        TypeError,
        "full_param_layout must be a FullParamLayout",
    ),
    "layout type": (
        lambda: ParamAndGradBuffer([param(3)], param_layout=FullParamLayout()),  # type: ignore[arg-type]
        TypeError,
        "param_layout must be a PerBufferParamLayout",
    ),
    "scale": (
        lambda: ParamAndGradBuffer([param(3)]).scale_gradients("2"),  # type: ignore[arg-type]
        TypeError,
        "scaling_factor='2'",
    ),
    "shard_buffer": (
        lambda: shard_buffer(torch.zeros(10), 4),
        ValueError,
        "data_parallel_world_size=4",
    ),
    "offloaded reset": (
        _offloaded_reset,
        RuntimeError,
        "reset\\(\\): the grad buffer is offloaded.*reload_from_cpu\\(\\)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_named_and_nothing_is_communicated(case: str) -> None:
    call, error, pattern = CASES[case]
    with record_collectives() as log, pytest.raises(error, match=pattern):
        call()
    assert log == []


def test_bucket_shard_arguments() -> None:
    buf = ParamAndGradBuffer([param(100)], use_distributed_optimizer=True, data_parallel_size=2)
    bucket = buf.buckets[0]  # 128 elements
    with pytest.raises(ValueError, match="shard_index=2 must be in \\[0, num_shards=2\\)"):
        bucket.grad_shard(2, 2)
    with pytest.raises(ValueError, match="num_shards=3"):
        bucket.shard_range(0, 3)
    with pytest.raises(TypeError, match="shard_index=True"):
        bucket.param_shard(True, 2)
    plain = ParamAndGradBuffer([param(100)]).buckets[0]
    with pytest.raises(ValueError, match="no param_data"):
        plain.param_shard(0, 1)


def test_failed_build_leaves_params_untouched() -> None:
    a, b = param(4), param(4)
    b.requires_grad_(False)
    before = a.data
    with pytest.raises(ValueError):
        ParamAndGradBuffer([a, b], use_distributed_optimizer=True)
    assert a.data is before or a.data.data_ptr() == before.data_ptr()
    assert not hasattr(a, "main_grad")
