"""Grad access and DTensor unshard/reshard, and which configs the steps take.

Localizes ``_get_main_grad_attr``, the identity path for plain tensors, and the DTensor
round trip: for 1-D and 2-D meshes, even, uneven and nested ``Shard`` placements and
``Replicate``, the unsharded tensor equals the full tensor the DTensor was built from
(bit-exact: gathering copies values), resharding returns this rank's own ``torch.chunk``
slice without any collective, and attributes set on the DTensor survive both ways. The
config's fields and defaults are :mod:`mc_groups.config`'s (tested there and in
``integration_tests/test_config_protocol.py``).
"""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_tensor,
)

import mc_groups as mg
from mc_finalize import (
    _get_main_grad_attr,
    _reshard_if_dtensor,
    _unshard_if_dtensor,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from mc_finalize_tests._helpers import layout
from mc_groups.testing import RankPools


def test_main_grad_attr_and_plain_tensors_pass_through() -> None:
    plain = torch.nn.Parameter(torch.zeros(2))
    assert _get_main_grad_attr(plain) == "grad"
    plain.main_grad = None  # type: ignore[attr-defined]
    assert _get_main_grad_attr(plain) == "main_grad"  # present, even when None
    tensor = torch.arange(3.0)
    with mg.record_collectives() as log:
        assert _unshard_if_dtensor(tensor) is tensor
        assert _reshard_if_dtensor(tensor * 2, tensor) is tensor  # plain: reduced in place
    assert log == []


CASES: list[tuple[tuple[int, ...], list[Placement]]] = [
    ((7,), [Shard(0), Shard(0)]),  # nested and uneven: 4 + 3, then 2 + 2 and 2 + 1
    ((3, 5), [Shard(1), Replicate()]),
    ((5, 3), [Replicate(), Shard(0)]),
    ((2, 5), [Shard(1), Shard(0)]),
]


def _round_trips() -> list[Any]:
    out: list[Any] = []
    with layout(tensor_model_parallel_size=2) as pgc:
        assert pgc.dp is not None
        assert pgc.tp is not None
        # rank = tp + 2·dp: mesh rows are dp, columns tp.
        mesh_2d = DeviceMesh.from_group(
            [pgc.dp, pgc.tp],
            "cpu",
            mesh=torch.tensor([[0, 1], [2, 3]]),
            mesh_dim_names=("dp", "tp"),
        )
        for shape, placements in CASES:
            out.append(_round_trip(mesh_2d, shape, placements))
        mesh_1d = DeviceMesh.from_group(pgc.tp, "cpu")
        out.append(_round_trip(mesh_1d, (5, 2), [Shard(0)]))
        out.append(_partial_rejected(mesh_1d))
    return out


def _round_trip(mesh: DeviceMesh, shape: tuple[int, ...], placements: list[Placement]) -> Any:
    full = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    sharded = distribute_tensor(full, mesh, placements, src_data_rank=None)
    sharded.tag = "kept"  # type: ignore[attr-defined]
    with mg.record_collectives() as unshard_log:
        unsharded = _unshard_if_dtensor(sharded)
    with mg.record_collectives() as reshard_log:
        back = _reshard_if_dtensor(unsharded * 2, sharded)
    assert isinstance(back, DTensor)
    return {
        "equal": torch.equal(unsharded, full),
        "tag": (getattr(unsharded, "tag", None), getattr(back, "tag", None)),
        "local": torch.equal(back.to_local(), sharded.to_local() * 2),
        "meta": (back.placements == sharded.placements, back.shape == sharded.shape),
        "gathers": [r.group_ranks for r in unshard_log],
        "reshard_log": len(reshard_log),
    }


def _partial_rejected(mesh: DeviceMesh) -> str:
    partial = DTensor.from_local(torch.ones(2), mesh, [Partial()], run_check=False)
    with mg.record_collectives() as log:
        try:
            _unshard_if_dtensor(partial)
        except TypeError as err:
            return f"{err} | collectives={len(log)}"
    return "no error"


def test_dtensor_unshard_reshard_round_trip(rank_pools: RankPools) -> None:
    for r, outs in enumerate(rank_pools.get(4).run(_round_trips)):
        tp, dp = (r & ~1, r | 1), (r % 2, r % 2 + 2)
        # Innermost mesh dim (tp) is gathered first, then dp; Replicate dims gather nothing.
        expected_gathers = [[tp, dp], [dp], [tp], [tp, dp], [tp]]
        for case, gathers in zip(outs[:5], expected_gathers, strict=True):
            assert case["equal"]
            assert case["tag"] == ("kept", "kept")
            assert case["local"]
            assert case["meta"] == (True, True)
            assert case["gathers"] == gathers
            assert case["reshard_log"] == 0
        assert "Partial" in outs[5]
        assert outs[5].endswith("collectives=0")


class _ModelParallelOnly(torch.nn.Module):
    """A chunk whose config is like Megatron's ``ModelParallelConfig``: no
    ``calculate_per_token_loss``."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("ModelParallelOnly", (), {"sequence_parallel": True})()

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        raise AssertionError("finalize_model_grads must refuse the config first")


def test_a_step_helper_takes_a_config_without_the_per_token_flag() -> None:
    """Megatron's ``ModelParallelConfig`` has no ``calculate_per_token_loss`` and its step
    helpers never read it; only ``finalize_model_grads`` requires it. A config without
    ``sequence_parallel`` is refused everywhere (every Megatron config has it)."""
    chunk: Any = _ModelParallelOnly()
    reset_model_temporary_tensors(chunk.config, [chunk])
    with pytest.raises(TypeError, match=r"lacks \['calculate_per_token_loss'\]"):
        finalize_model_grads([chunk])
    with pytest.raises(TypeError, match=r"lacks \['sequence_parallel'\]"):
        reset_model_temporary_tensors(cast(Any, object()), [chunk])
