"""ParamAndGradBuffer memory: aliasing of views, re-pointed params, offload/reload,
dtypes, expert buffers and fp32 local accumulation.

Values are small integers or copies of the params' own initial values, so every
comparison is exact (torch.equal); bf16 cases use integers below 256, exact in bf16.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from mc_buffers import BufferKey, OffloadedView, ParamAndGradBuffer
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers.layout import compute_distributed_optimizer_param_layout
from mc_buffers_tests._params import linears, param


def _main_grad(p: nn.Parameter) -> torch.Tensor:
    grad = p.main_grad  # type: ignore[attr-defined]
    assert isinstance(grad, torch.Tensor)
    return grad


def test_main_grad_views_alias_grad_data() -> None:
    ps = linears(4, width=9, bias=True)
    buf = ParamAndGradBuffer(ps, bucket_size=100)
    assert buf.grad_data.dtype == torch.float32
    assert buf.grad_data.numel() == buf.numel == 4 * (81 + 9)
    assert buf.param_data is None
    for i, p in enumerate(ps):
        start, end, _ = buf.param_index_map[p]
        _main_grad(p).fill_(i + 1)
        assert _main_grad(p).shape == p.shape
        assert torch.equal(buf.grad_data[start:end], torch.full((p.numel(),), float(i + 1)))
    assert buf.grad_data.sum().item() == sum((i + 1) * p.numel() for i, p in enumerate(ps))


def test_buckets_views_and_local_offsets() -> None:
    ps = linears(4, width=9, bias=True)  # w0 b0 w1 b1 w2 b2 w3 b3; 81 + 9 per layer
    buf = ParamAndGradBuffer(ps, bucket_size=100)
    # reverse: b3 0..9, w3 9..90, b2 90..99, w2 99..180 (>= 100 closes) | b1, w1, b0, w0
    assert buf.bucket_indices == [(0, 180), (180, 360)]
    first = buf.buckets[0]
    assert [id(p) for p in first.params_list] == [id(ps[i]) for i in (7, 6, 5, 4)]
    assert first.params == set(first.params_list)
    assert first.param_to_index[ps[4]] == (99, 180)
    second = buf.buckets[1]
    assert (second.offset, second.bucket_id, second.numel_unpadded) == (180, 1, 180)
    assert second.param_to_index[ps[3]] == (0, 9)  # local: b1 starts the bucket
    _main_grad(ps[3]).fill_(7.0)
    assert torch.equal(second.grad_data[0:9], torch.full((9,), 7.0))
    assert second.grad_data.data_ptr() == buf.grad_data[180:].data_ptr()
    assert buf.param_to_bucket[ps[0]] is second


def test_distributed_optimizer_repoints_params_and_keeps_values() -> None:
    ps = linears(3, width=7)
    before = [p.detach().clone() for p in ps]
    buf = ParamAndGradBuffer(
        ps, bucket_size=60, use_distributed_optimizer=True, data_parallel_size=2
    )
    assert buf.param_data is not None
    for p, old in zip(ps, before, strict=True):
        start, end, _ = buf.param_index_map[p]
        assert torch.equal(p.detach(), old)  # values survived the move
        assert torch.equal(buf.param_data[start:end].view(p.shape), old)
        with torch.no_grad():
            p.add_(1.0)  # the param is the buffer: writes show up there
        assert torch.equal(buf.param_data[start:end].view(p.shape), old + 1.0)
    assert buf.buckets[0].param_data is not None
    padding = torch.ones(buf.numel, dtype=torch.bool)
    for start, end, _ in buf.param_index_map.values():
        padding[start:end] = False
    assert int(padding.sum()) == buf.numel - sum(p.numel() for p in ps) > 0
    assert torch.count_nonzero(buf.param_data[padding]).item() == 0  # padding stays zero


def test_param_autograd_still_works_after_repointing() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(5, 3)
    ParamAndGradBuffer(list(layer.parameters()), use_distributed_optimizer=True)
    x = torch.arange(10.0).view(2, 5)
    layer(x).sum().backward()
    assert layer.weight.grad is not None
    assert torch.equal(layer.weight.grad, x.sum(0).expand(3, 5))  # d(sum Wx)/dW = sum_b x


def test_reset_and_scale_cover_the_whole_buffer() -> None:
    ps = linears(2, width=4)
    buf = ParamAndGradBuffer(ps)
    buf.grad_data.fill_(3.0)
    buf.scale_gradients(0.5)
    assert torch.equal(_main_grad(ps[0]), torch.full((4, 4), 1.5))
    buf.scale_gradients(torch.tensor(2.0))
    assert torch.equal(buf.grad_data, torch.full((32,), 3.0))
    buf.reset()
    assert torch.count_nonzero(buf.grad_data).item() == 0


def test_offload_frees_storage_and_reload_restores() -> None:
    ps = linears(3, width=8)
    values = [p.detach().clone() for p in ps]
    buf = ParamAndGradBuffer(
        ps, bucket_size=64, use_distributed_optimizer=True, data_parallel_size=2
    )
    assert buf.param_data is not None
    buf.grad_data.fill_(5.0)
    grad_view = _main_grad(ps[1])
    buf.offload_to_cpu(move_params=True, move_grads=True)
    assert buf.grad_data.untyped_storage().nbytes() == 0
    assert buf.param_data.untyped_storage().nbytes() == 0
    assert buf.buckets[0].grad_data.untyped_storage().nbytes() == 0  # views share it
    assert buf.is_grad_data_offloaded
    assert buf.is_param_data_offloaded
    buf.offload_to_cpu()  # second offload: nothing left to free, CPU copy kept
    buf.reload_from_cpu()
    assert buf.grad_data.untyped_storage().nbytes() == buf.numel * 4
    assert torch.count_nonzero(buf.grad_data).item() == 0  # grads come back zeroed
    for p, v in zip(ps, values, strict=True):
        assert torch.equal(p.detach(), v)
    grad_view.fill_(2.0)  # the old main_grad object aliases the new storage
    start, end, _ = buf.param_index_map[ps[1]]
    assert torch.equal(buf.grad_data[start:end], torch.full((64,), 2.0))


def test_offloaded_main_grads_refuse_every_op_and_come_back() -> None:
    """While offloaded, ``main_grad`` is a storage-free stand-in with the view's metadata on
    which every op raises (a write into the freed view would crash the process); reload
    puts the very same view objects back. A main_grad re-pointed elsewhere is left alone."""
    ps = [param(8, dtype=torch.bfloat16), param(6, dtype=torch.bfloat16), param(4)]
    other = ps[2]
    names = {ps[0]: "a", ps[1]: "b"}
    buf = ParamAndGradBuffer(
        ps[:2], param_to_name=names, param_name_patterns_for_fp32_local_accumulation=["a"]
    )
    views = [(_main_grad(p), getattr(p, "main_grad_copy_in_grad_buffer", None)) for p in ps[:2]]
    foreign = torch.zeros(6)
    ps[1].main_grad = foreign  # type: ignore[attr-defined]  # someone re-pointed it
    other.main_grad = torch.zeros(4)  # type: ignore[attr-defined]
    buf.offload_to_cpu()
    stand_in = _main_grad(ps[0])
    assert isinstance(stand_in, OffloadedView)
    assert (stand_in.shape, stand_in.dtype, stand_in.device) == ((8,), torch.float32, ps[0].device)
    assert isinstance(ps[0].main_grad_copy_in_grad_buffer, OffloadedView)  # type: ignore[attr-defined]
    assert _main_grad(ps[1]) is foreign
    ops: list[Callable[[], object]] = [
        lambda: stand_in.add_(1.0),
        stand_in.sum,
        lambda: torch.ones(8).copy_(stand_in),
    ]
    for op in ops:
        with pytest.raises(RuntimeError, match=r"main_grad of 'a' .* is offloaded"):
            op()
    assert buf.grad_data.untyped_storage().nbytes() == 0  # nothing was re-allocated
    buf.reload_from_cpu()
    assert _main_grad(ps[0]) is views[0][0]
    assert ps[0].main_grad_copy_in_grad_buffer is views[0][1]  # type: ignore[attr-defined]
    assert _main_grad(ps[1]) is foreign
    _main_grad(ps[0]).add_(1.0)
    assert float(_main_grad(ps[0]).sum()) == 8.0


def test_offload_and_reload_check_both_flags_before_changing_anything() -> None:
    buf = ParamAndGradBuffer(linears(1, width=4), use_distributed_optimizer=True)
    with pytest.raises(TypeError, match="move_params='yes' must be a bool"):
        buf.offload_to_cpu(move_params="yes", move_grads=True)  # type: ignore[arg-type]
    assert _offloaded(buf) == [False, False, False, False]
    buf.offload_to_cpu()
    with pytest.raises(TypeError, match="move_grads=0 must be a bool"):
        buf.reload_from_cpu(move_params=True, move_grads=0)  # type: ignore[arg-type]
    assert _offloaded(buf) == [True, True, True, True]
    buf.reload_from_cpu()
    assert _offloaded(buf) == [False, False, False, False]


def _offloaded(buf: ParamAndGradBuffer) -> list[bool]:
    bucket = buf.buckets[0]
    return [
        buf.is_grad_data_offloaded,
        buf.is_param_data_offloaded,
        bucket.is_grad_data_offloaded,
        bucket.is_param_data_offloaded,
    ]


def test_offload_grads_only_keeps_params_resident() -> None:
    ps = linears(2, width=8)
    buf = ParamAndGradBuffer(ps, use_distributed_optimizer=True)
    assert buf.param_data is not None
    buf.offload_to_cpu(move_params=False, move_grads=True)
    assert buf.grad_data.untyped_storage().nbytes() == 0
    assert buf.param_data.untyped_storage().nbytes() == buf.numel * 4
    assert buf.param_data_cpu is None
    buf.reload_from_cpu(move_params=False, move_grads=True)
    assert not buf.is_grad_data_offloaded


def test_bf16_params_with_fp32_grads() -> None:
    ps = [param(70, dtype=torch.bfloat16), param(30, dtype=torch.bfloat16)]
    buf = ParamAndGradBuffer(
        ps, grad_dtype=torch.float32, use_distributed_optimizer=True, data_parallel_size=4
    )
    assert buf.param_data is not None
    assert (buf.param_data.dtype, buf.grad_data.dtype) == (torch.bfloat16, torch.float32)
    assert _main_grad(ps[0]).dtype == torch.float32
    # reverse: p1 0..30, p0 p64(30) = 64..134; lcm(4, 128) = 128 -> p128(134) = 256
    assert buf.param_index_map[ps[0]] == (64, 134, 0)
    assert buf.numel == 256
    assert torch.equal(ps[0].detach().float(), torch.arange(70.0))


def test_expert_params_get_their_own_buffer() -> None:
    dense = [param(10), param(20)]
    experts = [param(30, allreduce=False), param(40, allreduce=False)]
    ps = [dense[0], experts[0], dense[1], experts[1]]
    buffers = build_param_and_grad_buffers(
        ps,
        bucket_size=None,
        data_parallel_size=2,
        expert_data_parallel_size=3,
        use_distributed_optimizer=True,
        gradient_scaling_factor=0.5,
        expert_gradient_scaling_factor=0.25,
    )
    dense_key = BufferKey(torch.float32, torch.float32, False)
    expert_key = BufferKey(torch.float32, torch.float32, True)
    assert list(buffers) == [dense_key, expert_key]
    assert [id(p) for p in buffers[expert_key].params] == [id(p) for p in experts]
    assert buffers[expert_key].data_parallel_world_size == 3
    assert buffers[expert_key].numel % 3 == 0
    assert buffers[expert_key].buckets[0].gradient_scaling_factor == 0.25
    assert buffers[dense_key].buckets[0].gradient_scaling_factor == 0.5
    assert _main_grad(experts[0]).data_ptr() >= buffers[expert_key].grad_data.data_ptr()


def test_fp32_local_accumulation_by_pattern() -> None:
    layer = nn.Linear(4, 4).to(torch.bfloat16)
    names = {p: n for n, p in layer.named_parameters()}
    buf = ParamAndGradBuffer(
        list(layer.parameters()),
        param_to_name=names,
        param_name_patterns_for_fp32_local_accumulation=("*weight",),
    )
    w, b = list(layer.parameters())
    assert _main_grad(w).dtype == torch.float32
    assert _main_grad(b).dtype == torch.bfloat16
    copy = w.main_grad_copy_in_grad_buffer  # type: ignore[attr-defined]
    assert copy.dtype == torch.bfloat16
    assert not hasattr(b, "main_grad_copy_in_grad_buffer")
    start, end, _ = buf.param_index_map[w]
    copy.fill_(3.0)
    assert torch.equal(buf.grad_data[start:end], torch.full((16,), 3.0, dtype=torch.bfloat16))
    assert [id(p) for p in buf.buckets[0].params_with_extra_main_grads] == [id(w)]
    assert len(buf.extra_main_grads) == 1
    _main_grad(w).fill_(4.0)
    buf.scale_gradients(0.5)
    assert torch.equal(_main_grad(w), torch.full((4, 4), 2.0))
    buf.reset()
    assert torch.count_nonzero(_main_grad(w)).item() == 0


def test_fp32_local_accumulation_all_and_offload() -> None:
    ps = [param(8, dtype=torch.bfloat16), param(8, dtype=torch.bfloat16)]
    buf = ParamAndGradBuffer(ps, param_name_patterns_for_fp32_local_accumulation=["all"])
    assert all(_main_grad(p).dtype == torch.float32 for p in ps)
    _main_grad(ps[0]).fill_(1.0)
    buf.offload_to_cpu()
    assert all(g.untyped_storage().nbytes() == 0 for g in buf.extra_main_grads)
    buf.reload_from_cpu()
    assert torch.count_nonzero(_main_grad(ps[0])).item() == 0


def test_fp32_grad_buffer_needs_no_extra_main_grad() -> None:
    ps = [param(8, dtype=torch.bfloat16)]
    buf = ParamAndGradBuffer(
        ps, grad_dtype=torch.float32, param_name_patterns_for_fp32_local_accumulation=("all",)
    )
    assert buf.extra_main_grads == []
    assert _main_grad(ps[0]).data_ptr() == buf.grad_data.data_ptr()


def test_caller_layout_is_used() -> None:
    ps = linears(3, width=8)
    layout = compute_distributed_optimizer_param_layout(ps, 1, 2)
    buf = ParamAndGradBuffer(
        ps, use_distributed_optimizer=True, data_parallel_size=2, param_layout=layout
    )
    assert buf.bucket_indices == layout.bucket_indices == [(0, 128), (128, 256), (256, 384)]
    assert len(buf.buckets) == 3


def test_rewrapping_params_in_a_new_buffer() -> None:
    ps = linears(2, width=8)
    values = [p.detach().clone() for p in ps]
    first = ParamAndGradBuffer(ps, use_distributed_optimizer=True)
    first.offload_to_cpu()
    first.reload_from_cpu()  # moves the storage: the re-wrap must still recognise it
    del first
    second = ParamAndGradBuffer(ps, use_distributed_optimizer=True, data_parallel_size=2)
    assert second.param_data is not None
    for p, v in zip(ps, values, strict=True):
        assert torch.equal(p.detach(), v)
        assert p.untyped_storage().data_ptr() == second.param_data.untyped_storage().data_ptr()
