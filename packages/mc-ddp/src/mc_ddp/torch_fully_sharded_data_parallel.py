r"""``TorchFullyShardedDataParallel``: PyTorch's FSDP2 (``fully_shard``, ZeRO-3) over a
tensor-parallel model, with mc's parameter marks kept (Megatron-Core's wrapper of the same
name, its module name and signature).

What construction does, on every rank of the data-parallel group ``dp`` (× ``cp``)::

    1. record_marks(module)             every param's mc / Megatron attributes, by name, on
                                        its module (fully_shard replaces the params and their
                                        Python attributes: pytorch #136929)
    2. fully_shard(sub_module)          each sub-module to wrap, innermost first (its params
                                        all-gathered just in time), then the root; over
                                        DeviceMesh.from_group(dp_cp), mp_policy,
                                        reshard_after_forward; HSDP (ddp_config.
                                        num_distributed_optimizer_instances = R > 1):
                                        the 2-D mesh (replicate: inter_dist_opt,
                                        shard: intra_dp_cp), Megatron main's layout;
                                        expert params (allreduce=False) on their own
                                        mesh over expt_dp (shard_placement_fn), every
                                        reduction SUM ÷ |dp_cp|
    3. restore_marks(module)            the marks back on the new DTensor params

One step, then (``D`` = data-parallel size; a param's local tensor is its tensor-parallel
shard, and FSDP2 splits that along dim 0 over ``dp``)::

    forward    per wrapped module: all_gather over dp of its params (just in time), resharded
               after its forward (reshard_after_forward)
    backward   per wrapped module: all_gather over dp again (if resharded), then
               reduce_scatter of its grads over dp: param.grad = DTensor Shard(0),
               (1/D) Σ_dp grad (AVG; in mp_policy.reduce_dtype); with
               config.calculate_per_token_loss Σ_dp grad (SUM, as Megatron: finalize
               then divides by the global token count); under HSDP the all-gathers and
               the reduce-scatter run over intra_dp_cp (D/R ranks) and an all_reduce
               of the shard over inter_dist_opt (R ranks) completes the same average
    finalize   mc_finalize.finalize_model_grads([model]): finish_grad_sync here is a no-op
               (FSDP2 finished its reductions in backward); the tensor-parallel steps (the
               sequence-parallel norms' and row biases' partial sums over tp, the tied
               embedding over embd, …) run on the DTensor grads

FSDP2 issues its collectives through ``torch.distributed`` directly, not through
mc_groups' collective layer: :func:`mc_groups.record_collectives` sees the tensor-parallel
and finalize collectives, not FSDP2's all-gathers and reduce-scatters (count those with
torch's ``CommDebugMode``).

The sub-modules wrapped by default (``sub_modules_to_wrap=None``; Megatron's default is a
set of its own classes, which mc does not have): the decoder layers, found as the children
of the outermost ``nn.ModuleList`` / ``nn.ModuleDict`` whose children all hold params (the
one holding tensor-parallel params when several do), and the modules with params
registered beside the path to it, before or after (the embedding, the LM head), except
norms (only 1-D params: they stay with the root) and modules sharing a param with a module
outside them (a tied embedding and head stay with the root). A set of module classes wraps
every instance, as Megatron does; a sub-module's ``_fsdp_modules`` adds more.

Refused before anything changes (every rank raises, :func:`mc_groups.fail_together`): a
module already under ``fully_shard``; ``config.gradient_accumulation_fusion`` (FSDP2 keeps
grads in ``param.grad``, the fused path writes ``main_grad``); a ``process_group`` holding
another tensor-parallel rank (its reduce-scatter would average different shards); an
expert-parallel param (``allreduce=False``, sharded over ``expt_dp``) without
``reduce_scatter_unused_params=True``; HSDP groups that do not tile the data-parallel
group in rows of ``intra_dp_cp`` and columns of ``inter_dist_opt`` (the experts'
``expt_dp`` in rows of ``intra_expt_dp`` and columns of ``inter_expt_dp``); the DDP
settings FSDP2 has no counterpart for: ``reduce_scatter_with_fp32_accumulation``,
``param_name_patterns_for_fp32_local_accumulation``, ``delay_wgrad_compute``,
``check_for_large_grads``. The bucketing and overlap settings are accepted and have no
effect (FSDP2 groups the params per wrapped module and always overlaps), as in Megatron.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_ddp.grad_checks import NonFiniteGradError
from mc_groups import dtensors, param_attrs
from mc_groups.argcheck import check_flag, check_optional_group, type_name
from mc_groups.collection import collection_or_default
from mc_groups.config import check_config, config_value
from mc_groups.errors import InputTypeError, InputValueError

if TYPE_CHECKING:  # importing FSDP2 imports DTensor (over a second): done where used
    import torch.distributed.fsdp
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["TorchFullyShardedDataParallel", "TorchFullyShardedDataParallelConfig"]

# DDP settings with no FSDP2 counterpart that would change the numbers: field → why (each
# must stay at its default: 1, False or empty)
_UNSUPPORTED: dict[str, str] = {
    "reduce_scatter_with_fp32_accumulation": (
        "use grad_reduce_in_fp32 (or mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))"
    ),
    "param_name_patterns_for_fp32_local_accumulation": (
        "FSDP2 accumulates in param.grad; use grad_reduce_in_fp32"
    ),
    "delay_wgrad_compute": "FSDP2 reduces each module's grads in its own backward",
    "check_for_large_grads": "FSDP2 reduces before mc sees the grads",
}


_ACCUMULATION_MODES = ("classic", "partial_reduce_scatter")


@dataclass
class TorchFullyShardedDataParallelConfig(DistributedDataParallelConfig):
    """:class:`~mc_ddp.DistributedDataParallelConfig` plus FSDP2's settings (Megatron-Core
    main's fields, names and defaults).

    Attributes:
        gradient_accumulation_mode: what ``no_sync`` does on the micro-batches before the
            last. ``"classic"``: no reduce-scatter (FSDP2's
            ``set_requires_gradient_sync(False)``; the unreduced grads accumulate whole and
            the last backward reduces them); ``"partial_reduce_scatter"``: each backward
            reduce-scatters (the accumulated grads stay sharded) and only the all-reduce
            across HSDP replicas waits for the last one (FSDP2's
            ``set_requires_all_reduce(False)``; without HSDP nothing is deferred).
        reshard_after_forward: free each wrapped module's gathered params after its
            forward. None: torch's automatic policy (non-root modules reshard, the root
            keeps its params gathered); True / False for every module; an int ``n`` > 1:
            resharded to ``n`` ranks, a divisor of the data-parallel size.
        reduce_scatter_unused_params: reduce-scatter zeros for params a rank did not use
            (FSDP2's ``set_reduce_scatter_unused_params``), so rank-divergent control flow
            inside a module still issues matching collectives.
        clone_output_views: Megatron clones output views before FSDP2's pre-backward
            hooks; not implemented in mc: True is a ``NotImplementedError``.
    """

    gradient_accumulation_mode: Literal["classic", "partial_reduce_scatter"] = "classic"
    _instances_need_distributed_optimizer = False  # the instances are HSDP's replicas
    reshard_after_forward: bool | int | None = None
    reduce_scatter_unused_params: bool = False
    clone_output_views: bool = False

    def validate(self) -> None:
        """The DDP fields' checks, then the FSDP2 fields' types and values."""
        super().validate()
        if self.gradient_accumulation_mode not in _ACCUMULATION_MODES:
            raise InputValueError(
                f"gradient_accumulation_mode={self.gradient_accumulation_mode!r} must be one "
                f"of {list(_ACCUMULATION_MODES)}"
            )
        check_flag("reduce_scatter_unused_params", self.reduce_scatter_unused_params)
        if check_flag("clone_output_views", self.clone_output_views):
            raise NotImplementedError(
                "clone_output_views=True: mc-ddp does not clone FSDP2's output views; leave "
                "clone_output_views at Megatron's default False"
            )
        value = self.reshard_after_forward
        if value is None or isinstance(value, bool):
            return
        if not isinstance(value, int):
            raise InputTypeError(
                f"reshard_after_forward={value!r} must be None, a bool or an int (a reshard size)"
            )
        if value < 2:
            raise InputValueError(
                f"reshard_after_forward={value} must be None, True, False or an int >= 2 (the "
                "number of ranks to reshard to after forward, a divisor of the data-parallel "
                "size)"
            )


class TorchFullyShardedDataParallel(torch.nn.Module):
    """Wrap ``module`` with FSDP2 over the data-parallel group, keeping mc's param marks
    (module notes: the construction, the step's collectives, the refusals).

    Args:
        config: the transformer config (Megatron's ``TransformerConfig``, mc's
            ``ModelParallelConfig``); ``finalize_model_grads`` reads it as ``model.config``,
            and ``bf16`` / ``fp16`` choose the compute dtype of the default ``mp_policy``.
        ddp_config: a :class:`TorchFullyShardedDataParallelConfig` (or a plain
            :class:`~mc_ddp.DistributedDataParallelConfig`: its defaults);
            ``grad_reduce_in_fp32`` makes the default ``mp_policy`` reduce in fp32.
        module: the model (chunk), tensor-parallel already (mc's layers or
            ``mc_tp_layers.parallelize``); its params on one device (or ``meta``).
        sub_modules_to_wrap: module classes whose instances get their own ``fully_shard``
            (Megatron's meaning), or None for mc's default (module notes).
        disable_bucketing: accepted (Megatron's argument); FSDP2 has no buckets.
        process_group: the group to shard over; None: ``pg_collection.dp_cp``.
        pg_collection: the groups (mc addition, keyword only): ``dp_cp`` (when
            ``process_group`` is None) and ``tp`` (to check the group is orthogonal to it);
            None: the registered default collection.
        mp_policy: FSDP2's ``MixedPrecisionPolicy`` (mc addition, keyword only); None:
            ``param_dtype`` bf16 / fp16 from ``config.bf16`` / ``config.fp16`` (else the
            params' own), ``reduce_dtype`` fp32 with ``ddp_config.grad_reduce_in_fp32``.
    """

    def __init__(
        self,
        config: Any,
        ddp_config: DistributedDataParallelConfig,
        module: torch.nn.Module,
        sub_modules_to_wrap: Collection[type[torch.nn.Module]] | None = None,
        disable_bucketing: bool = False,
        process_group: dist.ProcessGroup | None = None,
        *,
        pg_collection: mg.ProcessGroupCollection | None = None,
        mp_policy: torch.distributed.fsdp.MixedPrecisionPolicy | None = None,
    ) -> None:
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415 (slow import)

        # A check failing on one rank stops every rank of the world here (one exchange).
        with mg.fail_together(None, "TorchFullyShardedDataParallel"):
            _check_config(config)
            _check_ddp_config(ddp_config)
            _check_module(module)
            types = _check_types(sub_modules_to_wrap)
            check_flag("disable_bucketing", disable_bucketing)
            group = _data_group(process_group, pg_collection)
            instances = ddp_config.num_distributed_optimizer_instances
            hsdp = _hsdp_layout(group, pg_collection, instances) if instances > 1 else None
            expert_group = _expert_group(module, ddp_config, pg_collection)
            expert_hsdp = (
                _hsdp_layout(expert_group, pg_collection, instances, _EXPERT_HSDP)
                if expert_group is not None and instances > 1
                else None
            )
            policy = _policy(mp_policy, config, ddp_config)
            _check_one_rank_experts(module, expert_group, group, policy, config)
            reshard = getattr(ddp_config, "reshard_after_forward", None)
            targets = _targets(module, types)
        super().__init__()
        self.module = module
        self._config = config
        self.ddp_config = ddp_config
        self.process_group = group
        device = _device_type(module)
        self.device_mesh: DeviceMesh = _mesh(group, hsdp, device)
        self._grads_finalized = False
        # the expert params' mesh (expt_dp; the data-parallel mesh itself when expt_dp holds
        # its ranks, e.g. expert TP 1 with EP = TP), or None without expert params
        self.expert_device_mesh: DeviceMesh | None = None
        place = None
        if expert_group is not None:
            same = expert_hsdp is None or hsdp is None or expert_hsdp[2] == hsdp[2]
            if mg.group_ranks(expert_group) == mg.group_ranks(group) and same:
                self.expert_device_mesh = self.device_mesh
            else:
                self.expert_device_mesh = _mesh(expert_group, expert_hsdp, device)
                place = _expert_placement(self.expert_device_mesh)
        per_token = bool(config_value(config, "calculate_per_token_loss"))
        # SUM, then ÷ the dense data-parallel size (÷ 1 with per-token loss: finalize divides
        # by the global token count); the dense params' average either way, and the expert
        # params' Σ over expt_dp ÷ |dp_cp| (each EP rank's expert saw every EP peer's tokens)
        divide = 1.0 if per_token else float(group.size())
        param_attrs.record_marks(module)
        for sub in [*targets, module]:  # innermost first, the root last
            fully_shard(
                sub,
                mesh=self.device_mesh,
                reshard_after_forward=reshard,
                mp_policy=policy,
                shard_placement_fn=place,
            )
            if getattr(ddp_config, "reduce_scatter_unused_params", False):
                sub.set_reduce_scatter_unused_params(True)  # type: ignore[operator]
            if per_token or expert_group is not None:
                sub.set_gradient_divide_factor(divide)  # type: ignore[operator]
                sub.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
                _divide_once_on_one_rank(sub)
        if config_value(config, "recompute_granularity") is not None:
            _prefetch_in_forward_order(module, targets)
        param_attrs.restore_marks(module)
        self._no_sync_depth = 0
        self.wrapped_sub_modules: list[torch.nn.Module] = targets
        """The sub-modules given their own ``fully_shard`` (innermost first; the root too)."""

    @property
    def config(self) -> Any:
        """The transformer config passed at construction (``finalize_model_grads`` reads
        it)."""
        return self._config

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward (FSDP2's hooks gather the params); a forward starts
        a new iteration (:attr:`grads_finalized` reads False again)."""
        self._grads_finalized = False
        return self.module(*inputs, **kwargs)

    # -- Megatron's data-parallel interface -------------------------------------------

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside, with ``gradient_accumulation_mode="classic"``: backward accumulates the
        unreduced grads and communicates nothing over dp (FSDP2's
        ``set_requires_gradient_sync(False)``); the first backward after it reduces the
        accumulated grads. With ``"partial_reduce_scatter"`` every backward reduce-scatters
        (nothing changes without HSDP). In both, FSDP2 is told that the backwards inside
        are not an iteration's last (``set_is_last_backward(False)``: it keeps its
        backward-prefetch state between them; the next backward outside waits for every
        reduction and clears it). Nested contexts: only the outermost one changes and
        restores these controls (Megatron counts the depth), also when its body raises."""
        root: Any = self.module
        classic = getattr(self.ddp_config, "gradient_accumulation_mode", "classic") == "classic"
        control = root.set_requires_gradient_sync if classic else root.set_requires_all_reduce
        outermost = self._no_sync_depth == 0
        self._no_sync_depth += 1
        try:
            if outermost:
                root.set_is_last_backward(False)
                control(False)
            yield
        finally:
            self._no_sync_depth -= 1
            if outermost:
                try:
                    control(True)
                finally:
                    root.set_is_last_backward(True)

    def start_grad_sync(self, *unused: Any) -> None:
        """Nothing to issue: FSDP2 reduce-scatters each wrapped module's grads in its own
        backward."""

    def finish_grad_sync(self, force_all_reduce: bool | None = False) -> None:
        """FSDP2 finished its reductions when backward returned; with
        ``ddp_config.check_for_nan_in_grad`` this checks every local grad shard and raises
        :class:`~mc_ddp.NonFiniteGradError` naming the param (local check: the shards of
        one param differ by rank). ``force_all_reduce`` is accepted (Megatron's argument)
        and has no effect: FSDP2 keeps every grad sharded."""
        if force_all_reduce is not None:
            check_flag("force_all_reduce", force_all_reduce)
        if not self.ddp_config.check_for_nan_in_grad:
            return
        for name, param in self.module.named_parameters():
            grad = param.grad
            if grad is None:
                continue
            local = grad.to_local() if hasattr(grad, "to_local") else grad
            if not bool(torch.isfinite(local).all()):
                raise NonFiniteGradError(
                    f"finish_grad_sync(): the grad of '{name}' holds inf or NaN on rank "
                    f"{dist.get_rank()} after FSDP2's reduce-scatter (check_for_nan_in_grad)"
                )

    @property
    def grads_finalized(self) -> bool:
        """True once ``finalize_model_grads`` ran on this chunk since the last forward or
        :meth:`zero_grad_buffer` (a second finalize would reduce twice)."""
        return self._grads_finalized

    def mark_grads_finalized(self) -> None:
        """Record that this iteration's grads are final (``finalize_model_grads`` calls it
        last); a second mark in one iteration is an error."""
        if self._grads_finalized:
            raise RuntimeError(
                "mark_grads_finalized(): this iteration's gradients were already finalized; "
                "call zero_grad_buffer() and run the next iteration first"
            )
        self._grads_finalized = True

    def scale_gradients(self, scaling_factor: float | torch.Tensor) -> None:
        """``grad *= scaling_factor`` for every param's (local, sharded) grad."""
        if isinstance(scaling_factor, bool) or not isinstance(
            scaling_factor, (int, float, torch.Tensor)
        ):
            raise InputTypeError(
                f"scaling_factor={scaling_factor!r} must be a float or a one-element tensor"
            )
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        with torch.no_grad():
            for grad in grads:
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.mul_(scaling_factor)

    def zero_grad_buffer(self) -> None:
        """Start an iteration: every param's grad set to None (FSDP2 accumulates into
        ``param.grad``; Megatron's wrapper leaves this to the optimizer's ``zero_grad``)."""
        self.module.zero_grad(set_to_none=True)
        self._grads_finalized = False

    def start_param_sync(self, *unused: Any, force_sync: bool = False) -> None:
        """Nothing to issue: each wrapped module's forward pre-hook all-gathers its params
        just in time (FSDP2); the optimizer steps the sharded params in place."""
        check_flag("force_sync", force_sync)

    def broadcast_params(self) -> None:
        """Nothing to do: every rank holds only its shard of each param, no copy to align."""

    def state_dict(self, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The wrapped module's state dict: each param a DTensor sharded over dp (FSDP2's);
        ``mc_tp_layers.full_state_dict`` gives whole tensors with one-process names."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load a state dict of the wrapped module's form (DTensor values, as
        :meth:`state_dict` returns) into it. Megatron's wrapper makes this a no-op (its
        checkpoints load in place through DCP); mc loads, so a call is never lost
        (``mc_tp_layers.load_full_state_dict`` loads whole tensors)."""
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)


def _check_config(config: object) -> None:
    check_config(config, "TorchFullyShardedDataParallel", required=("sequence_parallel",))
    if config_value(config, "gradient_accumulation_fusion"):
        raise InputValueError(
            "config.gradient_accumulation_fusion=True: mc's layers would accumulate weight "
            "grads into param.main_grad, which FSDP2 does not have (it reduces param.grad); "
            "set gradient_accumulation_fusion=False"
        )


def _check_ddp_config(ddp_config: object) -> None:
    if not isinstance(ddp_config, DistributedDataParallelConfig):
        raise InputTypeError(
            f"ddp_config must be a mc_ddp.TorchFullyShardedDataParallelConfig (or a "
            f"DistributedDataParallelConfig), got {type_name(ddp_config)}"
        )
    ddp_config.validate()
    for name, why in _UNSUPPORTED.items():
        value = getattr(ddp_config, name)
        # a bool flag or the sequence of patterns is set when truthy
        if value:
            raise InputValueError(
                f"ddp_config.{name}={value!r} has no counterpart under FSDP2 ({why}); leave it "
                "at its default"
            )


def _check_module(module: object) -> None:
    if not isinstance(module, torch.nn.Module):
        raise InputTypeError(f"module must be a torch.nn.Module, got {type_name(module)}")
    if any(dtensors.is_fsdp_module(m) for m in module.modules()):
        raise InputValueError(
            f"module ({type_name(module)}) is already under fully_shard; pass the model before "
            "FSDP2 wraps it (TorchFullyShardedDataParallel applies fully_shard itself)"
        )
    if not any(p.requires_grad for p in module.parameters()):
        raise InputValueError(f"module ({type_name(module)}) has no parameter requiring grad")


def _expert_group(
    module: torch.nn.Module,
    ddp_config: DistributedDataParallelConfig,
    pg_collection: mg.ProcessGroupCollection | None,
) -> dist.ProcessGroup | None:
    """The group FSDP2 shards the expert params (``allreduce=False``) over: ``expt_dp``,
    the ranks holding the same experts (Megatron main's per-parameter mesh; under HSDP its
    rows ``intra_expt_dp`` and columns ``inter_expt_dp``); None when the module has none."""
    experts = [n for n, p in module.named_parameters() if param_attrs.is_expert_param(p)]
    if not experts:
        return None
    where = f"module's param '{experts[0]}' ({len(experts)} expert params in all)"
    if not getattr(ddp_config, "reduce_scatter_unused_params", False):
        raise InputValueError(
            f"{where} is an expert-parallel param (allreduce=False): set "
            "TorchFullyShardedDataParallelConfig(reduce_scatter_unused_params=True), as "
            "Megatron main requires: an expert that gets no token on a rank would skip its "
            "reduce-scatter there while its expert data-parallel peers issue theirs"
        )
    pgc = collection_or_default(pg_collection, "TorchFullyShardedDataParallel")
    return pgc.require("expt_dp", "TorchFullyShardedDataParallel (the expert params' mesh)")


def _check_one_rank_experts(
    module: torch.nn.Module,
    expert_group: dist.ProcessGroup | None,
    group: dist.ProcessGroup,
    policy: torch.distributed.fsdp.MixedPrecisionPolicy,
    config: object,
) -> None:
    """Refuse expert params on a one-rank ``expt_dp`` whose grads FSDP2 would reduce in
    float16 with a divide factor above 1: torch's one-rank path divides them by the factor
    twice in its fp16 (overflow-guarded) route, with or without SUM-only communication
    (:func:`_divide_once_on_one_rank` fixes the fp32 / bf16 route only)."""
    if expert_group is None or mg.group_size(expert_group) > 1 or mg.group_size(group) == 1:
        return
    if config_value(config, "calculate_per_token_loss"):
        return  # divide factor 1
    first = next(iter(module.parameters()))
    reduce = policy.reduce_dtype or policy.param_dtype or first.dtype
    if reduce == torch.float16:
        raise InputValueError(
            f"the expert params' expt_dp is one rank ({mg.group_ranks(expert_group)}) and "
            f"their grads would be reduced in float16: torch's FSDP2 divides such grads by "
            f"the data-parallel size ({mg.group_size(group)}) twice on one rank; set "
            "TorchFullyShardedDataParallelConfig(grad_reduce_in_fp32=True) (or an mp_policy "
            "with reduce_dtype float32 or bfloat16), or use a layout with 2 or more ranks "
            "in expt_dp (smaller expert TP × EP, or more data-parallel ranks)"
        )


def _divide_once_on_one_rank(module: torch.nn.Module) -> None:
    """Each of ``module``'s FSDP2 param groups whose mesh shards over one rank (an expert
    param on a one-rank ``expt_dp``, e.g. expert TP 2 × EP 2 on 4 data-parallel ranks)
    reduces without ``force_sum_reduction_for_comms``: with it, torch's FSDP2 divides such
    a group's grads by the divide factor twice (its one-rank copy divides, then its
    post-divide again: Σ ÷ |dp|² instead of ÷ |dp|), without it once. A group over one rank
    issues no reduce-scatter, so the SUM-only rule has nothing to act on there (an HSDP
    replica all-reduce still SUMs). The field is torch's private one: a torch without it
    is refused here (the grads would be Σ ÷ |dp|² with no error)."""
    state = module._get_fsdp_state()  # type: ignore[operator]
    for group in state._fsdp_param_groups:
        if getattr(group.mesh_info, "shard_mesh_size", 0) == 1:
            if not hasattr(group, "force_sum_reduction_for_comms"):
                raise RuntimeError(
                    f"torch {torch.__version__}'s FSDP2 param group has no "
                    "force_sum_reduction_for_comms, which mc turns off for params sharded "
                    "over one rank (expert params on a one-rank expt_dp; else their grads are "
                    "divided by the data-parallel size twice); use a layout with 2 or more "
                    "ranks in expt_dp, or a torch version mc-ddp supports"
                )
            group.force_sum_reduction_for_comms = False


def _expert_placement(mesh: DeviceMesh) -> Callable[[torch.nn.Parameter], Any]:
    """FSDP2's ``shard_placement_fn``: an expert param on ``mesh`` (``expt_dp``; HSDP's 2-D
    ``(replicate, shard)`` mesh of it), dim 0 split (torch's per-parameter mesh, Megatron
    main's route); any other param on the module's own mesh."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import (  # noqa: PLC0415
        FSDPMeshInfo,
        HSDPMeshInfo,
        ShardPlacementResult,
    )

    info = (
        FSDPMeshInfo(mesh, shard_mesh_dim=0)
        if mesh.ndim == 1
        else HSDPMeshInfo(mesh, shard_mesh_dim=1, replicate_mesh_dim=0)
    )
    expert = ShardPlacementResult(placement=None, mesh_info=info)

    def place(param: torch.nn.Parameter) -> Any:
        return expert if param_attrs.is_expert_param(param) else None

    return place


