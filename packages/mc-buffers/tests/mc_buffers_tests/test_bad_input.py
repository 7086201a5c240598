"""Bad input fails fast with a ValueError/TypeError that names the argument or param.

Each case runs under ``record_collectives()`` and must leave the log empty: nothing is
issued (mc-buffers never communicates, and the error comes before any allocation).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from torch import nn

from mc_buffers import (
    FullParamLayout,
    ParamAndGradBuffer,
    PerBufferParamLayout,
    bucket_end_divisor,
    compute_default_per_buffer_param_layout,
    group_params_for_buffers,
    pad_to_divisor,
    shard_buffer,
)
from mc_buffers.buffer import ParamAndGradBucket
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers.keys import is_expert_parallel_param
from mc_buffers.layout import compute_distributed_optimizer_param_layout, compute_full_param_layout
from mc_buffers_tests._params import param
from mc_groups import record_collectives


def _frozen() -> object:
    a, b = param(4), param(4)
    b.requires_grad_(False)
    return ParamAndGradBuffer([a, b], param_to_name={a: "a", b: "frozen.weight"})


def _twice() -> object:
    a = param(4)
    return ParamAndGradBuffer([a, param(3), a])


def _non_leaf() -> object:
    a = param(4)
    computed: Any = a * 2  # a Tensor where a Parameter belongs: the case under test
    return ParamAndGradBuffer([a, computed])


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


def _offloaded_main_grad_write() -> object:
    p = param(4)
    buf = ParamAndGradBuffer([p], param_to_name={p: "decoder.w"})
    buf.offload_to_cpu()
    p.main_grad.add_(1.0)  # type: ignore[attr-defined]  # a fused wgrad's write
    return buf


def _offloaded_copy_in_buffer_read() -> object:
    p = param(4, dtype=torch.bfloat16)
    buf = ParamAndGradBuffer(
        [p], param_to_name={p: "norm.w"}, param_name_patterns_for_fp32_local_accumulation=["all"]
    )
    buf.offload_to_cpu()
    return p.main_grad_copy_in_grad_buffer.sum()  # type: ignore[attr-defined]


def _offloaded_bucket_read() -> object:
    buf = ParamAndGradBuffer([param(4)], use_distributed_optimizer=True, data_parallel_size=2)
    buf.offload_to_cpu()
    return float(buf.buckets[0].grad_data.sum())


def _offloaded_param_shard() -> object:
    buf = ParamAndGradBuffer([param(4)], use_distributed_optimizer=True, data_parallel_size=2)
    buf.offload_to_cpu(move_grads=False)
    return buf.buckets[0].param_shard(1, 2)


def _offloaded_scale() -> object:
    buf = ParamAndGradBuffer([param(4)])
    buf.offload_to_cpu(move_params=False)
    buf.scale_gradients(0.5)
    return buf


def _bucket(**changes: object) -> object:
    p = param(4)
    fields: dict[str, object] = {
        "params": [p],
        "param_data": None,
        "grad_data": torch.zeros(8),
        "offset": 0,
        "numel_unpadded": 4,
        "gradient_scaling_factor": 1.0,
        "bucket_id": 0,
        "param_index_map": {p: (0, 4, 0)},
    }
    fields.update(changes)
    return ParamAndGradBucket(**fields)  # type: ignore[arg-type]


def _ddp_config(**fields: object) -> object:
    """An object with the fields of a DistributedDataParallelConfig the buffer reads."""
    values: dict[str, object] = {
        "use_distributed_optimizer": False,
        "pad_buckets_for_high_nccl_busbw": False,
        "param_name_patterns_for_fp32_local_accumulation": [],
    }
    values.update(fields)
    return type("DDPConfig", (), values)()


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
    "non_leaf": Case(
        _non_leaf,
        ValueError,
        "params\\[1\\] is not a leaf tensor.*pass the nn.Parameter itself",
        doc_call="`ParamAndGradBuffer(params)`",
        doc_input="`param * 2` (a non-leaf tensor)",
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
    "params twice": Case(
        lambda: ParamAndGradBuffer([param(3)], params_with_names=[(param(3), "w")]),
        ValueError,
        "params and params_with_names",
        doc_call="`ParamAndGradBuffer(params, params_with_names=)`",
        doc_input="both (Megatron's keyword and mc's)",
    ),
    "nccl_ub": Case(
        lambda: ParamAndGradBuffer([param(3)], nccl_ub=True),
        ValueError,
        "nccl_ub=True",
        doc_call="`ParamAndGradBuffer(..., nccl_ub=)`",
        doc_input="`True` (NCCL user buffers)",
    ),
    "ddp_config disagrees": Case(
        lambda: ParamAndGradBuffer(
            [param(3)],
            use_distributed_optimizer=True,
            ddp_config=_ddp_config(use_distributed_optimizer=False),
        ),
        ValueError,
        "use_distributed_optimizer=True differs from ddp_config",
        doc_call="`ParamAndGradBuffer(..., ddp_config=, use_distributed_optimizer=)`",
        doc_input="`True` with a config holding `False`",
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
        "full_param_layout must be a mc_buffers.FullParamLayout or an object with a `layouts`",
        doc_call="`build_param_and_grad_buffers(..., full_param_layout=)`",
        doc_input="a dict",
    ),
    "layout type": Case(
        lambda: ParamAndGradBuffer([param(3)], param_layout=FullParamLayout()),  # type: ignore[arg-type]
        TypeError,
        "param_layout must be a mc_buffers.PerBufferParamLayout or an object with the fields",
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
    "scale nan": Case(
        lambda: ParamAndGradBuffer([param(3)]).scale_gradients(float("nan")),
        ValueError,
        "scaling_factor=nan must be finite",
        doc_call="`buffer.scale_gradients(f)`",
        doc_input="`nan`",
    ),
    "scale inf": Case(
        lambda: ParamAndGradBuffer([param(3)]).scale_gradients(float("-inf")),
        ValueError,
        "scaling_factor=-inf must be finite",
        doc_call="`buffer.scale_gradients(f)`",
        doc_input="`-inf`",
    ),
    "scale tensor shape": Case(
        lambda: ParamAndGradBuffer([param(3)]).scale_gradients(torch.ones(2)),
        ValueError,
        "scaling_factor must be a scalar; got a tensor of shape \\(2,\\)",
        doc_call="`buffer.scale_gradients(f)`",
        doc_input="a 2-element tensor",
    ),
    "scale int tensor": Case(
        lambda: ParamAndGradBuffer([param(3)]).scale_gradients(torch.tensor(2)),
        TypeError,
        "scaling_factor is a torch.int64 tensor; it must be floating-point",
        doc_call="`buffer.scale_gradients(f)`",
        doc_input="an int64 tensor",
    ),
    "scaling factor nan": Case(
        lambda: ParamAndGradBuffer([param(3)], gradient_scaling_factor=float("nan")),
        ValueError,
        "gradient_scaling_factor=nan must be finite",
        doc_call="`ParamAndGradBuffer(..., gradient_scaling_factor=)`",
        doc_input="`nan`",
    ),
    "scaling factor 0": Case(
        lambda: build_param_and_grad_buffers(
            [param(3)], bucket_size=None, gradient_scaling_factor=0.0
        ),
        ValueError,
        "gradient_scaling_factor=0.0 must be > 0",
        doc_call="`build_param_and_grad_buffers(..., gradient_scaling_factor=)`",
        doc_input="`0.0` (would zero every gradient)",
    ),
    "expert scaling factor": Case(
        lambda: build_param_and_grad_buffers(
            [param(3)], bucket_size=None, expert_gradient_scaling_factor=float("inf")
        ),
        ValueError,
        "expert_gradient_scaling_factor=inf must be finite",
        doc_call="`build_param_and_grad_buffers(..., expert_gradient_scaling_factor=)`",
        doc_input="`inf` without expert params (ignored before)",
    ),
    "expert param type": Case(
        lambda: is_expert_parallel_param(None),  # type: ignore[arg-type]
        TypeError,
        "param must be a torch.Tensor, got NoneType",
        doc_call="`is_expert_parallel_param(param)`",
        doc_input="`None` (read as dense before)",
    ),
    "param_indices float": Case(
        lambda: ParamAndGradBuffer([param(3)], param_indices=[1.5]),  # type: ignore[list-item]
        TypeError,
        "param_indices\\[0\\]=1.5 must be an int",
        doc_call="`ParamAndGradBuffer(..., param_indices=)`",
        doc_input="`[1.5]`",
    ),
    "param_to_name value": Case(
        lambda: ParamAndGradBuffer([p := param(3)], param_to_name={p: 7}),  # type: ignore[dict-item]
        TypeError,
        "param_to_name maps a param to 7; every name must be a str",
        doc_call="`ParamAndGradBuffer(..., param_to_name=)`",
        doc_input="a name that is an int",
    ),
    "allreduce not bool": Case(
        lambda: group_params_for_buffers([param(3, allreduce=0)], grad_reduce_in_fp32=False),
        TypeError,
        "has allreduce=0; the attribute must be a bool",
        doc_call="`group_params_for_buffers(params, ...)`",
        doc_input="`param.allreduce = 0` (read by truthiness before)",
    ),
    "shared_embedding not bool": Case(
        lambda: compute_distributed_optimizer_param_layout(
            [param(3, shared_embedding="yes")], None, 2
        ),
        TypeError,
        "has shared_embedding='yes'; the attribute must be a bool",
        doc_call="`compute_distributed_optimizer_param_layout(params, ...)`",
        doc_input="`param.shared_embedding = 'yes'`",
    ),
    "busbw flag": Case(
        lambda: bucket_end_divisor(2, "no"),  # type: ignore[arg-type]
        TypeError,
        "pad_for_high_nccl_busbw='no' must be a bool",
        doc_call="`bucket_end_divisor(dp, pad_for_high_nccl_busbw)`",
        doc_input="`'no'` (truthy: padded to 2**16 before)",
    ),
    "pad negative": Case(
        lambda: pad_to_divisor(-1, 64),
        ValueError,
        "n=-1 must be >= 0",
        doc_call="`pad_to_divisor(n, d)`",
        doc_input="`n=-1`",
    ),
    "shard_buffer type": Case(
        lambda: shard_buffer([1.0, 2.0], 2),  # type: ignore[arg-type]
        TypeError,
        "buffer must be a torch.Tensor, got list",
        doc_call="`shard_buffer(buffer, dp)`",
        doc_input="a list",
    ),
    "offload flag": Case(
        lambda: ParamAndGradBuffer([param(3)]).offload_to_cpu(move_grads=1),  # type: ignore[arg-type]
        TypeError,
        "move_grads=1 must be a bool",
        doc_call="`buffer.offload_to_cpu(move_params=, move_grads=)`",
        doc_input="`move_grads=1`",
    ),
    "reload flag": Case(
        lambda: ParamAndGradBuffer([param(3)]).reload_from_cpu(move_params=None),  # type: ignore[arg-type]
        TypeError,
        "move_params=None must be a bool",
        doc_call="`buffer.reload_from_cpu(move_params=, move_grads=)`",
        doc_input="`move_params=None`",
    ),
    "bucket offset": Case(
        lambda: _bucket(offset=-1),
        ValueError,
        "offset=-1 must be >= 0",
        doc_call="`ParamAndGradBucket(..., offset=)`",
        doc_input="`-1`",
    ),
    "bucket index map": Case(
        lambda: _bucket(param_index_map={}),
        ValueError,
        "bucket 0: param_index_map has no entry for params\\[0\\]",
        doc_call="`ParamAndGradBucket(..., param_index_map=)`",
        doc_input="a map without the bucket's param",
    ),
    "bucket range": Case(
        lambda: _bucket(offset=6),
        ValueError,
        "bucket 0: params\\[0\\] \\(numel 4\\) is mapped to \\[0, 4\\), not inside the bucket",
        doc_call="`ParamAndGradBucket(...)`",
        doc_input="a param mapped outside the bucket's range",
    ),
    "bucket params set": Case(
        lambda: _bucket(params={param(4)}),
        TypeError,
        "bucket 0: params must be a sequence of parameters in buffer order, got set",
        doc_call="`ParamAndGradBucket(params, ...)`",
        doc_input="a `set`",
    ),
    "bucket unpadded": Case(
        lambda: _bucket(numel_unpadded=9),
        ValueError,
        "numel_unpadded=9 exceeds the bucket's 8 elements",
        doc_call="`ParamAndGradBucket(..., numel_unpadded=)`",
        doc_input="more than the bucket holds",
    ),
    "offloaded main_grad": Case(
        _offloaded_main_grad_write,
        RuntimeError,
        "main_grad of 'decoder.w' \\(shape \\(4,\\), float32, cpu\\) is offloaded.*"
        "restore_grad_buffers\\(\\).*reload_from_cpu\\(\\).*nothing was read or written",
        doc_call="`param.main_grad.add_(g)` (a layer's fused wgrad)",
        doc_input="after `offload_to_cpu()` (call order; segfault before)",
    ),
    "offloaded copy in buffer": Case(
        _offloaded_copy_in_buffer_read,
        RuntimeError,
        "main_grad_copy_in_grad_buffer of 'norm.w'.*is offloaded",
        doc_call="`param.main_grad_copy_in_grad_buffer.sum()`",
        doc_input="after `offload_to_cpu()` (fp32 local accumulation; call order)",
    ),
    "offloaded bucket read": Case(
        _offloaded_bucket_read,
        RuntimeError,
        "grad_data of bucket 0 is offloaded.*nothing was read or written",
        doc_call="`float(bucket.grad_data.sum())`",
        doc_input="after `offload_to_cpu()` (call order; segfault before)",
    ),
    "offloaded param shard": Case(
        _offloaded_param_shard,
        RuntimeError,
        "param_data of bucket 0 is offloaded",
        doc_call="`bucket.param_shard(r, dp)`",
        doc_input="after `offload_to_cpu(move_grads=False)` (call order)",
    ),
    "offloaded scale": Case(
        _offloaded_scale,
        RuntimeError,
        "scale_gradients\\(\\): the grad buffer is offloaded.*reload_from_cpu\\(\\)",
        doc_call="`buffer.scale_gradients(f)`",
        doc_input="after `offload_to_cpu(move_params=False)` (call order)",
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
