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
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Generic, Protocol

import torch
from torch.utils.hooks import RemovableHandle
from typing_extensions import TypeVar

import mc_groups as mg
from mc_buffers import FullParamLayout, OffloadedView, ParamAndGradBuffer
from mc_buffers.adopt import FullParamLayoutLike
from mc_buffers.keys import is_expert_parallel_param
from mc_ddp import _ddp_build as build
from mc_ddp import _ddp_checks as checks
from mc_ddp._ddp_groups import DDPGroups, require_live, resolve_groups
from mc_ddp._iteration import IterationState
from mc_ddp.bucket_group import ParamAndGradBucketGroup
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_ddp.hooks import (
    PARAM_READY_CALLBACK_ATTR,
    ForwardPreHook,
    _BucketParamReadyCallback,
    runs_compiled,
)
from mc_groups import device as mg_device
from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, type_name
from mc_groups.collection import MissingGroupError, collection_or_default, is_group_live
from mc_groups.config import TransformerConfigLike, config_value
from mc_groups.device import is_graph_capturing
from mc_groups.errors import InputStateError, InputTypeError
from mc_groups.param_attrs import GRAD_ADDED_TO_MAIN_GRAD, MAIN_GRAD, ZERO_OUT_WGRAD, bool_attr

__all__ = ["DistributedDataParallel", "_BucketParamReadyCallback", "logger"]

logger = logging.getLogger(__name__)
"""The module's logger (Megatron-Core's module exports one under this name)."""

Param = torch.nn.Parameter

ConfigT_co = TypeVar(
    "ConfigT_co", bound=TransformerConfigLike, default=TransformerConfigLike, covariant=True
)
"""The wrapped config's type, kept so consumers (mc_finalize) can read more of it."""


class _GradReadyOwner(Protocol):
    def _on_grad_ready(self, param: Param, index: int) -> None: ...


class BackwardPostHook:
    """Runs after ``param``'s gradient accumulated (``param.grad`` is set): hands the param
    (and its position ``index`` in the DDP's ``params_with_grad``) to its DDP, which moves
    the grad into ``main_grad`` and marks it ready, unless a CUDA graph is being captured.
    A no-op once the DDP is gone. Called once per param per backward: it does nothing else."""

    __slots__ = ("_ddp", "_index", "_param")

    def __init__(self, ddp: _GradReadyOwner, param: Param, index: int) -> None:
        self._ddp: weakref.ref[_GradReadyOwner] = weakref.ref(ddp)
        self._param = param
        self._index = index

    def __call__(self, *unused: Any) -> None:
        ddp = self._ddp()
        if ddp is not None:
            ddp._on_grad_ready(self._param, self._index)


