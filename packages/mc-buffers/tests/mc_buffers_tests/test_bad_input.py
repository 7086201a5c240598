"""Bad input fails fast with a ValueError/TypeError that names the argument or param.

Each case runs under ``record_collectives()`` and must leave the log empty: nothing is
issued (mc-buffers never communicates, and the error comes before any allocation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

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


class Case(NamedTuple):
    """``call()`` must raise ``error`` with a message matching the regex ``pattern``;
    ``doc_call`` and ``doc_input`` are the catalogue's "call" and "bad input" cells
    (markdown), read by ``scripts/gen_bad_inputs.py``."""

    call: Callable[[], object]
    error: type[Exception]
    pattern: str
    doc_call: str
    doc_input: str


CASES: dict[str, Case] = {
    "requires_grad": Case(
        _frozen,
        ValueError,
        "params\\[1\\] 'frozen.weight'.*requires_grad",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="a frozen param",
    ),
    "duplicate": Case(
        _twice,
        ValueError,
        "params\\[2\\].*repeats params\\[0\\]",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="the same param twice",
    ),
    "devices": Case(
        _devices,
        ValueError,
        "params\\[1\\].*meta.*params\\[0\\] is on cpu",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="params on cpu and meta",
    ),
    "slice view": Case(
        _slice_view,
        ValueError,
        "params\\[0\\].*view.*storage offset 2",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="a param that is a slice of another tensor",
    ),
    "strided view": Case(
        _strided_view,
        ValueError,
        "params\\[0\\].*view.*contiguous=False",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="a transposed view",
    ),
    "layout misses": Case(
        _missing_param,
        ValueError,
        "param_layout misses 'decoder.b'",
        doc_call="`ParamAndGradBuffer(..., param_layout=)`",
        doc_input="layout without one of the params",
    ),
    "layout extra": Case(
        _extra_param,
        ValueError,
        "param_layout places param \\(shape \\(4,\\).*not among this buffer's params",
        doc_call="`ParamAndGradBuffer(..., param_layout=)`",
        doc_input="layout with a param not in the buffer",
    ),
    "layout numel": Case(
        _wrong_numel,
        ValueError,
        "5 elements but it has 4",
        doc_call="`ParamAndGradBuffer(..., param_layout=)`",
        doc_input="range of 5 for a 4-element param",
    ),
    "layout overlap": Case(
        _overlap,
        ValueError,
        "at \\[2, 6\\), overlapping .*ends at 4",
        doc_call="`ParamAndGradBuffer(..., param_layout=)`",
        doc_input="overlapping ranges",
    ),
    "layout gap": Case(
        _gap_between_buckets,
        ValueError,
        "bucket 1 spans \\[6, 10\\).*start at 4",
        doc_call="`ParamAndGradBuffer(..., param_layout=)`",
        doc_input="a gap between buckets",
    ),
    "layout dp": Case(
        _indivisible_layout,
        ValueError,
        "not divisible by the data-parallel size 8",
        doc_call="`ParamAndGradBuffer(..., use_distributed_optimizer=True, data_parallel_size=8)`",
        doc_input="a default layout whose bucket is not divisible by 8",
    ),
    "full layout key": Case(
        _full_layout_missing_key,
        ValueError,
        "no layout for BufferKey",
        doc_call="`build_param_and_grad_buffers(..., full_param_layout=)`",
        doc_input="a layout missing the bf16 key",
    ),
    "expert dp": Case(
        _expert_without_size,
        ValueError,
        "expert_data_parallel_size=None",
        doc_call="`compute_full_param_layout(...)`",
        doc_input="expert params without `expert_data_parallel_size`",
    ),
    "empty": Case(
        lambda: ParamAndGradBuffer([]),
        ValueError,
        "params is empty",
        doc_call="`ParamAndGradBuffer([])`",
        doc_input="no params",
    ),
    "empty layout": Case(
        lambda: compute_default_per_buffer_param_layout([], 4),
        ValueError,
        "params is empty",
        doc_call="`compute_default_per_buffer_param_layout([], 4)`",
        doc_input="no params",
    ),
    "zero numel": Case(
        lambda: ParamAndGradBuffer([param(0)]),
        ValueError,
        "no elements",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="a 0-element param",
    ),
    "set": Case(
        lambda: ParamAndGradBuffer({param(3)}),
        TypeError,
        "ordered sequence.*set",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="a `set` (unordered)",
    ),
    "not a tensor": Case(
        lambda: ParamAndGradBuffer([param(3), 5]),  # type: ignore[list-item]
        TypeError,
        "params\\[1\\]",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="an int among the params",
    ),
    "bucket_size 0": Case(
        lambda: ParamAndGradBuffer([param(3)], bucket_size=0),
        ValueError,
        "bucket_size=0",
        doc_call="`ParamAndGradBuffer(..., bucket_size=)`",
        doc_input="`bucket_size=0`",
    ),
    "bucket_size negative": Case(
        lambda: compute_default_per_buffer_param_layout([param(3)], -5),
        ValueError,
        "bucket_size=-5",
        doc_call="`compute_default_per_buffer_param_layout(..., bucket_size)`",
        doc_input="`-5`",
    ),
    "bucket_size bool": Case(
        lambda: compute_distributed_optimizer_param_layout([param(3)], True, 2),
        TypeError,
        "bucket_size=True",
        doc_call="`compute_distributed_optimizer_param_layout(..., bucket_size)`",
        doc_input="`True`",
    ),
    "bucket_size float": Case(
        lambda: ParamAndGradBuffer([param(3)], bucket_size=2.5),  # type: ignore[arg-type]
        TypeError,
        "bucket_size=2.5",
        doc_call="`ParamAndGradBuffer(..., bucket_size=)`",
        doc_input="`2.5`",
    ),
    "dp 0": Case(
        lambda: compute_distributed_optimizer_param_layout([param(3)], None, 0),
        ValueError,
        "data_parallel_size=0",
        doc_call="`compute_distributed_optimizer_param_layout(..., dp)`",
        doc_input="`0`",
    ),
    "dp bool": Case(
        lambda: ParamAndGradBuffer([param(3)], data_parallel_size=True),
        TypeError,
        "data_parallel_size=True",
        doc_call="`ParamAndGradBuffer(..., data_parallel_size=)`",
        doc_input="`True`",
    ),
    "expert dp 0": Case(
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
        doc_call="`compute_full_param_layout(..., expert_data_parallel_size=)`",
        doc_input="`0`",
    ),
    "param dtype": Case(
        lambda: ParamAndGradBuffer([param(3)], param_dtype=torch.bfloat16),
        TypeError,
        "params\\[0\\].*param_dtype=torch.bfloat16",
        doc_call="`ParamAndGradBuffer(..., param_dtype=)`",
        doc_input="fp32 params, `param_dtype=bf16`",
    ),
    "grad dtype": Case(
        lambda: ParamAndGradBuffer([param(3)], grad_dtype=torch.int32),
        TypeError,
        "grad_dtype=torch.int32",
        doc_call="`ParamAndGradBuffer(..., grad_dtype=)`",
        doc_input="`torch.int32`",
    ),
    "patterns str": Case(
        lambda: ParamAndGradBuffer(
            [param(3)], param_name_patterns_for_fp32_local_accumulation="all"
        ),
        TypeError,
        "param_name_patterns_for_fp32_local_accumulation='all'",
        doc_call="`ParamAndGradBuffer(..., param_name_patterns_for_fp32_local_accumulation=)`",
        doc_input="a string, not a list",
    ),
    "patterns without names": Case(
        lambda: ParamAndGradBuffer(
            [param(3)], param_name_patterns_for_fp32_local_accumulation=["*.weight"]
        ),
        ValueError,
        "param_to_name has no name for params\\[0\\]",
        doc_call="`ParamAndGradBuffer(..., param_name_patterns_...=['*.weight'])`",
        doc_input="no `param_to_name`",
    ),
    "flag": Case(
        lambda: ParamAndGradBuffer([param(3)], use_distributed_optimizer=1),  # type: ignore[arg-type]
        TypeError,
        "use_distributed_optimizer=1",
        doc_call="`ParamAndGradBuffer(..., use_distributed_optimizer=)`",
        doc_input="`1`",
    ),
    "grad_reduce_in_fp32": Case(
        lambda: group_params_for_buffers([param(3)], grad_reduce_in_fp32=None),  # type: ignore[arg-type]
        TypeError,
        "grad_reduce_in_fp32=None",
        doc_call="`group_params_for_buffers(..., grad_reduce_in_fp32=)`",
        doc_input="`None`",
    ),
    "full layout type": Case(
        lambda: build_param_and_grad_buffers(
            [param(3)],
            bucket_size=None,
            full_param_layout={},  # type: ignore[arg-type]
        ),
        TypeError,
        "full_param_layout must be a FullParamLayout",
        doc_call="`build_param_and_grad_buffers(..., full_param_layout=)`",
        doc_input="a dict",
    ),
    "layout type": Case(
        lambda: ParamAndGradBuffer([param(3)], param_layout=FullParamLayout()),  # type: ignore[arg-type]
        TypeError,
        "param_layout must be a PerBufferParamLayout",
        doc_call="`ParamAndGradBuffer(..., param_layout=)`",
        doc_input="a `FullParamLayout`",
    ),
    "scale": Case(
        lambda: ParamAndGradBuffer([param(3)]).scale_gradients("2"),  # type: ignore[arg-type]
        TypeError,
        "scaling_factor='2'",
        doc_call="`buffer.scale_gradients(f)`",
        doc_input="`'2'`",
    ),
    "shard_buffer": Case(
        lambda: shard_buffer(torch.zeros(10), 4),
        ValueError,
        "data_parallel_world_size=4",
        doc_call="`shard_buffer(buffer, dp)`",
        doc_input="10 elements over 4 ranks",
    ),
    "offloaded reset": Case(
        _offloaded_reset,
        RuntimeError,
        "reset\\(\\): the grad buffer is offloaded.*reload_from_cpu\\(\\)",
        doc_call="`buffer.reset()`",
        doc_input="after `offload_to_cpu()` (call order)",
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_named_and_nothing_is_communicated(case: str) -> None:
    bad = CASES[case]
    with record_collectives() as log, pytest.raises(bad.error, match=bad.pattern):
        bad.call()
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
