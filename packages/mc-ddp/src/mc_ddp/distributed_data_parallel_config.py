"""``DistributedDataParallelConfig``: Megatron-Core's DDP knobs, validated.

Every field of Megatron-Core's config, in its order and with its defaults, so a Megatron
config ports by changing the import. The fields of features mc does not implement
(Megatron-FSDP, NCCL user buffers, fp8/fp4/MXFP8 param gathering) are accepted at their
defaults; any other value raises ``NotImplementedError`` naming the field, instead of
being ignored.
Validation runs in ``__post_init__`` and again when :class:`~mc_ddp.DistributedDataParallel`
is built (:meth:`DistributedDataParallelConfig.validate`), because Megatron code often sets
fields after construction. Wrong types are ``TypeError`` (``bucket_size=True`` is not the
size 1); incompatible combinations are ``ValueError`` naming both fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mc_groups.argcheck import check_flag, check_int, check_optional_int, check_patterns
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["DistributedDataParallelConfig"]

_FLAGS = (
    "grad_reduce_in_fp32",
    "overlap_grad_reduce",
    "overlap_param_gather",
    "align_param_gather",
    "use_distributed_optimizer",
    "check_for_nan_in_grad",
    "check_for_large_grads",
    "pad_buckets_for_high_nccl_busbw",
    "average_in_collective",
    "reduce_scatter_with_fp32_accumulation",
    "delay_wgrad_compute",
)

_TE_GATHER = (
    "Transformer Engine fp8/fp4 param gathering (installing Transformer Engine does not enable it)"
)
_FSDP = "Megatron-FSDP (mc has no FSDP; use_megatron_fsdp must stay False)"
_NCCL_UB = "NCCL user-buffer registration"
_NOT_IMPLEMENTED: dict[str, tuple[object, str]] = {
    "fp8_param_gather": (False, _TE_GATHER),
    "fp4_param_gather": (False, _TE_GATHER),
    "reuse_grad_buf_for_mxfp8_param_ag": (False, "MXFP8 param gathering into the grad buffer"),
    "use_megatron_fsdp": (False, _FSDP),
    "megatron_fsdp_version": (1, _FSDP),
    "use_custom_fsdp": (False, _FSDP),
    "data_parallel_sharding_strategy": ("no_shard", _FSDP),
    "gradient_reduce_div_fusion": (True, _FSDP),
    "suggested_communication_unit_size": (None, _FSDP),
    "keep_fp8_transpose_cache": (False, _FSDP),
    "nccl_ub": (False, _NCCL_UB),
    "fsdp_double_buffer": (False, _FSDP),
    "fsdp_db_use_persist_buf_on_alloc_fail": (False, _FSDP),
    "fsdp_all_gather_in_start_param_sync": (True, _FSDP),
    "outer_dp_sharding_strategy": ("no_shard", _FSDP),
    "fsdp_manual_registration": (False, _FSDP),
    "megatron_fsdp_main_params_dtype": (torch.float32, _FSDP),
    "megatron_fsdp_main_grads_dtype": (None, _FSDP),
    "megatron_fsdp_grad_comm_dtype": (None, _FSDP),
    "megatron_fsdp_use_decoupled_grad": (False, _FSDP),
    "megatron_fsdp_cuda_graph_mode": (False, _FSDP),
    "megatron_fsdp_enable_fine_grained_param_gather": (False, _FSDP),
    "megatron_fsdp_max_pool_double_buffer": (False, _FSDP),
}
"""Megatron-Core fields of features mc does not implement: ``(default, feature)``."""


@dataclass
class DistributedDataParallelConfig:
    """How :class:`~mc_ddp.DistributedDataParallel` buckets, reduces and gathers.

    Attributes:
        grad_reduce_in_fp32: keep ``main_grad`` and reduce gradients in fp32 (a bf16 model
            gets an fp32 grad buffer).
        overlap_grad_reduce: dispatch each bucket group's reduction asynchronously from the
            backward hooks as soon as its grads are ready (else one synchronous reduction of
            one bucket in ``finish_grad_sync``).
        overlap_param_gather: with the distributed optimizer, all-gather params
            asynchronously, bucket group by bucket group, from forward pre-hooks. Without it
            (Megatron accepts that for its layer-wise optimizer) every rank holds every param:
            ``start_param_sync`` gathers nothing and only marks the sync dispatched.
        align_param_gather: the caller dispatches every param all-gather itself (e.g. all
            pipeline stages at once through ``start_param_sync``); pre-hooks only wait.
        use_distributed_optimizer: reduce-scatter gradients into this rank's shard and keep
            params in the buffer's ``param_data`` (all-gathered after the optimizer step).
        num_distributed_optimizer_instances: shard the optimizer over dp·cp / k ranks and
            all-reduce the shards across the k instances (needs the distributed optimizer).
        check_for_nan_in_grad: raise before the collective when a bucket holds NaN/Inf.
        check_for_large_grads: warn when a bucket's grad norm exceeds 10× the largest norm
            it had in earlier steps.
        bucket_size: elements per bucket (a bucket closes at the param that reaches it);
            None: ``max(40_000_000, 1_000_000 · dp)``.
        num_buckets: instead of ``bucket_size``: ``bucket_size = total params // num_buckets``.
        pad_buckets_for_high_nccl_busbw: pad bucket ends to ``lcm(dp, 128, 2**16)``.
        average_in_collective: reduce with ``AVG`` instead of pre-scaling by 1/dp and
            summing.
        reduce_scatter_with_fp32_accumulation: reduce-scatter as an all-to-all in the grad
            dtype plus a local fp32 sum (distributed optimizer, one instance).
        param_name_patterns_for_fp32_local_accumulation: fnmatch patterns (``"all"`` for
            every param) of params whose ``main_grad`` accumulates locally in a separate
            fp32 tensor, copied into the (lower-precision) buffer for the collective.
        delay_wgrad_compute: params marked ``skip_backward_post_hook`` get their DDP hook
            from their module's ``register_wgrad_accumulation_and_reduce_hooks``.
        disable_symmetric_registration: accepted at either value: mc never registers NCCL
            buffers, which is what True asks for.

    Not implemented, accepted only at Megatron's default (anything else is a
    ``NotImplementedError`` naming the field): ``fp8_param_gather``, ``fp4_param_gather``,
    ``reuse_grad_buf_for_mxfp8_param_ag`` (Transformer Engine low-precision gathers),
    ``nccl_ub`` (NCCL user buffers), ``use_megatron_fsdp``, ``use_custom_fsdp`` and every
    Megatron-FSDP setting (``megatron_fsdp_*``, ``fsdp_*``,
    ``data_parallel_sharding_strategy``, ``outer_dp_sharding_strategy``,
    ``gradient_reduce_div_fusion``, ``suggested_communication_unit_size``,
    ``keep_fp8_transpose_cache``).
    """

    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    align_param_gather: bool = False
    use_distributed_optimizer: bool = False
    num_distributed_optimizer_instances: int = 1
    check_for_nan_in_grad: bool = False
    check_for_large_grads: bool = False
    bucket_size: int | None = None
    num_buckets: int | None = None
    pad_buckets_for_high_nccl_busbw: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    param_name_patterns_for_fp32_local_accumulation: Sequence[str] = ()
    average_in_collective: bool = False
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    reuse_grad_buf_for_mxfp8_param_ag: bool = False
    use_megatron_fsdp: bool = False
    megatron_fsdp_version: int = 1
    use_custom_fsdp: bool = False
    data_parallel_sharding_strategy: str = "no_shard"
    gradient_reduce_div_fusion: bool = True
    suggested_communication_unit_size: int | None = None
    keep_fp8_transpose_cache: bool = False
    nccl_ub: bool = False
    fsdp_double_buffer: bool = False
    fsdp_db_use_persist_buf_on_alloc_fail: bool = False
    fsdp_all_gather_in_start_param_sync: bool = True
    outer_dp_sharding_strategy: str = "no_shard"
    disable_symmetric_registration: bool = False
    fsdp_manual_registration: bool = False
    delay_wgrad_compute: bool = False
    megatron_fsdp_main_params_dtype: torch.dtype | None = torch.float32
    megatron_fsdp_main_grads_dtype: torch.dtype | None = None
    megatron_fsdp_grad_comm_dtype: torch.dtype | None = None
    megatron_fsdp_use_decoupled_grad: bool = False
    megatron_fsdp_cuda_graph_mode: bool = False
    megatron_fsdp_enable_fine_grained_param_gather: bool = False
    megatron_fsdp_max_pool_double_buffer: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type, then the fields mc does not implement, then every
        combination (see the class docstring)."""
        self._check_types()
        self._check_not_implemented()
        self._check_combinations()

    def _check_types(self) -> None:
        for name in (*_FLAGS, "disable_symmetric_registration"):
            check_flag(name, getattr(self, name))
        check_int("num_distributed_optimizer_instances", self.num_distributed_optimizer_instances)
        check_optional_int("bucket_size", self.bucket_size)
        check_optional_int("num_buckets", self.num_buckets)
        check_patterns(
            "param_name_patterns_for_fp32_local_accumulation",
            self.param_name_patterns_for_fp32_local_accumulation,
        )

    # mc DDP's instances shard the optimizer; FSDP2's config (HSDP replicas) sets False.
    _instances_need_distributed_optimizer = True

    def _check_combinations(self) -> None:
        dist_opt = self.use_distributed_optimizer
        _need(
            self.num_distributed_optimizer_instances == 1
            or dist_opt
            or not self._instances_need_distributed_optimizer,
            f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances} "
            "needs use_distributed_optimizer=True (the instances shard the optimizer)",
        )
        _need(
            self.bucket_size is None or self.num_buckets is None,
            f"bucket_size={self.bucket_size} and num_buckets={self.num_buckets} both set: "
            "give one of them",
        )
        _need(
            not self.align_param_gather or self.overlap_param_gather,
            "align_param_gather=True needs overlap_param_gather=True (it aligns the "
            "overlapped param all-gathers)",
        )
        _need(
            not (self.param_name_patterns_for_fp32_local_accumulation and self.grad_reduce_in_fp32),
            "param_name_patterns_for_fp32_local_accumulation="
            f"{list(self.param_name_patterns_for_fp32_local_accumulation)} with "
            "grad_reduce_in_fp32=True: grads already accumulate in fp32; drop one of them",
        )
        self._check_fp32_reduce_scatter()

    def _check_fp32_reduce_scatter(self) -> None:
        if not self.reduce_scatter_with_fp32_accumulation:
            return
        _need(
            self.use_distributed_optimizer,
            "reduce_scatter_with_fp32_accumulation=True needs use_distributed_optimizer=True "
            "(without it gradients are all-reduced, not reduce-scattered)",
        )
        _need(
            self.num_distributed_optimizer_instances == 1,
            "reduce_scatter_with_fp32_accumulation=True with "
            f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances}: "
            "the fp32-accumulating reduce-scatter supports one instance only",
        )

    def _check_not_implemented(self) -> None:
        for name, (default, _) in _NOT_IMPLEMENTED.items():
            _check_like_default(name, getattr(self, name), default)
        _need(
            self.megatron_fsdp_version in (1, 2),
            f"megatron_fsdp_version={self.megatron_fsdp_version} must be 1 or 2",
        )
        for name, (default, feature) in _NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value != default:
                raise NotImplementedError(
                    f"{name}={value!r}: mc-ddp does not implement {feature}; leave {name} "
                    f"at Megatron's default {default!r}"
                )


def _check_like_default(name: str, value: object, default: object) -> None:
    """``value`` has the type of Megatron's ``default`` (bools are bools, dtypes dtypes)."""
    if isinstance(default, bool):
        check_flag(name, value)
    elif isinstance(default, int):
        check_int(name, value)
    elif isinstance(default, str) and not isinstance(value, str):
        raise InputTypeError(f"{name}={value!r} must be a str (Megatron's default {default!r})")
    elif isinstance(default, torch.dtype) or (default is None and "dtype" in name):
        if value is not None and not isinstance(value, torch.dtype):
            raise InputTypeError(f"{name}={value!r} must be a torch.dtype or None")
    elif default is None:
        check_optional_int(name, value)


def _need(condition: bool, message: str) -> None:
    """``ValueError(message)`` unless ``condition`` (each message names the fields, the
    values and the fix)."""
    if not condition:
        raise InputValueError(message)