class DistributedDataParallel(torch.nn.Module, Generic[ConfigT_co]):
    """DDP wrapper which stores grads in contiguous buffers, reduces them bucket by bucket
    (overlapped with backward when configured) and, in distributed-optimizer mode, keeps
    params in the buffer and all-gathers them after the optimizer step.

    Generic in the config's type: ``DistributedDataParallel(ModelParallelConfig(...), ...)``
    is a ``DistributedDataParallel[ModelParallelConfig]``, whose ``config`` keeps every
    attribute a consumer such as ``mc_finalize.finalize_model_grads`` reads.

    Args:
        config: Megatron's ``TransformerConfig``, a ``mc_groups.ModelParallelConfig`` or any
            object with ``calculate_per_token_loss`` (:class:`mc_groups.TransformerConfigLike`;
            ``cuda_graph_impl`` is read with Megatron's default ``"none"``).
        ddp_config: the :class:`DistributedDataParallelConfig`.
        module: the model (chunk) to wrap; at least one param must require grad, all on
            one device.
        disable_bucketing: one bucket per buffer and one bucket group for all of them.
        pg_collection: groups ``dp`` and ``dp_cp`` (required), ``pp`` (optional: stage 0),
            ``expt_dp`` (with expert params), ``intra_dp_cp`` / ``inter_dist_opt`` (with
            several optimizer instances; ``intra_expt_dp`` / ``inter_expt_dp`` too when
            there are expert params); None: the registered default collection.
        full_param_layout: precomputed layouts per buffer key: mc_buffers' FullParamLayout or
            Megatron-Core's (any object with the same fields; see as_full_param_layout),
            including the shard-aligned layouts of Megatron's ``LayerWiseDistributedOptimizer``
            (``compute_full_param_layout``; params tagged ``is_managed_by_layer_wise_optimizer``
            get buffers of their own, reduce-scattered and all-gathered as any
            distributed-optimizer buffer, each rank's shard holding whole params). Kept as
            ``self.full_param_layout`` (mc's copy; computed with the distributed optimizer,
            None otherwise), as Megatron keeps it.
        check_param_values: compare, at construction and in the agreement's one exchange,
            a checksum of every param's values over the ranks that average its gradient
            (dense over ``dp_cp``, expert params over ``expt_dp``): a param that differs
            (e.g. an expert weight not tagged ``allreduce=False``) is a
            :class:`DataParallelAgreementError` naming it. False: a model initialised
            differently per rank on purpose and made equal by :meth:`broadcast_params`
            (mc's keyword; Megatron compares nothing).

    Bucket size: ``ddp_config.bucket_size``, ``num_buckets`` → total // num_buckets, or
    ``max(40M, 1M · |dp_cp|)``; one bucket without overlap_grad_reduce, on pipeline stages
    > 0 or with ``disable_bucketing``. Scaling before the collective: ``1/|dp_cp|`` (SUM),
    1 with ``average_in_collective`` (AVG; experts ``|expt_dp|/|dp_cp|``), 1 with
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
        full_param_layout: FullParamLayout | FullParamLayoutLike | None = None,
        *,
        check_param_values: bool = True,
    ) -> None:
        # A check failing on one rank stops every rank of the world here (one exchange).
        with mg.fail_together(None, "DistributedDataParallel"):
            checks.check_config(config)
            checks.check_ddp_config(ddp_config)
            named = checks.trainable_params(module)
            checks.check_param_flags(named)
            checks.check_compiled_modules(module, ddp_config)
            single = check_flag("disable_bucketing", disable_bucketing)
            check_values = check_flag("check_param_values", check_param_values)
            experts = sum(is_expert_parallel_param(p) for _, p in named)
            pgc = collection_or_default(pg_collection, "DistributedDataParallel")
            groups = resolve_groups(pgc, ddp_config, experts > 0)
            checks.check_materialised(named, groups.dp_cp)
            scaling = build.gradient_scaling(config, ddp_config, groups)  # before any state
            plan = build.plan_layout(
                [p for _, p in named], ddp_config, groups, single, full_param_layout
            )
        build.agree_across_ranks(
            config, ddp_config, groups, single, plan, named, experts, check_values
        )
        super().__init__()
        self.module = module
        self._config = config
        self.ddp_config = ddp_config
        self._set_groups(groups)
        self.param_to_name: dict[Param, str] = {p: n for n, p in named}
        self.params_with_grad: list[Param] = [p for _, p in named]
        self._build(groups, scaling, plan, disable_bucketing=single)
        # Megatron's field: the layouts the buffers were built from, given or (distributed
        # optimizer) computed; None for plain data parallelism without a given layout.
        # Megatron's LayerWiseDistributedOptimizer reads it to find each rank's params.
        use_layout = full_param_layout is not None or ddp_config.use_distributed_optimizer
        self.full_param_layout: FullParamLayout | None = plan.layout if use_layout else None
        self._iteration = IterationState()
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
        self._named_groups = groups.named()  # every group DDP communicates over
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
        plan: build.LayoutPlan,
        *,
        disable_bucketing: bool,
    ) -> None:
        cfg = self.ddp_config
        self.bucket_size = plan.bucket_size
        for param in self.params_with_grad:
            param_attrs.clear_grad_added_to_main_grad(param)
        buffers = build.build_buffers(
            self.params_with_grad, self.param_to_name, cfg, groups, plan, scaling
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
        # each backward hook's bucket group, by the param's position in params_with_grad
        # (a list read per call, not a dict keyed by a tensor)
        self._grad_groups = [self.param_to_bucket_group[p] for p in self.params_with_grad]
        self._grad_index = {p: i for i, p in enumerate(self.params_with_grad)}

    def _all_groups(self) -> list[ParamAndGradBucketGroup]:
        return self.bucket_groups + self.expert_parallel_bucket_groups

    def _all_buffers(self) -> list[ParamAndGradBuffer]:
        return self.buffers + self.expert_parallel_buffers

    def _register_backward_hooks(self) -> list[RemovableHandle | None]:
        handles: list[RemovableHandle | None] = []
        for param in self.params_with_grad:
            hook = self._make_backward_post_hook(param)
            name = self.param_to_name[param]
            if self.ddp_config.delay_wgrad_compute and param_attrs.bool_attr(
                param, param_attrs.SKIP_BACKWARD_POST_HOOK, False, name
            ):
                owner = checks.find_wgrad_hook_owner(self.module, param, name)
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

    @staticmethod
    def _graph_capturing() -> bool:
        """The capture probe every hook and ready callback asks: this module's
        ``is_graph_capturing`` (mc_groups' probe), looked up at each call so that a CPU test
        can patch it where Megatron-Core's tests patch theirs."""
        return is_graph_capturing()

    def _make_backward_post_hook(self, param: Param) -> BackwardPostHook:
        """A hook to run after ``param``'s grad is accumulated: add ``param.grad`` into
        ``param.main_grad`` (unless the layer already did: ``grad_added_to_main_grad``, or
        ``zero_out_wgrad``), drop ``param.grad``, mark the param ready; the completing hook
        of a bucket group dispatches its reduction (overlap, after the first iteration)."""
        return BackwardPostHook(self, param, self._grad_index[param])

    def _on_grad_ready(self, param: Param, index: int) -> None:
        """The backward hook's work, once per param per backward (its cost is DDP's host
        cost per param, see docs/results.md): what holds for the whole run was checked at
        construction, so only state that changes between calls is read here. ``index``:
        the param's position in ``params_with_grad``. Nothing under CUDA-graph capture."""
        if is_graph_capturing():  # this module's name, read per call (tests patch it)
            return
        group = self._grad_groups[index]
        main_grad: torch.Tensor = getattr(param, MAIN_GRAD)  # set by the buffer
        if self._iteration.discarded or isinstance(main_grad, OffloadedView):
            param.grad = None  # a retry must not add it twice
            raise RuntimeError(self._no_grad_memory_message(param))
        self._iteration.accumulated = True
        grad = param.grad
        if grad is not None:
            # common case first: one attribute read (a layer that accumulated into
            # main_grad itself set the flag True; anything but a bool is refused below)
            added = getattr(param, GRAD_ADDED_TO_MAIN_GRAD, False)
            if added is False or self._adds_despite_flag(param):
                main_grad.add_(grad)
            param.grad = None
        if self.ddp_config.overlap_grad_reduce:
            group.register_grad_ready(param, self.force_all_reduce)
        elif group.is_last_microbatch and group.grad_reduce_finished:
            group._refuse_late_grad(param)  # the check register_grad_ready makes

    def _adds_despite_flag(self, param: Param) -> bool:
        """``grad_added_to_main_grad`` is not False: add ``param.grad`` anyway only with
        ``zero_out_wgrad``; a flag that is not a bool is a ``TypeError`` naming the param."""
        name = self.param_to_name[param]
        return not bool_attr(param, GRAD_ADDED_TO_MAIN_GRAD, False, name) or bool_attr(
            param, ZERO_OUT_WGRAD, False, name
        )

    def _no_grad_memory_message(self, param: Param) -> str:
        name = self.param_to_name.get(param, "<unnamed>")
        if self._iteration.discarded and not self._grads_offloaded():
            return (
                f"backward: a gradient of '{name}' arrived after offload_grad_buffers() "
                "discarded this iteration's gradients; call zero_grad_buffer() to start a new "
                "iteration, then run its forward and backward (nothing was written)"
            )
        return (
            f"backward: the gradient of '{name}' has no memory to go to: the grad buffers "
            "are offloaded (offload_grad_buffers()); call restore_grad_buffers() before the "
            "forward and backward (nothing was written)"
        )

    def _make_forward_pre_hook(self) -> ForwardPreHook:
        """A pre-hook that waits for the all-gather of the module's own params (starting it
        if undispatched) and dispatches the next group's, unless ``align_param_gather`` or
        the optimizer step owns the dispatch."""
        return ForwardPreHook(self)

    def _on_module_forward(self, module: torch.nn.Module) -> None:
        done: set[int] = set()
        # a compiled block: its submodules' pre-hooks do nothing inside the graph
        for param in module.parameters(recurse=runs_compiled(module)):
            group = self.param_to_bucket_group.get(param)
            if group is None or id(group) in done:
                continue
            done.add(id(group))
            self._finish_param_sync(group)

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
        check_flag("param_sync", param_sync)
        if param_sync:
            self._require_usable("disable_forward_pre_hook(param_sync=True)", grads=False)
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
        """Run the wrapped module. Refused while params are offloaded (they would be read
        from freed memory) and, with autograd on, while grads are offloaded (its backward
        would have nowhere to put them: run inference under ``torch.no_grad()``)."""
        if self._params_offloaded():
            raise RuntimeError(
                "forward: the params are offloaded (a buffer's offload_to_cpu(move_params="
                "True)) and would be read from freed memory; call each buffer's "
                "reload_from_cpu(move_params=True) first"
            )
        if torch.is_grad_enabled() and self._grads_offloaded():
            raise RuntimeError(
                "forward with autograd on while the grad buffers are offloaded "
                "(offload_grad_buffers()): its backward would have nowhere to write the "
                "gradients; run the forward under torch.no_grad() / torch.inference_mode(), "
                "or call restore_grad_buffers() first"
            )
        return self.module(*inputs, **kwargs)

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict (no ``module.`` prefix, as in Megatron)."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load into the wrapped module (values are copied into the buffer-backed params)."""
        if not isinstance(state_dict, Mapping):
            raise InputTypeError(
                f"state_dict must be a mapping of names to tensors (module.state_dict()), got "
                f"{type_name(state_dict)}"
            )
        check_flag("strict", strict)
        check_flag("assign", assign)
        if self._params_offloaded():
            raise RuntimeError(
                "load_state_dict(): the params are offloaded (offload_to_cpu(move_params="
                "True)); call each buffer's reload_from_cpu(move_params=True) first"
            )
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
        self._require_usable("start_grad_sync()")
        for group in self._all_groups():
            group.start_grad_sync()

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """Complete every group's reduction (issuing what no hook issued); safe to call
        twice. ``force_all_reduce=True`` (None reads as False): full reduced grads on every
        rank even with the distributed optimizer; it must be given to the first call of the
        iteration (a later one would find the shards already final)."""
        flag: object = force_all_reduce  # callers may pass anything
        if flag is not True and flag is not False and flag is not None:
            check_flag("force_all_reduce", flag)
        force = flag is True
        self._require_usable("finish_grad_sync()")
        done = self._iteration.force_all_reduce
        if force and done is False and self.ddp_config.use_distributed_optimizer:
            raise RuntimeError(
                "finish_grad_sync(force_all_reduce=True) after this iteration's gradients were "
                "already reduce-scattered by finish_grad_sync(force_all_reduce=False): each "
                "rank holds only its shard; pass force_all_reduce=True to the first call of "
                "the iteration (e.g. to finalize_model_grads)"
            )
        if done is not None:  # finished this iteration: a second reduction would be wrong
            return
        for group in self._all_groups():  # checked above, for all of them
            group._finish_grad_sync(force)
        self._iteration.force_all_reduce = force

    @property
    def grads_finalized(self) -> bool:
        """True once this iteration's gradients were finalized (:meth:`mark_grads_finalized`,
        which ``mc_finalize.finalize_model_grads`` calls last); ``zero_grad_buffer()``
        clears it. A second finalize in the same iteration would reduce the TP/PP grads
        and scale by the token count twice, so finalize refuses a chunk that reads True."""
        return self._iteration.finalized

    def mark_grads_finalized(self) -> None:
        """Record that this iteration's gradients are final (every reduction finished, every
        scaling applied). Refused when they were already marked this iteration or when a
        bucket group has not finished its grad sync."""
        if self._iteration.finalized:
            raise RuntimeError(
                "mark_grads_finalized(): this iteration's gradients were already finalized "
                "(finalize_model_grads ran on this chunk); finalizing again would reduce and "
                "scale them twice: call zero_grad_buffer() and run the next iteration first"
            )
        pending = [g.name for g in self._all_groups() if not g.grad_reduce_finished]
        if pending:
            raise RuntimeError(
                f"mark_grads_finalized(): {pending} have not finished their grad sync; call "
                "finish_grad_sync() first"
            )
        self._iteration.finalized = True

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """``main_grad *= scaling_factor`` for every buffer: a finite float or a one-element
        floating-point tensor (kept on device: its value is not read). Once per iteration:
        a second call would scale the same gradients twice (e.g. after
        ``finalize_model_grads(num_tokens=...)`` already divided by the token count)."""
        self._require_resident_grads("scale_gradients()")
        if self._iteration.scaled_by is not None:
            raise RuntimeError(
                f"scale_gradients(): this iteration's gradients were already scaled by "
                f"{self._iteration.scaled_by}; a second call would scale them twice (e.g. "
                "finalize_model_grads(num_tokens=...) already divided by the token count). "
                "Scale once per iteration; zero_grad_buffer() starts the next one"
            )
        for buffer in self._all_buffers():  # the first buffer checks the factor, before any write
            buffer.scale_gradients(scaling_factor)
        shown = "a tensor" if isinstance(scaling_factor, torch.Tensor) else repr(scaling_factor)
        self._iteration.scaled_by = shown

    def _require_no_grad_reduction_in_flight(self, what: str) -> None:
        busy = [g.name for g in self._all_groups() if g.grad_reduce_handle is not None]
        if busy:
            raise RuntimeError(
                f"{what}: gradient reductions of {busy} are still in flight; call "
                "finish_grad_sync() first (after a failed forward or backward: "
                "discard_grad_sync())"
            )

    def _grads_offloaded(self) -> bool:
        return any(b.is_grad_data_offloaded for b in self._all_buffers())

    def _params_offloaded(self) -> bool:
        return any(b.is_param_data_offloaded for b in self._all_buffers())

    def _require_resident_grads(self, what: str) -> None:
        if self._grads_offloaded():
            raise RuntimeError(
                f"{what}: the grad buffers are offloaded (offload_grad_buffers()); call "
                "restore_grad_buffers() first"
            )

    def _require_usable(self, what: str, *, grads: bool = True) -> None:
        """Before communicating: live groups, resident params (and grads, kept this
        iteration, unless ``grads=False``)."""
        named = self._named_groups
        if not all(g is None or is_group_live(g) for _, g in named):
            require_live(named, what)  # raises, naming the destroyed group
        if self._params_offloaded():
            raise RuntimeError(
                f"{what}: the params are offloaded (offload_to_cpu(move_params=True)); call "
                "each buffer's reload_from_cpu(move_params=True) first"
            )
        if not grads:
            return
        self._require_resident_grads(what)
        if self._iteration.discarded:
            raise RuntimeError(
                f"{what}: offload_grad_buffers() discarded this iteration's gradients (they "
                "come back zeroed); call zero_grad_buffer() and run the iteration's forward "
                "and backward again"
            )

    def zero_grad_buffer(self) -> None:
        """Zero every grad buffer and reset the groups for the next iteration (call it at
        the start of each iteration). Refuses while a reduction is in flight or while the
        grad buffers are offloaded."""
        self._require_no_grad_reduction_in_flight("zero_grad_buffer()")
        self._require_resident_grads("zero_grad_buffer()")
        for group in self._all_groups():
            group.check_reset()
        if config_value(self.config, "cuda_graph_impl") != "transformer_engine":
            for param in self.params_with_grad:  # param_attrs.clear_grad_added_to_main_grad,
                setattr(param, GRAD_ADDED_TO_MAIN_GRAD, False)  # inlined: once per param
        for buffer in self._all_buffers():
            buffer.reset()
        for group in self._all_groups():
            group.reset()
        self._iteration.next()

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
        """Free every ``grad_data`` storage (``resize_(0)``). Until
        :meth:`restore_grad_buffers`, each ``param.main_grad`` is an
        ``mc_buffers.OffloadedView`` (every operation on it raises), a backward, a
        forward with autograd on, ``zero_grad_buffer``, ``scale_gradients`` and the grad
        sync are refused with an error naming ``restore_grad_buffers()``. Gradients
        accumulated this iteration are lost (they come back zeroed), so the grad sync and an
        optimizer step refuse them until ``zero_grad_buffer()`` starts a new iteration."""
        sync = check_flag("synchronize", synchronize)
        empty = check_flag("empty_cache", empty_cache)
        self._require_no_grad_reduction_in_flight("offload_grad_buffers()")
        device = self.params_with_grad[0].device
        if sync:
            mg_device.synchronize(device)
        if not self._grads_offloaded() and self._has_iteration_grads():
            self._iteration.discarded = True
        for buffer in self._all_buffers():
            buffer.offload_to_cpu(move_params=False, move_grads=True)
        if empty:
            mg_device.empty_cache(device)

    def _has_iteration_grads(self) -> bool:
        finished = any(g.grad_reduce_finished for g in self._all_groups())
        return self._iteration.accumulated or finished

    def restore_grad_buffers(self, synchronize: bool = True) -> None:
        """Re-allocate every ``grad_data`` (zeroed); existing views become valid again and
        each ``param.main_grad`` is its view again."""
        sync = check_flag("synchronize", synchronize)
        for buffer in self._all_buffers():
            buffer.reload_from_cpu(move_params=False, move_grads=True)
        if sync:
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
        self._finish_param_sync(bucket_group)

    def _finish_param_sync(self, bucket_group: ParamAndGradBucketGroup) -> None:
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
        flags: tuple[tuple[str, object], ...] = (
            ("force_sync", force_sync),
            ("force_dispatch", force_dispatch),
        )
        for name, flag in flags:
            if flag is not True and flag is not False:  # one test in the common case
                check_flag(name, flag)
        cfg = self.ddp_config
        if not (cfg.use_distributed_optimizer or cfg.overlap_param_gather):
            raise InputStateError(
                "start_param_sync() needs use_distributed_optimizer=True (or "
                "overlap_param_gather=True, as Megatron asserts): without them every rank "
                "already holds all params"
            )
        if not force_sync and self.overlap_param_gather_with_optimizer_step and not force_dispatch:
            return
        self._require_usable("start_param_sync()", grads=False)
        for group in [*reversed(self.bucket_groups), *reversed(self.expert_parallel_bucket_groups)]:
            self._start_bucket_group_param_sync(group, force_sync)

    def reset_param_sync_dispatch_state(self) -> None:
        """Mark every group's param all-gather as not dispatched, so the next forward
        pre-hooks gather again (finish_grad_sync does this too)."""
        for group in self._all_groups():
            group.param_gather_dispatched = False

    def free_overlap_buffers(self) -> None:
        """Drain every in-flight param all-gather and release the temporaries the groups'
        communicators keep (the gloo reduce-scatter buffers, kept between iterations; e.g.
        before a checkpoint save)."""
        for group in self._all_groups():
            group.free_overlap_buffers()

    def _broadcast_group(self, param: Param) -> Any:
        if not is_expert_parallel_param(param):
            return self.dp_cp_group
        if self.expt_dp_group is None:
            raise MissingGroupError(
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
        self._require_usable("broadcast_params()", grads=False)
        for param, group in plan:
            mg.broadcast(param.data, group, group_src=0, label="broadcast_params")
