"""``DistributedDataParallel``: Megatron-Core's DDP wrapper over contiguous grad buffers.

One training iteration (``dp`` = data × context parallel ranks)::

    ddp.zero_grad_buffer()                  zero main_grad, reset bucket-group state
    for each microbatch but the last:       with ddp.no_sync(): loss.backward()
        backward hook per param             main_grad += param.grad; param.grad = None
    last microbatch: loss.backward()        + each bucket group's collective is issued from
                                              the hook that completes it (overlap, after the
                                              first iteration)
    ddp.finish_grad_sync()                  wait (or issue + wait): main_grad (or this
                                              rank's shard of it) = Σ_ranks grad / dp
    optimizer step                          e.g. mc_ddp.ShardedOptimizer
    [distributed optimizer] param all-gather: in the optimizer step, or overlapped with
                                              the next forward by forward pre-hooks

Buckets: params in reverse registration order (bucket 0 = end of the model, ready first),
one buffer per (param dtype, grad dtype, expert) key; each bucket is its own group unless
``disable_bucketing``. Collectives go through ``mc_groups`` (so ``record_collectives`` sees
them): dense grads over ``intra_dp_cp``, expert grads (``param.allreduce = False``) over
``intra_expt_dp``, the cross-instance all-reduce over ``inter_dist_opt`` (dense) and
``inter_expt_dp`` (expert).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Generic

import torch
from torch.utils.hooks import RemovableHandle
from typing_extensions import TypeVar

import mc_groups as mg
from mc_buffers import FullParamLayout, ParamAndGradBuffer
from mc_ddp import _ddp_build as build
from mc_ddp import _ddp_checks as checks
from mc_ddp._groups import DDPGroups, collection_or_default, resolve_groups
from mc_ddp._hooks import BackwardPostHook, ForwardPreHook
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp.config import DistributedDataParallelConfig
from mc_ddp.param_ready import PARAM_READY_CALLBACK_ATTR, _BucketParamReadyCallback
from mc_ddp.protocols import TransformerConfigLike
from mc_groups import device as mg_device

__all__ = ["DistributedDataParallel", "_BucketParamReadyCallback", "logger"]

logger = logging.getLogger(__name__)

Param = torch.nn.Parameter

ConfigT_co = TypeVar(
    "ConfigT_co", bound=TransformerConfigLike, default=TransformerConfigLike, covariant=True
)
"""The wrapped config's type, kept so consumers (mc_finalize) can read more of it."""