def _check_types(
    sub_modules_to_wrap: object,
) -> tuple[type[torch.nn.Module], ...] | None:
    if sub_modules_to_wrap is None:
        return None
    if isinstance(sub_modules_to_wrap, (str, bytes, type)) or not isinstance(
        sub_modules_to_wrap, Collection
    ):
        raise InputTypeError(
            f"sub_modules_to_wrap={sub_modules_to_wrap!r} must be a set of torch.nn.Module "
            "classes (e.g. {LlamaDecoderLayer}) or None (mc's default: the decoder layers, "
            "the embedding, the head)"
        )
    types = tuple(sub_modules_to_wrap)
    for item in types:
        if not (isinstance(item, type) and issubclass(item, torch.nn.Module)):
            raise InputTypeError(
                f"sub_modules_to_wrap holds {item!r}, not a torch.nn.Module class; pass classes "
                "(e.g. {LlamaDecoderLayer}), not instances"
            )
    return types


def _data_group(
    process_group: object, pg_collection: mg.ProcessGroupCollection | None
) -> dist.ProcessGroup:
    group = check_optional_group(
        "process_group", process_group, what="TorchFullyShardedDataParallel"
    )
    collection = None
    if group is None or pg_collection is not None:
        collection = collection_or_default(pg_collection, "TorchFullyShardedDataParallel")
    if group is None:
        assert collection is not None
        group = collection.require("dp_cp", "TorchFullyShardedDataParallel (the FSDP2 mesh)")
    tp = None if collection is None else collection.tp
    if tp is not None:
        shared = set(mg.group_ranks(group)) & set(mg.group_ranks(tp))
        if shared != {dist.get_rank()}:
            raise InputValueError(
                f"process_group {list(mg.group_ranks(group))} holds tensor-parallel peers of "
                f"rank {dist.get_rank()} ({sorted(shared - {dist.get_rank()})}): FSDP2 would "
                "average grads of different tensor-parallel shards; shard over the "
                "data-parallel group (pg_collection.dp_cp)"
            )
    return group


