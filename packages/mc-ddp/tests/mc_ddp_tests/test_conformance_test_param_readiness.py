"""Conformance with Megatron-LM's ``tests/unit_tests/distributed/test_param_readiness.py``.

Every upstream test there is held by ``test_param_ready.py`` (fake DDP and bucket-group
objects driving ``ensure_params_ready`` and ``_BucketParamReadyCallback``, plus a 2-rank read
ahead). Upstream's fake DDP is a real ``DistributedDataParallel`` made with ``object.__new__``,
so its callback runs DDP's own ``_finish_param_sync_for_bucket_group``; mc's callback calls the
group's ``finish_param_sync`` itself, with the same observable result. What the upstream
setup also fixes is that DDP method's meaning, held here the same way (no processes).
"""

from __future__ import annotations

from typing import Any

from mc_ddp import DistributedDataParallel


class _Config:
    def __init__(self, align_param_gather: bool) -> None:
        self.align_param_gather = align_param_gather


class _FakeBucketGroup:
    """Records what DDP asks of it: finishes (with their skip flag) and plain drains."""

    def __init__(self) -> None:
        self.finished: list[bool] = []
        self.drained = 0
        self.param_gather_dispatched = False
        self.param_gather_handle: object | None = None

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        self.finished.append(skip_next_bucket_dispatch)
        self.param_gather_dispatched = True
        self.param_gather_handle = None

    def free_overlap_buffers(self) -> None:
        self.drained += 1


def _bare_ddp(align_param_gather: bool, optimizer_step_dispatches: bool) -> Any:
    """A DDP object with only the state the method reads (upstream's ``_fake_ddp``)."""
    ddp: Any = object.__new__(DistributedDataParallel)
    ddp.ddp_config = _Config(align_param_gather)
    ddp.overlap_param_gather_with_optimizer_step = optimizer_step_dispatches
    ddp.remove_forward_pre_hook_handles = {object(): object()}
    return ddp


def test_finish_param_sync_for_bucket_group_finishes_the_groups_gather() -> None:
    """Follows ``tests/unit_tests/distributed/test_param_readiness.py::TestBucketParamReadiness::
    {test_publishes_once_then_is_idempotent, test_align_param_gather_skips_next_bucket_dispatch}``.

    Reading: in those tests the callback reaches the bucket group through
    ``DistributedDataParallel._finish_param_sync_for_bucket_group``, and the group's
    ``finish_param_sync`` is what records ``[False]`` (chain the next group's gather) or, with
    ``align_param_gather``, ``[True]`` (skip it). So the method is "the group's
    finish_param_sync, skipping the next dispatch when the caller or the optimizer step owns
    it": on an undispatched group it starts and waits the gather. (mc's method used to only
    drain an in-flight gather, recording nothing here.)
    """
    for align, optimizer_step, expected in (
        (False, False, [False]),
        (True, False, [True]),
        (False, True, [True]),
    ):
        ddp = _bare_ddp(align, optimizer_step)
        group = _FakeBucketGroup()
        ddp._finish_param_sync_for_bucket_group(group)
        assert group.finished == expected, (align, optimizer_step)