class DistributedDataParallel(torch.nn.Module, Generic[ConfigT_co]):
    """DDP wrapper which stores grads in contiguous buffers, reduces them bucket by bucket
    (overlapped with backward when configured) and, in distributed-optimizer mode, keeps
    params in the buffer and all-gathers them after the optimizer step.

    Generic in the config's type: ``DistributedDataParallel(ModelParallelConfig(...), ...)``
    is a ``DistributedDataParallel[ModelParallelConfig]``, whose ``config`` keeps every
    attribute a consumer such as ``mc_finalize.finalize_model_grads`` reads.

    Args:
        config: any object with ``calculate_per_token_loss`` (:class:`TransformerConfigLike`).
        ddp_config: the :class:`DistributedDataParallelConfig`.
        module: the model (chunk) to wrap; at least one param must require grad, all on
            one device.
        disable_bucketing: one bucket per buffer and one bucket group for all of them.
        pg_collection: groups ``dp`` and ``dp_cp`` (required), ``pp`` (optional: stage 0),
            ``expt_dp`` (with expert params), ``intra_dp_cp`` / ``inter_dist_opt`` (with
            several optimizer instances; ``intra_expt_dp`` / ``inter_expt_dp`` too when
            there are expert params); None: the registered default collection.
        full_param_layout: precomputed layouts per buffer key (mc_buffers).

    Bucket size: ``ddp_config.bucket_size``, ``num_buckets`` → total // num_buckets, or
    ``max(40M, 1M · |dp_cp|)``; one bucket without overlap_grad_reduce, on pipeline stages
    > 0 or with ``disable_bucketing``. Scaling before the collective: 1/|dp_cp| (SUM),
    1 with ``average_in_collective`` (AVG; experts |expt_dp|/|dp_cp|), 1 with
    ``calculate_per_token_loss``. ``average_in_collective`` is refused with per-token loss
    and with an active gtp_remat group (ValueError before anything is built).
    """

    def __init__(
        self,
        config: ConfigT_co,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        disable_bucketing: bool = False,
        pg_collection: mg.ProcessGroupCollection | None = None,
        full_param_layout: FullParamLayout | None = None,
    ) -> None:
        checks.check_config(config)
        checks.check_ddp_config(ddp_config)
        named = checks.trainable_params(module)
        single = checks.check_flag("disable_bucketing", disable_bucketing)
        has_expert = any(not getattr(p, "allreduce", True) for _, p in named)
        groups = resolve_groups(collection_or_default(pg_collection), ddp_config, has_expert)
        scaling = build.gradient_scaling(config, ddp_config, groups)  # may refuse: before state
        super().__init__()
        self.module = module
        self._config = config
        self.ddp_config = ddp_config
        self._set_groups(groups)
        self.param_to_name: dict[Param, str] = {p: n for n, p in named}
        self.params_with_grad: list[Param] = [p for _, p in named]
        self._build(groups, scaling, disable_bucketing=single, full_param_layout=full_param_layout)
        self.force_all_reduce = False
        self.overlap_param_gather_with_optimizer_step = False
        self.use_forward_hook = ddp_config.use_distributed_optimizer and (
            ddp_config.overlap_param_gather
        )
        self.remove_forward_pre_hook_handles: dict[torch.nn.Module, RemovableHandle] = {}
        self._grad_hook_handles = self._register_backward_hooks()
        if self.use_forward_hook:
            self._register_param_ready_callbacks()
            self.enable_forward_pre_hook()

    @property
    def config(self) -> ConfigT_co:
        """The transformer config passed at construction (read-only)."""
        return self._config

    # -- construction -----------------------------------------------------------------

    def _set_groups(self, groups: DDPGroups) -> None:
        self.groups = groups
        self.dp_group = groups.dp
        self.dp_cp_group = groups.dp_cp
        self.intra_dp_cp_group = groups.intra_dp_cp
        self.inter_dist_opt_group = groups.inter_dist_opt
        self.expt_dp_group = groups.expt_dp
        self.intra_expt_dp_group = groups.intra_expt_dp
        self.inter_expt_dp_group = groups.inter_expt_dp
        self.pp_group = groups.pp

    def _build(
        self,
        groups: DDPGroups,
        scaling: build.Scaling,
        *,
        disable_bucketing: bool,
        full_param_layout: FullParamLayout | None,
    ) -> None:
        cfg = self.ddp_config
        total = sum(p.numel() for p in self.params_with_grad)
        self.bucket_size = build.resolve_bucket_size(
            cfg, total, mg.group_size(groups.dp_cp), groups.pipeline_rank, disable_bucketing
        )
        for param in self.params_with_grad:
            param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        buffers = build.build_buffers(
            self.params_with_grad,
            self.param_to_name,
            cfg,
            groups,
            self.bucket_size,
            scaling,
            full_param_layout,
        )
        # Megatron's name: it shadows nn.Module.buffers() on purpose (ported code reads
        # ddp.buffers as the grad buffers); use named_buffers() for module buffers.
        self.buffers: list[ParamAndGradBuffer] = buffers.dense  # type: ignore[assignment]
        self.expert_parallel_buffers: list[ParamAndGradBuffer] = buffers.expert
        names, inter = self.param_to_name, groups.inter_dist_opt
        self.bucket_groups = build.build_bucket_groups(
            buffers.dense, cfg, groups.intra_dp_cp, inter, names, "dense", disable_bucketing
        )
        self.expert_parallel_bucket_groups = build.build_bucket_groups(
            buffers.expert,
            cfg,
            groups.intra_expt_dp,
            groups.inter_expt_dp,
            names,
            "expert",
            disable_bucketing,
        )
        self.param_to_bucket_group: dict[Param, ParamAndGradBucketGroup] = {
            p: g for g in self._all_groups() for p in g.params
        }

    def _all_groups(self) -> list[ParamAndGradBucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def _all_buffers(self) -> list[ParamAndGradBuffer]:
        return self.buffers + self.expert_parallel_buffers

    def _register_backward_hooks(self) -> list[RemovableHandle | None]:
        handles: list[RemovableHandle | None] = []
        for param in self.params_with_grad:
            hook = self._make_backward_post_hook(param)
            if self.ddp_config.delay_wgrad_compute and getattr(
                param, "skip_backward_post_hook", False
            ):
                owner = checks.find_wgrad_hook_owner(self.module, param, self.param_to_name[param])
                owner.register_wgrad_accumulation_and_reduce_hooks(hook)  # type: ignore[operator]
                handles.append(None)
            else:
                handles.append(param.register_post_accumulate_grad_hook(hook))  # type: ignore[no-untyped-call]
        return handles

    def _register_param_ready_callbacks(self) -> None:
        for group in self._all_groups():
            callback = _BucketParamReadyCallback(self, group)
            for param in group.params:
                setattr(param, PARAM_READY_CALLBACK_ATTR, callback)

    # -- hooks ------------------------------------------------------------------------

    def _make_backward_post_hook(self, param: Param) -> BackwardPostHook:
        """A hook to run after ``param``'s grad is accumulated: add ``param.grad`` into
        ``param.main_grad`` (unless the layer already did: ``grad_added_to_main_grad``, or
        ``zero_out_wgrad``), drop ``param.grad``, mark the param ready; the completing hook
        of a bucket group dispatches its reduction (overlap, after the first iteration)."""
        return BackwardPostHook(self, param)

    def _on_grad_ready(self, param: Param) -> None:
        group = self.param_to_bucket_group.get(param)
        if group is None:
            return
        grad = param.grad
        if grad is not None and (
            not getattr(param, "grad_added_to_main_grad", False)
            or getattr(param, "zero_out_wgrad", False)
        ):
            param.main_grad.add_(grad)  # type: ignore[attr-defined]
        param.grad = None
        group.register_grad_ready(param, self.force_all_reduce)

    def _make_forward_pre_hook(self) -> ForwardPreHook:
        """A pre-hook that waits for the all-gather of the module's own params (starting it
        if undispatched) and dispatches the next group's, unless ``align_param_gather`` or
        the optimizer step owns the dispatch."""
        return ForwardPreHook(self)

    def _on_module_forward(self, module: torch.nn.Module) -> None:
        done: set[int] = set()
        for param in module.parameters(recurse=False):
            group = self.param_to_bucket_group.get(param)
            if group is None or id(group) in done:
                continue
            done.add(id(group))
            self._finish_param_sync_for_bucket_group(group)

    def enable_forward_pre_hook(self) -> None:
        """Register the param-gather pre-hook on every submodule (overlap_param_gather)."""
        if not self.use_forward_hook:
            raise RuntimeError(
                "enable_forward_pre_hook() needs use_distributed_optimizer=True and "
                "overlap_param_gather=True"
            )
        if self.remove_forward_pre_hook_handles:
            raise RuntimeError("forward pre-hooks are already enabled")
        hook = self._make_forward_pre_hook()
        for module in self.module.modules():
            self.remove_forward_pre_hook_handles[module] = module.register_forward_pre_hook(hook)

    def disable_forward_pre_hook(self, param_sync: bool = True) -> None:
        """Remove the pre-hooks; then all-gather every param synchronously unless
        ``param_sync=False`` (the caller then owns the param sync)."""
        if not self.use_forward_hook or not self.remove_forward_pre_hook_handles:
            raise RuntimeError(
                "disable_forward_pre_hook(): the forward pre-hooks are not enabled (call "
                "enable_forward_pre_hook() first)"
            )
        for handle in self.remove_forward_pre_hook_handles.values():
            handle.remove()
        self.remove_forward_pre_hook_handles.clear()
        if param_sync:
            self.start_param_sync(force_sync=True)

    # -- forward ----------------------------------------------------------------------

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*inputs, **kwargs)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix, as in Megatron)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load into the wrapped module (values are copied into the buffer-backed params)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    # -- gradients --------------------------------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward accumulates into ``main_grad`` and communicates nothing."""
        for group in self._all_groups():
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self._all_groups():
                group.is_last_microbatch = True

    def start_grad_sync(self, *unused: Any) -> None:
        """Issue every group's reduction (async with overlap_grad_reduce)."""
        for group in self._all_groups():
            group.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Complete every group's reduction (issuing what no hook issued); safe to call
        twice. ``force_all_reduce=True``: full reduced grads on every rank even with the
        distributed optimizer."""
        force = bool(force_all_reduce)
        for group in self._all_groups():
            group.finish_grad_sync(force_all_reduce=force)

    def scale_gradients(self, scaling_factor: float) -> None:
        """``main_grad *= scaling_factor`` for every buffer."""
        for buffer in self._all_buffers():
            buffer.scale_gradients(scaling_factor)

    def _require_no_grad_reduction_in_flight(self, what: str) -> None:
        busy = [g.name for g in self._all_groups() if g.grad_reduce_handle is not None]
        if busy:
            raise RuntimeError(
                f"{what}: gradient reductions of {busy} are still in flight; call "
                "finish_grad_sync() first (after a failed forward or backward: "
                "discard_grad_sync())"
            )

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer and reset the groups for the next iteration (call it at
        the start of each iteration). Refuses while a reduction is in flight."""
        self._require_no_grad_reduction_in_flight("zero_grad_buffer()")
        if getattr(self.config, "cuda_graph_impl", "none") != "transformer_engine":
            for param in self.params_with_grad:
                param.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        for buffer in self._all_buffers():
            buffer.reset()
        for group in self._all_groups():
            group.reset()

    def discard_grad_sync(self) -> None:
        """Recover from an exception raised between ``zero_grad_buffer()`` and the end of
        ``finish_grad_sync()`` (in a forward or a backward, on any microbatch): wait for
        the reductions the interrupted backward already issued, forget the iteration's
        ready counts (an interrupted first iteration teaches no hook order) and drop any
        ``param.grad`` it left. Then ``zero_grad_buffer()`` starts a clean iteration: the
        steps that follow compute exactly what they would have without the failed attempt.

        No collective is issued; the waits are bounded by the groups' timeouts. Every rank
        of the reduction groups must call it after failing at the same point (e.g. the same
        bad batch): a reduction that some ranks issued and others did not never completes,
        and its wait raises mc_groups' ``CollectiveError`` naming the bucket group.
        Param all-gathers in flight are left to the next forward (the params they publish
        have not changed).
        """
        for group in self._all_groups():
            group.discard_grad_sync()
        for param in self.params_with_grad:
            param.grad = None

    def offload_grad_buffers(self, synchronize: bool = True, empty_cache: bool = True) -> None:
        """Free every ``grad_data`` storage (``resize_(0)``); ``main_grad`` and bucket views
        stay valid objects but must not be read until :meth:`restore_grad_buffers`."""
        self._require_no_grad_reduction_in_flight("offload_grad_buffers()")
        device = self.params_with_grad[0].device
        if checks.check_flag("synchronize", synchronize):
            mg_device.synchronize(device)
        for buffer in self._all_buffers():
            buffer.offload_to_cpu(move_params=False, move_grads=True)
        if checks.check_flag("empty_cache", empty_cache):
            mg_device.empty_cache(device)

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Re-allocate every ``grad_data`` (zeroed); existing views become valid again."""
        for buffer in self._all_buffers():
            buffer.reload_from_cpu(move_params=False, move_grads=True)
        if checks.check_flag("synchronize", synchronize):
            mg_device.synchronize(self.params_with_grad[0].device)

    # -- params -----------------------------------------------------------------------

    def _start_bucket_group_param_sync(
        self, bucket_group: ParamAndGradBucketGroup, force_sync: bool
    ) -> None:
        """Dispatch one group's param all-gather (for callers owning a subset of groups);
        mc has no fp8/fp4 post-processing to run after it."""
        bucket_group.start_param_sync(force_sync=force_sync)

    def _finish_param_sync_for_bucket_group(self, bucket_group: ParamAndGradBucketGroup) -> None:
        """Finish one group's param all-gather as its forward pre-hook does: dispatch it if
        nobody did, wait for it, then dispatch the next group's (model-start-first chain)
        unless ``align_param_gather`` or the optimizer step owns the dispatch. mc has no
        fp8/fp4 post-processing to run after it. Needs ``overlap_param_gather``."""
        skip_next = (
            self.ddp_config.align_param_gather or self.overlap_param_gather_with_optimizer_step
        )
        bucket_group.finish_param_sync(skip_next_bucket_dispatch=skip_next)

    def start_param_sync(
        self, *unused: Any, force_sync: bool = False, force_dispatch: bool = False
    ) -> None:
        """All-gather every group's params from the shards, model start first (the last
        group of each chain first). Async with overlap_param_gather unless ``force_sync``;
        skipped when the optimizer step already dispatched (unless ``force_dispatch``)."""
        if not self.ddp_config.use_distributed_optimizer:
            raise RuntimeError(
                "start_param_sync() needs use_distributed_optimizer=True: without it every "
                "rank already holds all params"
            )
        if not force_sync and self.overlap_param_gather_with_optimizer_step and not force_dispatch:
            return
        for group in [*reversed(self.bucket_groups), *reversed(self.expert_parallel_bucket_groups)]:
            self._start_bucket_group_param_sync(group, force_sync)

    def reset_param_sync_dispatch_state(self) -> None:
        """Mark every group's param all-gather as not dispatched, so the next forward
        pre-hooks gather again (finish_grad_sync does this too)."""
        for group in self._all_groups():
            group.param_gather_dispatched = False

    def free_overlap_buffers(self) -> None:
        """Drain every in-flight param all-gather and release the groups' all-to-all
        temporaries (kept between iterations on gloo; e.g. before a checkpoint save)."""
        for group in self._all_groups():
            group.free_overlap_buffers()

    def _broadcast_group(self, param: Param) -> Any:
        if getattr(param, "allreduce", True):
            return self.dp_cp_group
        if self.expt_dp_group is None:
            raise mg.MissingGroupError(
                "broadcast_params() needs pg_collection.expt_dp for the expert param "
                f"'{self._name_of(param)}' (allreduce=False)"
            )
        return self.expt_dp_group

    def _name_of(self, param: Param) -> str:
        known = self.param_to_name.get(param)
        if known is not None:
            return known
        return next((n for n, p in self.module.named_parameters() if p is param), "<unnamed>")

    def broadcast_params(self) -> None:
        """Copy every param from data-parallel rank 0: dense params over ``dp_cp``, expert
        params over ``expt_dp`` (one broadcast per param)."""
        plan = [(p, self._broadcast_group(p)) for p in self.module.parameters()]
        for param, group in plan:
            mg.broadcast(param.data, group, group_src=0, label="broadcast_params")