# HSDP: (replicate group, shard group, the group's ranks as rows); the experts' group names
_Layout = tuple[dist.ProcessGroup, dist.ProcessGroup, list[list[int]]]
_EXPERT_HSDP = ("intra_expt_dp", "inter_expt_dp")


def _hsdp_layout(
    group: dist.ProcessGroup,
    pg_collection: mg.ProcessGroupCollection | None,
    instances: int,
    names: tuple[str, str] = ("intra_dp_cp", "inter_dist_opt"),
) -> _Layout:
    """HSDP's ``(replicate, shard, mesh)`` (Megatron main's layout): ``group``'s ranks in
    ``instances`` rows, a row one ``names[0]`` group (FSDP2 shards over it), a column one
    ``names[1]`` group (it all-reduces the shards); the expert params' with
    ``("intra_expt_dp", "inter_expt_dp")`` over ``expt_dp``."""
    what = "TorchFullyShardedDataParallel (HSDP, num_distributed_optimizer_instances > 1)"
    pgc = collection_or_default(pg_collection, what)
    shard = pgc.require(names[0], f"{what}: the shard dimension")
    replicate = pgc.require(names[1], f"{what}: the replicate dimension")
    full, me = list(mg.group_ranks(group)), dist.get_rank()
    columns, rows = list(mg.group_ranks(replicate)), list(mg.group_ranks(shard))
    size = len(rows)
    if len(columns) != instances or len(columns) * size != len(full) or me not in full:
        raise InputValueError(
            f"ddp_config.num_distributed_optimizer_instances={instances} needs "
            f"pg_collection.{names[1]} of {instances} ranks (has {columns}) times "
            f"{names[0]} ({rows}) to tile the group {full}; build the collection with "
            f"initialize_model_parallel(num_distributed_optimizer_instances={instances})"
        )
    replica, position = divmod(full.index(me), size)
    if rows != full[replica * size : (replica + 1) * size] or columns != full[position::size]:
        raise InputValueError(
            f"pg_collection.{names[0]} {rows} and {names[1]} {columns} are not a row and a "
            f"column of the group {full} in {instances} rows (Megatron's HSDP layout); build "
            "them with initialize_model_parallel"
        )
    return replicate, shard, [full[i : i + size] for i in range(0, len(full), size)]


