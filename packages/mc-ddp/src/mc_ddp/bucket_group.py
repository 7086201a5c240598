"""``ParamAndGradBucketGroup``: the per-group state machine of DDP (FSDP2's param group).

A bucket group is one or more buckets whose collectives are issued together (one
coalesced batch). Its lifecycle in one training iteration::

    backward hooks ─ register_grad_ready(p) ─┐  counts == golden counts (after the first
                                             ├▶ start_grad_sync()   iteration, overlap on)
    finish_grad_sync() ──────────────────────┘  (starts it here otherwise), waits
    optimizer step writes this rank's param shard
    start_param_sync() / finish_param_sync()    all-gather params (distributed optimizer)
    reset()                                     from zero_grad_buffer(): next iteration
    discard_grad_sync()                         after a failed forward/backward: drain, forget

``start_grad_sync``: copy fp32 local ``main_grad`` s into the buffer, optional NaN/Inf and
large-grad checks, scale by ``gradient_scaling_factor``, then one coalesced collective per
group: reduce-scatter into this rank's shard (distributed optimizer) or all-reduce, with
``SUM`` or ``AVG`` (``average_in_collective``); with several optimizer instances the shard is
then all-reduced over ``inter_distributed_optimizer_instance_group`` (when the group
finishes: on CPU a chained collective cannot wait on a stream).

The group's collectives are bound once, at construction, on its
:class:`mc_groups.comm.communicator.Communicator`
(:meth:`mc_groups.comm.communicator.Communicator.bind`: the tensors and
options checked then): the gradient reduction (reduce-scatter into this rank's shard, or
all-reduce), the param all-gather and the gather of reduced shards for
``force_all_reduce``. A step only issues them. One collective per bucket, Megatron's
schedule: a group's buckets go as one list, one coalesced batch (a one-bucket group's
collective alone; on gloo one batch per dtype), the reduce-scatter's temporaries kept
between iterations. Every collective carries ``detail=layout_detail`` (the buckets' params
and a digest of their layout): shown in collective errors, compared by the schedule check,
so ranks whose buckets hold different params are told apart even at equal sizes.
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_buffers import ParamAndGradBuffer
from mc_buffers.buffer import ParamAndGradBucket
from mc_ddp._ddp_groups import require_live
from mc_ddp._iteration import ReadyCounts
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_ddp.grad_checks import LargeGradMonitor, check_buckets, check_finite_grads
from mc_groups.argcheck import check_flag, check_group, check_optional_group, check_str, type_name
from mc_groups.collection import is_group_live
from mc_groups.comm.communicator import BoundCollectives, Communicator
from mc_groups.errors import InputStateError, InputTypeError, InputValueError

__all__ = ["ParamAndGradBucketGroup", "partition_buckets"]

Param = torch.nn.Parameter

_SHOWN = 3
"""Params named per bucket in ``layout_detail``; its digest covers all of them."""


class ShardSpec(NamedTuple):
    """Where this rank's shards are: ``group``, its rank there and the shard count (bucket
    ``b`` splits into ``size`` equal views; rank ``rank`` owns ``b.grad_shard(rank, size)``
    and ``b.param_shard(rank, size)``)."""

    group: dist.ProcessGroup
    rank: int
    size: int


class ParamAndGradBucketGroup:
    """Buckets whose grad reductions and param all-gathers are issued together.

    Args:
        buckets: the buckets (of one or several buffers).
        ddp_config: the DDP config (overlap, distributed optimizer, checks, averaging).
        collective_group: the reduction group (``intra_dp_cp`` / ``intra_expt_dp``).
        inter_instance_group: ``inter_dist_opt`` with several optimizer instances.
        param_to_name: names for error messages.
        name: how messages and collective labels call this group (``"dense group 0"``).

    Megatron's state names are kept: ``params``, ``param_to_bucket``,
    ``per_param_grad_ready_counts``, ``golden_per_param_grad_ready_counts``,
    ``is_first_batch``, ``is_last_microbatch``, ``grad_reduce_handle``,
    ``grad_reduce_finished``, ``param_gather_handle``, ``param_gather_dispatched``,
    ``next_param_gather_bucket_group``. Also: ``shard`` (this rank's shard position:
    group, rank, shard count), ``name``, ``layout_detail`` (the buckets' params and layout
    digest, passed as ``detail=`` to every collective: shown in collective errors, compared
    by mc_groups' schedule check), ``collective_group``,
    ``inter_distributed_optimizer_instance_group`` and ``communicator`` (the
    :class:`mc_groups.comm.communicator.Communicator` of ``collective_group`` that issues the
    group's
    collectives and keeps their temporaries between iterations).
    """

    def __init__(
        self,
        buckets: Sequence[ParamAndGradBucket],
        ddp_config: DistributedDataParallelConfig,
        collective_group: dist.ProcessGroup,
        *,
        inter_instance_group: dist.ProcessGroup | None = None,
        param_to_name: Mapping[Param, str] | None = None,
        name: str = "bucket group",
    ) -> None:
        _check_arguments(buckets, ddp_config, collective_group, inter_instance_group, name)
        if param_to_name is not None and not isinstance(param_to_name, Mapping):
            raise InputTypeError(
                f"param_to_name must map params to names, got {type_name(param_to_name)}"
            )
        self.buckets = list(buckets)
        self.ddp_config = ddp_config
        self.collective_group = collective_group
        self.inter_distributed_optimizer_instance_group = inter_instance_group
        self.shard = ShardSpec(
            collective_group, mg.group_rank(collective_group), mg.group_size(collective_group)
        )
        self.name = name
        self._names = dict(param_to_name or {})
        self.param_to_bucket = {p: b for b in self.buckets for p in b.params_list}
        self.params: set[Param] = set(self.param_to_bucket)
        self.next_param_gather_bucket_group: ParamAndGradBucketGroup | None = None
        self._ready = ReadyCounts([p for b in self.buckets for p in b.params_list])
        self._slot_of = {id(p): i for i, p in enumerate(self._ready.params)}
        self.is_first_batch = True
        self.is_last_microbatch = True
        self.grad_reduce_handle: mg.CollectiveHandle | None = None
        self.grad_reduce_finished = False
        self.param_gather_handle: mg.CollectiveHandle | None = None
        self.param_gather_dispatched = False
        self._scattered = False
        self._large_grads = LargeGradMonitor(len(self.buckets))
        self.communicator = Communicator(collective_group)
        self.layout_detail = bucket_layout_detail(self.buckets, self._names)
        self._bind_collectives(inter_instance_group)

    def _bind_collectives(self, inter_group: dist.ProcessGroup | None) -> None:
        """The group's collectives, checked once (module notes). Views are taken now: the
        buffers keep their tensors for the group's life (offloading frees and restores the
        storage in place; a collective on offloaded memory is refused before issuing)."""
        cfg, rank, size = self.ddp_config, self.shard.rank, self.shard.size
        op = mg.ReduceOp.AVG if cfg.average_in_collective else mg.ReduceOp.SUM
        grads = [b.grad_data for b in self.buckets]
        self._grads = grads
        # this rank's shard of each bucket: laid out to split only with the distributed
        # optimizer (the only mode that reduce-scatters)
        shards = (
            [b.grad_shard(rank, size) for b in self.buckets]
            if cfg.use_distributed_optimizer
            else []
        )
        bind, detail = self.communicator.bind, self.layout_detail
        self._reduce_whole = bind(
            "all_reduce", grads, op=op, label=f"grad reduce {self.name}", detail=detail
        )
        self._reduce_shard = None
        self._gather_grads = None
        self._gather_params = None
        if cfg.use_distributed_optimizer:
            accumulate = torch.float32 if cfg.reduce_scatter_with_fp32_accumulation else None
            self._reduce_shard = bind(
                "reduce_scatter",
                list(zip(shards, grads, strict=True)),
                op=op,
                label=f"grad reduce {self.name}",
                detail=detail,
                accumulate_dtype=accumulate,
            )
            self._gather_grads = bind(
                "all_gather",
                list(zip(grads, shards, strict=True)),
                label=f"grad gather {self.name}",
                detail=detail,
            )
            params = [_param_data(b) for b in self.buckets]
            self._gather_params = bind(
                "all_gather",
                [(p, b.param_shard(rank, size)) for p, b in zip(params, self.buckets, strict=True)],
                label=f"param gather {self.name}",
                detail=detail,
            )
        self._across_instances: tuple[BoundCollectives, BoundCollectives] | None = None
        if inter_group is not None:  # the second stage of a multi-instance reduction
            inter = Communicator(inter_group)
            label = f"grad reduce across instances {self.name}"
            whole = inter.bind("all_reduce", grads, op=op, label=label, detail=detail)
            part = inter.bind("all_reduce", shards, op=op, label=label, detail=detail)
            self._across_instances = (part if shards else whole, whole)

    # -- bookkeeping ------------------------------------------------------------------

    @property
    def per_param_grad_ready_counts(self) -> dict[Param, int]:
        """Param → times it became ready this iteration (Megatron's state; a snapshot of
        the per-slot counts, :mod:`mc_ddp._iteration`; assigning a dict replaces them)."""
        return self._ready.as_dict()

    @per_param_grad_ready_counts.setter
    def per_param_grad_ready_counts(self, counts: dict[Param, int]) -> None:
        self._ready.assign(counts)

    @property
    def golden_per_param_grad_ready_counts(self) -> dict[Param, int]:
        """The first iteration's counts (Megatron's state), which later ones must reach
        before the hooks dispatch the reduction (a snapshot, as above)."""
        return self._ready.as_dict(golden=True)

    @golden_per_param_grad_ready_counts.setter
    def golden_per_param_grad_ready_counts(self, counts: dict[Param, int]) -> None:
        self._ready.assign(counts, golden=True)

    def check_reset(self) -> None:
        """Raise what :meth:`reset` would refuse (a reduction in flight; under overlap, a
        param without a gradient in the first iteration), changing nothing."""
        if self.grad_reduce_handle is not None:
            raise InputStateError(
                f"{self.name}: a gradient reduction is still in flight; call "
                "finish_grad_sync() before zero_grad_buffer()"
            )
        if self.is_first_batch and self._ready.ready:
            self._check_every_param_seen()

    def reset(self) -> None:
        """Prepare the next iteration: the first iteration's ready counts become the golden
        counts; clear counts and flags. Refuses while a grad reduction is in flight."""
        self.check_reset()
        if self.is_first_batch and self._ready.learn():
            self.is_first_batch = False
        self._ready.clear()
        self.is_last_microbatch = True
        self.grad_reduce_finished = False

    def discard_grad_sync(self) -> None:
        """Abandon this iteration's reduction after a failed forward or backward: wait for a
        reduction already issued (its peers issued it too, so it completes), skip what
        finishing adds (cross-instance all-reduce, fp32 copies back) and forget this
        iteration's ready counts, so an interrupted first iteration teaches nothing. The
        buffer keeps whatever was accumulated until ``zero_grad_buffer()``."""
        if self.grad_reduce_handle is not None:
            self.grad_reduce_handle.wait()
            self.grad_reduce_handle = None
        self._ready.clear()
        self.is_last_microbatch = True
        self.grad_reduce_finished = False

    def _check_every_param_seen(self) -> None:
        missing = self._ready.missing()
        if missing and self.ddp_config.overlap_grad_reduce:
            raise InputStateError(
                f"{self.name}: {self._name_list(missing)} got no gradient in the first "
                "iteration; with overlap_grad_reduce=True every trainable param must get one "
                "each iteration (set requires_grad=False on unused params; after a failed "
                "backward, call discard_grad_sync() first)"
            )

    def _name_list(self, params: Sequence[Param], limit: int = 3) -> str:
        names = [f"'{self._names.get(p, '<unnamed>')}'" for p in params[:limit]]
        more = f" and {len(params) - limit} more" if len(params) > limit else ""
        return f"param(s) {', '.join(names)}{more}"

    def register_grad_ready(self, param: Param, force_all_reduce: bool = False) -> None:
        """Count one ready gradient of ``param`` (last microbatch only); once every count
        equals the golden count (second iteration on) start the reduction. DDP's backward
        hook calls this once per param per backward: the checks here are the cheap ones
        (the param's slot, a bool); the count is a list update, the comparison with the
        golden counts runs once the number of ready gradients reaches the golden total.

        Only with ``overlap_grad_reduce`` (as Megatron asserts): without it nothing is
        dispatched from the hooks and ``finish_grad_sync`` reduces synchronously."""
        slot = self._slot_of.get(id(param))
        if slot is None:
            raise InputValueError(
                f"{self.name}: register_grad_ready() got a param (shape "
                f"{tuple(getattr(param, 'shape', ()))}) that is not in this bucket group"
            )
        flag: object = force_all_reduce  # callers may pass anything
        if flag is not True and flag is not False:
            check_flag("force_all_reduce", flag)
        if not self.ddp_config.overlap_grad_reduce:
            raise InputStateError(
                f"{self.name}: register_grad_ready() should only be called when "
                "overlap_grad_reduce is True (without it finish_grad_sync() reduces the "
                "bucket group synchronously)"
            )
        if not self.is_last_microbatch:
            return
        if self.grad_reduce_finished:
            self._refuse_late_grad(param)
        ready = self._ready
        ready.counts[slot] += 1
        ready.ready += 1
        complete = ready.ready == ready.golden_total and ready.counts == ready.golden
        if complete and not self.is_first_batch:
            self.start_grad_sync(force_all_reduce=force_all_reduce)

    def _refuse_late_grad(self, param: Param) -> None:
        """A gradient after ``finish_grad_sync`` in the same iteration would be added to
        grads already reduced (and, with the distributed optimizer, already sharded)."""
        if self.grad_reduce_finished:
            raise InputStateError(
                f"{self.name}: a gradient of {self._name_list([param])} arrived after "
                "finish_grad_sync() in the same iteration; call zero_grad_buffer() before the "
                "next forward/backward"
            )

    def _dispatches_from_hooks(self) -> bool:
        return self.ddp_config.overlap_grad_reduce and not self.is_first_batch

    # -- gradients --------------------------------------------------------------------

    def _prepare_grads(self) -> None:
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                mg.param_attrs.main_grad_copy_of(param).copy_(mg.param_attrs.main_grad_of(param))
        if self.ddp_config.check_for_nan_in_grad:
            check_finite_grads(self.buckets, self._names, self.name, groups=self._check_groups())
        if self.ddp_config.check_for_large_grads:
            self._large_grads.check(self.buckets, self.name)
        for bucket, grads in zip(self.buckets, self._grads, strict=True):
            if bucket.gradient_scaling_factor != 1.0:
                grads.mul_(bucket.gradient_scaling_factor)

    def _check_groups(self) -> list[dist.ProcessGroup]:
        """Every rank this group's reduction reaches: its own group, then the other
        optimizer instances (so all of them learn of a non-finite gradient together)."""
        inter = self.inter_distributed_optimizer_instance_group
        return [self.collective_group] + ([] if inter is None else [inter])

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Check, scale and issue this group's reduction (async with overlap_grad_reduce).

        In the first iteration a second call is a no-op once a reduction is in flight;
        later, a second call before :meth:`finish_grad_sync` is an error.
        """
        flag: object = force_all_reduce  # callers may pass anything
        if flag is not True and flag is not False:
            check_flag("force_all_reduce", flag)
        if self.grad_reduce_handle is not None:
            if self.is_first_batch:
                return
            raise InputStateError(
                f"{self.name}: start_grad_sync() called while its reduction is in flight; "
                "call finish_grad_sync() first"
            )
        self._require_communicable("start_grad_sync()")
        self._wait_param_gather()
        self._prepare_grads()
        shard = None if force_all_reduce else self._reduce_shard
        reduction = self._reduce_whole if shard is None else shard
        self.grad_reduce_handle = reduction.issue(self.ddp_config.overlap_grad_reduce)
        self._scattered = shard is not None

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        """Complete this group's reduction; starts it first when no hook did (no overlap,
        or the first iteration).

        As Megatron's: with ``overlap_grad_reduce`` a second call in the iteration is a
        no-op; without it every call reduces the buffer as it is now (a synchronous
        collective per call). ``DistributedDataParallel.finish_grad_sync`` calls this once
        per iteration, so a wrapped model's grads are never reduced twice.

        ``force_all_reduce``: every rank ends with the full reduced gradients even in
        distributed-optimizer mode (an all-reduce; a reduce-scatter already issued by a
        hook is completed with an all-gather of the shards, which gives the same values).
        """
        flag: object = force_all_reduce  # callers may pass anything
        if flag is not True and flag is not False:
            check_flag("force_all_reduce", flag)
        if not (self.grad_reduce_finished and self.ddp_config.overlap_grad_reduce):
            self._require_communicable("finish_grad_sync()")
        self._finish_grad_sync(force_all_reduce)

    def _finish_grad_sync(self, force_all_reduce: bool) -> None:
        """:meth:`finish_grad_sync` once its argument and the group's state are checked
        (``DistributedDataParallel.finish_grad_sync`` checks them once for all its groups)."""
        self.param_gather_dispatched = False
        if self.grad_reduce_finished and self.ddp_config.overlap_grad_reduce:
            return
        if self.grad_reduce_handle is None:
            if self._dispatches_from_hooks():
                raise InputStateError(self._ready.not_dispatched(self.name, self._names))
            self.start_grad_sync(force_all_reduce=force_all_reduce)
        self._complete_grad_sync(force_all_reduce)

    def _complete_grad_sync(self, force_all_reduce: bool) -> None:
        assert self.grad_reduce_handle is not None  # set by start_grad_sync
        self.grad_reduce_handle.wait()
        self.grad_reduce_handle = None
        if self._across_instances is not None:
            shards, whole = self._across_instances
            (shards if self._scattered else whole).issue()
        if force_all_reduce and self._scattered:
            assert self._gather_grads is not None  # bound with the distributed optimizer
            self._gather_grads.issue()  # the full reduced grads an all-reduce would give
        for bucket in self.buckets:
            for param in bucket.params_with_extra_main_grads:
                mg.param_attrs.main_grad_of(param).copy_(mg.param_attrs.main_grad_copy_of(param))
        self.grad_reduce_finished = True

    def _require_live(self, what: str) -> None:
        inter = self.inter_distributed_optimizer_instance_group
        if is_group_live(self.collective_group) and (inter is None or is_group_live(inter)):
            return  # the common case: no message built
        groups = [(f"the reduction group of {self.name}", self.collective_group)]
        require_live([*groups, (f"the inter-instance group of {self.name}", inter)], what)

    def _require_communicable(self, what: str) -> None:
        """Live groups and resident grads, before anything is written or issued (a write
        into an offloaded bucket corrupts freed memory)."""
        self._require_live(what)
        offloaded = [b.bucket_id for b in self.buckets if b.is_grad_data_offloaded]
        if offloaded:  # a write into the freed storage would corrupt memory
            raise InputStateError(
                f"{self.name}: {what}: the grad buffer of bucket(s) {offloaded} is offloaded "
                "(its storage is freed); call ddp.restore_grad_buffers() (or the buffer's "
                "reload_from_cpu()) first"
            )

    # -- params (distributed optimizer) -----------------------------------------------

    def _replicated_param_sync(self) -> bool:
        """``overlap_param_gather`` without the distributed optimizer (Megatron accepts it
        for its layer-wise optimizer): every rank updates and holds every param, so nothing
        is gathered and the sync is complete as dispatched (True). A layer-wise optimizer
        that shards the params over ranks (it sets ``layerwise_param_flat_sizes`` on the
        buckets) would need the gather mc does not have: refused rather than skipped."""
        if self.ddp_config.use_distributed_optimizer or not self.ddp_config.overlap_param_gather:
            return False
        sharded = [
            b.bucket_id for b in self.buckets if any(getattr(b, "layerwise_param_flat_sizes", ()))
        ]
        if sharded:
            raise NotImplementedError(
                f"{self.name}: bucket(s) {sharded} carry layerwise_param_flat_sizes (Megatron's "
                "LayerWiseDistributedOptimizer shards the params); mc gathers params only for "
                "use_distributed_optimizer=True"
            )
        self.param_gather_dispatched = True
        return True

    @property
    def intra_distributed_optimizer_instance_group(self) -> dist.ProcessGroup:
        """The group this bucket group reduces (and, with the distributed optimizer,
        shards) over: dp × cp within one optimizer instance (Megatron's name)."""
        return self.shard.group

    @property
    def intra_distributed_optimizer_instance_size(self) -> int:
        """Ranks of :attr:`intra_distributed_optimizer_instance_group`."""
        return mg.group_size(self.shard.group)

    @property
    def intra_distributed_optimizer_instance_rank(self) -> int:
        """This rank's position in :attr:`intra_distributed_optimizer_instance_group`."""
        return mg.group_rank(self.shard.group)

    def _require_param_buffers(self, what: str) -> None:
        if not self.ddp_config.use_distributed_optimizer:
            raise InputStateError(
                f"{self.name}: {what} needs use_distributed_optimizer=True (params live in "
                "the buffer only then)"
            )

    def start_param_sync(self, force_sync: bool = False) -> None:
        """All-gather every bucket's params from the shards (async with
        overlap_param_gather unless ``force_sync``; ``force_sync`` with a gather in flight
        only waits for it)."""
        flag: object = force_sync  # callers may pass anything
        if flag is not True and flag is not False:
            check_flag("force_sync", flag)
        if self._replicated_param_sync():
            return
        self._require_param_buffers("start_param_sync()")
        if self.grad_reduce_handle is not None:
            raise InputStateError(
                f"{self.name}: start_param_sync() while its gradient reduction is in flight; "
                "call finish_grad_sync() first"
            )
        if self.param_gather_handle is not None:
            if not force_sync:
                raise InputStateError(
                    f"{self.name}: start_param_sync() while its all-gather is in flight; call "
                    "finish_param_sync() (or start_param_sync(force_sync=True)) first"
                )
            self.param_gather_handle.wait()
            self.param_gather_handle = None
            return
        self._require_live("start_param_sync()")
        offloaded = [b.bucket_id for b in self.buckets if b.is_param_data_offloaded]
        if offloaded:
            raise InputStateError(
                f"{self.name}: start_param_sync(): the params of bucket(s) {offloaded} are "
                "offloaded (offload_to_cpu(move_params=True)); call the buffer's "
                "reload_from_cpu(move_params=True) first"
            )
        async_op = self.ddp_config.overlap_param_gather and not force_sync
        assert self._gather_params is not None  # bound with the distributed optimizer
        pending = self._gather_params.issue(async_op)
        self.param_gather_handle = pending if async_op else None
        self.param_gather_dispatched = True

    def finish_param_sync(self, skip_next_bucket_dispatch: bool = False) -> None:
        """Wait for this group's all-gather (dispatching it if nobody did), then dispatch
        the next group's (model-start-first chain) unless ``skip_next_bucket_dispatch``."""
        check_flag("skip_next_bucket_dispatch", skip_next_bucket_dispatch)
        if not self.ddp_config.overlap_param_gather:
            raise InputStateError(
                f"{self.name}: finish_param_sync() needs overlap_param_gather=True; without "
                "it start_param_sync() is synchronous and complete on return"
            )
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handle is None:
            return
        self.param_gather_handle.wait()
        self.param_gather_handle = None
        if not skip_next_bucket_dispatch:
            self._dispatch_next_param_gather()

    def _dispatch_next_param_gather(self) -> None:
        nxt = self.next_param_gather_bucket_group
        if nxt is None:
            return
        if nxt.param_gather_dispatched:
            warnings.warn(
                f"the param all-gather of {nxt.name}, next after {self.name}, was already "
                "dispatched: the forward pass runs modules in a different order than their "
                "params were registered, which hurts the overlap of all-gather and compute",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        nxt.start_param_sync()

    def free_overlap_buffers(self) -> None:
        """Drain an in-flight param all-gather, then release the temporaries the group's
        ``communicator`` keeps (unless a gradient reduction using them is in flight);
        the next collective that needs them allocates again."""
        self._wait_param_gather()
        for bucket in self.buckets:
            bucket.layerwise_gather_list = None
        if self.grad_reduce_handle is None:
            self.communicator.free()

    def _wait_param_gather(self) -> None:
        """Complete an in-flight param all-gather (before the grad reduction is issued, and
        before an optimizer step writes the shards it reads)."""
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None

    def __repr__(self) -> str:
        return (
            f"ParamAndGradBucketGroup({self.name}, buckets={[b.bucket_id for b in self.buckets]}"
            f", params={len(self.params)}, group ranks={list(mg.group_ranks(self.shard.group))})"
        )


def _check_arguments(
    buckets: object,
    ddp_config: object,
    group: object,
    inter_group: object,
    name: object,
) -> None:
    check_buckets(buckets)
    if not isinstance(ddp_config, DistributedDataParallelConfig):
        raise InputTypeError(
            f"ddp_config={type_name(ddp_config)} must be a mc_ddp.DistributedDataParallelConfig"
        )
    check_group("collective_group", group)
    check_optional_group("inter_instance_group", inter_group)
    check_str("name", name)


def _check_buffers(buffers: object) -> None:
    if isinstance(buffers, str) or not isinstance(buffers, Sequence):
        raise InputTypeError(
            f"buffers must be a sequence of ParamAndGradBuffer, got {type_name(buffers)}"
        )
    for i, buf in enumerate(buffers):
        if not isinstance(buf, ParamAndGradBuffer):
            raise InputTypeError(f"buffers[{i}] is a {type_name(buf)}, not a ParamAndGradBuffer")


def partition_buckets(
    buffers: Sequence[ParamAndGradBuffer], force_single_bucket_group: bool = False
) -> list[list[ParamAndGradBucket]]:
    """Which buckets share a group: every bucket of every buffer in one group with
    ``force_single_bucket_group``, else one group per bucket (buffer order, then bucket
    order, so group 0 holds the end of the model)."""
    check_flag("force_single_bucket_group", force_single_bucket_group)
    _check_buffers(buffers)
    if force_single_bucket_group:
        return [[b for buf in buffers for b in buf.buckets]] if buffers else []
    return [[b] for buf in buffers for b in buf.buckets]


def _param_data(bucket: ParamAndGradBucket) -> torch.Tensor:
    if bucket.param_data is None:
        raise RuntimeError(
            f"bucket {bucket.bucket_id} has no param_data: params are gathered only with "
            "use_distributed_optimizer=True"
        )
    return bucket.param_data


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
