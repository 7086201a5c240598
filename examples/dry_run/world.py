"""Joining torch's fake process-group backend as one rank of a large world, in this process.

torch 2.13 ships the backend as a test utility: importing
``torch.testing._internal.distributed.fake_pg`` registers the ``"fake"`` backend, and its
``FakeStore`` satisfies ``init_process_group``'s rendezvous without any peer. On that
backend every collective returns at once without moving data (a completed work object);
``new_group`` builds a ``FakeProcessGroup`` with this rank's rank and size. So mc's code
runs on rank r of N exactly as it would on a real world (group creation, layouts,
validation, the recorder), and the only thing missing is the data: which is why the dry
run's tensors live on the meta device.

One gap, filled here: torch 2.13 registers meta kernels for the single collectives
(``c10d::_allgather_base_``, ``_reduce_scatter_base_``, ``allreduce_``, ...) but not for
the coalesced ones that ``torch.distributed._coalescing_manager`` issues (mc DDP coalesces
the buckets of one bucket group, e.g. the last pipeline stage's tied-embedding bucket and
its other bucket), so a coalesced batch of meta tensors fails with "no fake impl or Meta
kernel registered". :func:`fake_world` registers a Meta kernel for each of them that
returns a completed ``FakeWork``, as the fake backend itself does: nothing else changes
(CPU and CUDA tensors never reach a Meta kernel), and mc's collective layer, which records
each collective of a batch as it is added, runs its ordinary NCCL-style path.

Measured (torch 2.13, this project's shared 2-core machine, ``benchmarks/dry_run_scale.py``):
``new_group`` costs about 30 us on the fake backend, and ``initialize_model_parallel``
creating every group of a TP=8 × PP=8 layout (5,768 groups at 4096 ranks, 11,464 at 8192,
most of them placeholders this rank is not in, plus mc's rank arithmetic) takes a median of
0.5–1.6 s at 4096 ranks and 1.2–1.7 s at 8192 over runs of the benchmark: linear in the
world and small next to a 30 s budget, so mc-groups needs no fake-specific path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import FakeWork
from torch.testing._internal.distributed.fake_pg import FakeStore  # registers "fake"

__all__ = ["FAKE_BACKEND", "fake_world"]

FAKE_BACKEND = "fake"
"""The backend name torch registers for its fake process group."""

_COALESCED_OPS = (
    "allgather_into_tensor_coalesced_",
    "reduce_scatter_tensor_coalesced_",
    "allreduce_coalesced_",
)


class _MetaKernels:
    """The Meta kernels of the coalesced c10d ops (registered once per process; the
    library object must stay alive for the registration to last)."""

    library: torch.library.Library | None = None

    @classmethod
    def register(cls) -> None:
        if cls.library is not None:
            return

        def completed(*_args: Any, **_kwargs: Any) -> Any:
            return FakeWork().boxed()

        # torch.library's Library and impl carry no annotations in torch 2.13
        library = torch.library.Library("c10d", "IMPL")  # type: ignore[no-untyped-call]
        for op in _COALESCED_OPS:
            if not torch._C._dispatch_has_kernel_for_dispatch_key(f"c10d::{op}", "Meta"):
                library.impl(op, completed, "Meta")  # type: ignore[no-untyped-call]
        cls.library = library


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[None]:
    """This process is rank ``rank`` of a fake world of ``world_size`` ranks inside the
    ``with`` block (the default process group is destroyed on exit).

    Raises ``RuntimeError`` when the process already has a default process group (a real
    run: the dry run would replace it), ``ValueError`` for a rank outside the world.
    """
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: this process already has a default process group (backend "
            f"{dist.get_backend()!r}); run the dry run in a process of its own"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of {world_size} ranks")
    _MetaKernels.register()
    dist.init_process_group(
        FAKE_BACKEND,
        store=FakeStore(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=60),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