def _mesh(group: dist.ProcessGroup, hsdp: _Layout | None, device: str) -> DeviceMesh:
    """FSDP2's mesh over ``group``: 1-D, or HSDP's ``(replicate, shard)`` from
    :func:`_hsdp_layout`."""
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415 (slow import)

    if hsdp is None:
        return DeviceMesh.from_group(group, device)
    replicate, shard, rows = hsdp
    return DeviceMesh.from_group(
        [replicate, shard], device, mesh=rows, mesh_dim_names=("replicate", "shard")
    )


def _device_type(module: torch.nn.Module) -> str:
    param = next(iter(module.parameters()))
    if param.device.type == "meta":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return param.device.type


def _policy(
    mp_policy: object, config: object, ddp_config: DistributedDataParallelConfig
) -> torch.distributed.fsdp.MixedPrecisionPolicy:
    from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: PLC0415

    if mp_policy is not None:
        if not isinstance(mp_policy, MixedPrecisionPolicy):
            raise InputTypeError(
                f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, got "
                f"{type_name(mp_policy)}"
            )
        return mp_policy
    param_dtype = None
    if config_value(config, "bf16"):
        param_dtype = torch.bfloat16
    elif config_value(config, "fp16"):
        param_dtype = torch.float16
    reduce_dtype = torch.float32 if ddp_config.grad_reduce_in_fp32 else None
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def _prefetch_in_forward_order(module: torch.nn.Module, targets: list[torch.nn.Module]) -> None:
    """Each wrapped sub-module prefetches, in backward, the one before it in forward order
    (``set_modules_to_backward_prefetch``), as Megatron does under recompute: FSDP2's own
    order comes from the forward it records, and a recomputed forward inside backward would
    reorder it."""
    wrapped = {id(sub) for sub in targets}
    previous: torch.nn.Module | None = None
    for sub in module.modules():  # registration order: the forward order of a layer stack
        if id(sub) in wrapped:
            prefetch = [] if previous is None else [previous]
            sub.set_modules_to_backward_prefetch(prefetch)  # type: ignore[operator]
            previous = sub


