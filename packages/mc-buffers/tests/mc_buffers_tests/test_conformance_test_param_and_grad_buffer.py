"""Conformance with Megatron-LM's ``tests/unit_tests/distributed/test_param_and_grad_buffer.py``:
the facts of that file that concern the buffer and its buckets alone (no processes).

Upstream builds the buffer through DDP on a GPU world; the fact it checks is a property of the
distributed-optimizer layout and of the bucket views, so it is held here on a buffer built for
a data-parallel size of 2. Offsets are worked out by hand in the comments (``p64(x)``: next
multiple of 64 at or after x; ``p128``: of 128) and compared exactly.
"""

from __future__ import annotations

import torch
from torch import nn

from mc_buffers import ParamAndGradBuffer


def _layers(count: int) -> list[nn.Parameter]:
    """Params of ``count`` × ``nn.Linear(4, 4)`` (weight 16, bias 4 elements), in order."""
    torch.manual_seed(0)
    out: list[nn.Parameter] = []
    for _ in range(count):
        out.extend(nn.Linear(4, 4).parameters())
    return out


def test_bucket_local_offsets_honour_param_start_padding() -> None:
    """Follows ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    test_param_to_index_alignment_with_padding``.

    Same facts: in the distributed-optimizer layout a bucket's ``param_to_index`` is the
    buffer-level ``(start, end)`` minus the bucket's ``offset`` (padding included, so at least
    one param does not start where the previous one ended), and the bucket's ``param_data``
    slice at those offsets is the param's own values. Upstream uses one bucket; a second
    bucket is added here so that ``offset`` is not 0.
    """
    w0, b0, w1, b1 = params = _layers(2)
    values = [p.detach().clone() for p in params]
    buf = ParamAndGradBuffer(
        params, bucket_size=20, use_distributed_optimizer=True, data_parallel_size=2
    )
    # backprop order b1, w1 | b0, w0. b1 0..4; w1 p64(4) = 64..80 (80 >= 20 closes the
    # bucket, end p128(80) = 128); b0 128..132; w0 p64(132) = 192..208, end p128(208) = 256.
    assert [buf.param_index_map[p] for p in (b1, w1, b0, w0)] == [
        (0, 4, 0),
        (64, 80, 0),
        (128, 132, 1),
        (192, 208, 1),
    ]
    assert [(b.offset, b.numel) for b in buf.buckets] == [(0, 128), (128, 128)]
    expected_local = {id(b1): (0, 4), id(w1): (64, 80), id(b0): (0, 4), id(w0): (64, 80)}
    for bucket in buf.buckets:
        assert bucket.param_data is not None
        previous_end, padded = 0, False
        for param in bucket.params_list:
            start, end, bucket_id = buf.param_index_map[param]
            local = bucket.param_to_index[param]
            assert bucket_id == bucket.bucket_id
            assert local == (start - bucket.offset, end - bucket.offset)
            assert local == expected_local[id(param)]
            padded = padded or local[0] != previous_end
            previous_end = local[1]
            window = bucket.param_data.view(-1)[local[0] : local[1]]
            assert torch.equal(window, param.detach().view(-1))
        assert padded  # each bucket holds a 4-element bias followed by a padded weight
    for param, value in zip(params, values, strict=True):
        assert torch.equal(param.detach(), value)  # re-pointing kept the values


class _Group:
    """A stand-in for a process group: the buffer only asks its size (as Megatron main's
    ``TestNVFP4IndexMaps`` does with a mock)."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


class _MegatronDDPConfig:
    """The three fields of Megatron-Core's ``DistributedDataParallelConfig`` the buffer reads
    (any object with them is accepted, as Megatron's own config is)."""

    use_distributed_optimizer = True
    pad_buckets_for_high_nccl_busbw = False
    param_name_patterns_for_fp32_local_accumulation: tuple[str, ...] = ()


def test_megatron_main_keywords_build_the_distributed_optimizer_layout() -> None:
    """Follows Megatron main's ``tests/unit_tests/distributed/test_param_and_grad_buffer.py::
    TestNVFP4IndexMaps`` (its ``_make_buffer``), for plain params.

    Same construction: ``ddp_config=``, ``params_with_names=``, ``data_parallel_group=`` (a
    group whose ``size()`` is 2), ``param_to_name=``, ``nccl_ub=False``, ``pg_collection=``.
    Same facts for what mc supports (not NVFP4): the buffer reads
    ``use_distributed_optimizer`` from the config and the shard count from the group, so
    the params get the distributed optimizer's layout (starts padded to 64, bucket end to
    ``p128``), and the group and config are kept as the buffer's fields.
    """
    w0, b0, w1, b1 = params = _layers(2)
    names = ["0.weight", "0.bias", "1.weight", "1.bias"]
    group, config = _Group(2), _MegatronDDPConfig()
    buf = ParamAndGradBuffer(
        ddp_config=config,
        param_dtype=torch.float32,
        grad_dtype=torch.float32,
        params_with_names=list(zip(params, names, strict=True)),
        data_parallel_group=group,
        bucket_size=None,
        param_to_name=dict(zip(params, names, strict=True)),
        gradient_scaling_factor=1.0,
        param_indices=[0, 1, 2, 3],
        nccl_ub=False,
        pg_collection=object(),
    )
    # backprop order b1, w1, b0, w0, each start padded to 64: b1 0..4, w1 p64(4) = 64..80,
    # b0 p64(80) = 128..132, w0 p64(132) = 192..208; one bucket, end p128(208) = 256.
    assert [buf.param_index_map[p] for p in (b1, w1, b0, w0)] == [
        (0, 4, 0),
        (64, 80, 0),
        (128, 132, 0),
        (192, 208, 0),
    ]
    assert buf.numel == 256
    assert buf.param_data is not None
    assert buf.data_parallel_group is group
    assert buf.ddp_config is config
