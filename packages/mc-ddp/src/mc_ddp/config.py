"""``DistributedDataParallelConfig``: Megatron-Core's DDP knobs (the non-FSDP ones), validated.

Field names and defaults are Megatron's, so a Megatron config ports by changing the import.
Validation runs in ``__post_init__`` and again when :class:`~mc_ddp.DistributedDataParallel`
is built (:meth:`DistributedDataParallelConfig.validate`), because Megatron code often sets
fields after construction. Wrong types are ``TypeError`` (``bucket_size=True`` is not the
size 1); incompatible combinations are ``ValueError`` naming both fields.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass, field

from mc_ddp._config_checks import check_flag, check_optional_count, check_patterns, need

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
    "fp8_param_gather",
    "fp4_param_gather",
    "delay_wgrad_compute",
)


def _have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


@dataclass
class DistributedDataParallelConfig:
    """How :class:`~mc_ddp.DistributedDataParallel` buckets, reduces and gathers.

    Attributes:
        grad_reduce_in_fp32: keep ``main_grad`` and reduce gradients in fp32 (a bf16 model
            gets an fp32 grad buffer).
        overlap_grad_reduce: dispatch each bucket group's reduction asynchronously from the
            backward hooks as soon as its grads are ready (else one synchronous reduction of
            one bucket in ``finish_grad_sync``).
        overlap_param_gather: distributed optimizer only: all-gather params asynchronously,
            bucket group by bucket group, from forward pre-hooks.
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
        fp8_param_gather / fp4_param_gather: need Transformer Engine.
        delay_wgrad_compute: params marked ``skip_backward_post_hook`` get their DDP hook
            from their module's ``register_wgrad_accumulation_and_reduce_hooks``.
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
    average_in_collective: bool = False
    reduce_scatter_with_fp32_accumulation: bool = False
    param_name_patterns_for_fp32_local_accumulation: Sequence[str] = field(default_factory=list)
    fp8_param_gather: bool = False
    fp4_param_gather: bool = False
    delay_wgrad_compute: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field's type, then every combination (see the class docstring)."""
        self._check_types()
        self._check_combinations()
        self._check_low_precision_gather()

    def _check_types(self) -> None:
        for name in _FLAGS:
            check_flag(name, getattr(self, name))
        instances = self.num_distributed_optimizer_instances
        check_optional_count("num_distributed_optimizer_instances", instances, allow_none=False)
        check_optional_count("bucket_size", self.bucket_size)
        check_optional_count("num_buckets", self.num_buckets)
        check_patterns(self.param_name_patterns_for_fp32_local_accumulation)

    def _check_combinations(self) -> None:
        dist_opt = self.use_distributed_optimizer
        need(
            self.num_distributed_optimizer_instances == 1 or dist_opt,
            f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances} "
            "needs use_distributed_optimizer=True (the instances shard the optimizer)",
        )
        need(
            self.bucket_size is None or self.num_buckets is None,
            f"bucket_size={self.bucket_size} and num_buckets={self.num_buckets} both set: "
            "give one of them",
        )
        need(
            not self.overlap_param_gather or dist_opt,
            "overlap_param_gather=True needs use_distributed_optimizer=True (only the "
            "distributed optimizer all-gathers params)",
        )
        need(
            not self.align_param_gather or self.overlap_param_gather,
            "align_param_gather=True needs overlap_param_gather=True (it aligns the "
            "overlapped param all-gathers)",
        )
        need(
            not (self.param_name_patterns_for_fp32_local_accumulation and self.grad_reduce_in_fp32),
            "param_name_patterns_for_fp32_local_accumulation="
            f"{list(self.param_name_patterns_for_fp32_local_accumulation)} with "
            "grad_reduce_in_fp32=True: grads already accumulate in fp32; drop one of them",
        )
        self._check_fp32_reduce_scatter()

    def _check_fp32_reduce_scatter(self) -> None:
        if not self.reduce_scatter_with_fp32_accumulation:
            return
        need(
            self.use_distributed_optimizer,
            "reduce_scatter_with_fp32_accumulation=True needs use_distributed_optimizer=True "
            "(without it gradients are all-reduced, not reduce-scattered)",
        )
        need(
            self.num_distributed_optimizer_instances == 1,
            "reduce_scatter_with_fp32_accumulation=True with "
            f"num_distributed_optimizer_instances={self.num_distributed_optimizer_instances}: "
            "the fp32-accumulating reduce-scatter supports one instance only",
        )

    def _check_low_precision_gather(self) -> None:
        for name in ("fp8_param_gather", "fp4_param_gather"):
            if getattr(self, name) and not _have_transformer_engine():
                raise ValueError(
                    f"{name}=True needs Transformer Engine (its fp8/fp4 tensor types), which "
                    "is not installed: pip install transformer-engine, or set "
                    f"{name}=False"
                )
        need(
            not (self.fp8_param_gather and self.fp4_param_gather),
            "fp8_param_gather=True and fp4_param_gather=True: choose one",
        )