def _targets(
    module: torch.nn.Module, types: tuple[type[torch.nn.Module], ...] | None
) -> list[torch.nn.Module]:
    """The sub-modules to ``fully_shard`` before the root, innermost first."""
    named = dict(module.named_modules())
    if types is None:
        names = _default_names(module)
    else:
        names = [n for n, m in named.items() if n and isinstance(m, types)]
    for sub in named.values():  # Megatron's hook: a module's _fsdp_modules
        for extra in getattr(sub, "_fsdp_modules", ()):
            names += [n for n, m in named.items() if m is extra and n not in names]
    names = [n for n in names if n]
    names.sort(key=lambda n: -n.count("."))  # children before their parents (stable)
    return [named[n] for n in names]


def _has_params(module: torch.nn.Module) -> bool:
    return next(iter(module.parameters()), None) is not None


def _default_names(module: torch.nn.Module) -> list[str]:
    containers = [
        n
        for n, m in module.named_modules()
        if n
        and isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))
        and len(m) > 0
        and all(_has_params(c) for c in m.children())
    ]
    split = [
        n
        for n in containers
        if any(
            param_attrs.is_tensor_model_parallel(p) for p in module.get_submodule(n).parameters()
        )
    ]
    chosen = split or containers
    outer = [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]
    owners = _owners(module)
    names: list[str] = []
    for container in outer:
        names += [f"{container}.{c}" for c, _ in module.get_submodule(container).named_children()]
        for name, child in _beside(module, container):
            if name in names or name in outer or not _has_params(child) or _is_norm_like(child):
                continue
            if _self_contained(name, child, owners):
                names.append(name)
    return names


def _beside(module: torch.nn.Module, path: str) -> list[tuple[str, torch.nn.Module]]:
    """The children of ``path``'s ancestors that are not on the path (before and after)."""
    out: list[tuple[str, torch.nn.Module]] = []
    prefix, current = "", module
    for part in path.split("."):
        out += [(f"{prefix}{n}", c) for n, c in current.named_children() if n != part]
        prefix, current = f"{prefix}{part}.", current.get_submodule(part)
    return out


def _is_norm_like(module: torch.nn.Module) -> bool:
    return all(p.dim() <= 1 for p in module.parameters())


def _owners(module: torch.nn.Module) -> dict[int, list[str]]:
    owners: dict[int, list[str]] = {}
    for name, sub in module.named_modules(remove_duplicate=False):
        for param in sub._parameters.values():
            if param is not None:
                owners.setdefault(id(param), []).append(name)
    return owners


def _self_contained(name: str, sub: torch.nn.Module, owners: dict[int, list[str]]) -> bool:
    """Every param of ``sub`` is held only inside it (FSDP2 cannot put a param shared
    with a module outside into ``sub``'s group)."""
    return all(
        all(o == name or o.startswith(name + ".") for o in owners.get(id(p), [name]))
        for p in sub.parameters()
    )
