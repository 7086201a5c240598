"""The peers of the host-cost benchmark: Megatron-Core (when importable) and DTensor.

Megatron-Core is optional: the benchmark runs its rows only when ``megatron.core`` imports.
On a machine without CUDA the megatron-core wheel needs a shim before it imports (it
imports triton, allocates on ``torch.cuda.current_device()``, ...). Set
``MC_MEGATRON_SHIM`` to a directory holding such a shim as ``cpu_shim.py`` (the upstream
test harness has one) and run the benchmark with a Python that has megatron-core
installed; the ranks import the shim before ``megatron.core``. Without it the Megatron
rows are skipped and the reason is printed.

Megatron's objects are built over the same ``torch.distributed`` groups as mc's (its
``ProcessGroupCollection`` filled from mc's), so neither needs ``parallel_state``.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import mc_groups as mg
from benchmarks import _common

CPU = torch.device("cpu")

SHIM_VARIABLE = "MC_MEGATRON_SHIM"

Block = Callable[[torch.Tensor], torch.Tensor]


def import_megatron() -> tuple[ModuleType | None, str]:
    """``megatron.core`` (after the shim of ``MC_MEGATRON_SHIM``, when set), or None and
    why it is not importable."""
    shim = os.environ.get(SHIM_VARIABLE)
    try:
        if shim:
            if shim not in sys.path:
                sys.path.insert(0, shim)
            importlib.import_module("cpu_shim")
        core = importlib.import_module("megatron.core")
        for name in ("distributed", "tensor_parallel", "transformer", "process_groups_config"):
            importlib.import_module(f"megatron.core.{name}")
    except Exception as error:  # any failure means "not available here", with the reason
        hint = "" if shim else f" (on CPU set {SHIM_VARIABLE} to a directory with cpu_shim.py)"
        return None, f"megatron.core not importable: {type(error).__name__}: {error}{hint}"
    return core, f"megatron-core {getattr(core, '__version__', '?')}"


def megatron_groups(core: ModuleType, pgc: mg.ProcessGroupCollection) -> Any:
    """Megatron's ``ProcessGroupCollection`` holding mc's groups (fields set one by one,
    as Megatron's dataclass asks)."""
    collection = core.process_groups_config.ProcessGroupCollection()
    for field in ("tp", "pp", "ep", "dp", "dp_cp", "expt_dp", "intra_dp_cp", "intra_expt_dp"):
        setattr(collection, field, getattr(pgc, field))
    return collection


def megatron_ddp(
    core: ModuleType, pgc: mg.ProcessGroupCollection, model: nn.Module, **fields: Any
) -> Any:
    """Megatron-Core's ``DistributedDataParallel`` over ``model`` (config ``fields``)."""
    config = core.transformer.TransformerConfig(
        num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True
    )
    ddp_config = core.distributed.DistributedDataParallelConfig(**fields)
    return core.distributed.DistributedDataParallel(
        config, ddp_config, model, pg_collection=megatron_groups(core, pgc)
    )


def megatron_block(
    core: ModuleType, h: int, tp: int, sp: bool, group: Any, device: torch.device = CPU
) -> tuple[Block, list]:  # type: ignore[type-arg]
    """Megatron-Core's ``Column(h → 4h) → GELU → Row(4h → h)`` over ``group`` and its params
    (initialised on CPU, then moved to ``device``)."""
    tpl, state = core.tensor_parallel, core.parallel_state
    if state._GLOBAL_MEMORY_BUFFER is None:  # SP's all-gather staging (parallel_state's)
        state._set_global_memory_buffer()
    config = core.model_parallel_config.ModelParallelConfig(
        tensor_model_parallel_size=tp, sequence_parallel=sp, use_cpu_initialization=True
    )
    return _common.column_row_block(tpl, h, config, device, tp_group=group)


def dtensor_block(
    h: int, tp: int, sp: bool, device: torch.device = CPU
) -> tuple[Block, list[torch.Tensor]]:
    """The same block as ``nn.Sequential`` parallelised by ``torch.distributed.tensor``."""
    mesh = init_device_mesh(device.type, (tp,))
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h)).to(device)
    if sp:
        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
        }
    else:
        plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    parallelize_module(block, mesh, plan)
    return block, list(block.parameters())


@contextmanager
def fake_world(world_size: int) -> Iterator[str | None]:
    """This process as rank 0 of ``world_size`` over torch's fake process group (every
    collective returns at once and moves nothing: what is left is host time); yields None,
    or why it is not available (it lives in ``torch.testing._internal``)."""
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415
    except ImportError as error:
        yield f"torch's fake process group not importable: {error}"
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield None
    finally:
        dist.destroy_process_group()


@contextmanager
def one_rank_world(device: torch.device) -> Iterator[None]:
    """This process as the only rank of a world (an in-memory store; gloo on CPU, NCCL on
    a GPU): every library's DDP runs as it does on more ranks (hooks, buckets, one
    collective per bucket), but no peer is waited for and a collective is a local copy."""
    store = dist.HashStore()  # type: ignore[attr-defined]  # not re-exported in the stubs
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
