"""``ModelParallelConfig``: the parallelism settings the layers and DDP read.

Field names and defaults are Megatron-Core's so a ``megatron.core.ModelParallelConfig`` or
``TransformerConfig`` can be passed wherever mc reads a config: mc functions accept any
object with the attributes they read (each package declares a ``Protocol`` of them), and
this dataclass is the validated default for users without Megatron.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from mc_groups.argcheck import check_flag, check_float_dtype, check_int, check_optional_int
from mc_groups.errors import InputValueError

__all__ = ["ModelParallelConfig"]

_INT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "gtp_remat_size",
)
_BOOL_FIELDS = (
    "sequence_parallel",
    "perform_initialization",
    "use_cpu_initialization",
    "fp16",
    "bf16",
    "gradient_accumulation_fusion",
    "defer_embedding_wgrad_compute",
    "calculate_per_token_loss",
    "delay_wgrad_compute",
    "tp_comm_overlap",
)


@dataclass
class ModelParallelConfig:
    """Parallel layout and layer-behaviour switches (Megatron-Core field names).

    Attributes:
        tensor_model_parallel_size: ranks a tensor-parallel layer is split over.
        pipeline_model_parallel_size: pipeline stages.
        virtual_pipeline_model_parallel_size: model chunks per pipeline rank, or None.
        sequence_parallel: shard activations outside the TP region along the sequence
            (dim 0); needs ``tensor_model_parallel_size > 1``.
        context_parallel_size / expert_model_parallel_size / expert_tensor_parallel_size /
            gtp_remat_size: the other axis sizes.
        perform_initialization: run ``init_method`` on new weights (False leaves them
            uninitialised; TP attributes are still set).
        use_cpu_initialization: build the full fp32 master weight on CPU and keep this
            rank's slice, so a TP=N model equals the TP=1 model sliced.
        params_dtype: dtype of the layer parameters (a floating-point dtype).
        fp16 / bf16: mixed-precision flags (mutually exclusive).
        gradient_accumulation_fusion: accumulate weight gradients straight into
            ``weight.main_grad`` (the DDP grad buffer).
        defer_embedding_wgrad_compute / wgrad_deferral_limit: defer the LM-head weight
            gradient GEMM of the last pipeline stage (limit 0 = all micro-batches).
        calculate_per_token_loss: losses are summed per token and normalised in
            finalize_model_grads instead of averaged per micro-batch.
        delay_wgrad_compute: weight gradients computed in ``backward_dw``.
        tp_comm_overlap: userbuffer overlap (Transformer Engine only; rejected here).
    """

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None
    gtp_remat_size: int = 1
    perform_initialization: bool = True
    use_cpu_initialization: bool = False
    params_dtype: torch.dtype = torch.float32
    fp16: bool = False
    bf16: bool = False
    gradient_accumulation_fusion: bool = False
    defer_embedding_wgrad_compute: bool = False
    wgrad_deferral_limit: int = 0
    calculate_per_token_loss: bool = False
    delay_wgrad_compute: bool = False
    tp_comm_overlap: bool = False

    def __post_init__(self) -> None:
        self._check_types()
        self._check_combinations()

    def _check_types(self) -> None:
        for name in _INT_FIELDS:
            check_int(name, getattr(self, name))
        for name in ("virtual_pipeline_model_parallel_size", "expert_tensor_parallel_size"):
            check_optional_int(name, getattr(self, name))
        for name in _BOOL_FIELDS:
            check_flag(name, getattr(self, name))
        check_float_dtype("params_dtype", self.params_dtype)
        check_int("wgrad_deferral_limit", self.wgrad_deferral_limit, minimum=0)

    def _check_combinations(self) -> None:
        if self.sequence_parallel and self.tensor_model_parallel_size <= 1:
            raise InputValueError(
                "sequence_parallel=True needs tensor_model_parallel_size > 1 (got "
                f"{self.tensor_model_parallel_size}); sequence parallelism shards activations "
                "over the tensor-parallel group"
            )
        if self.fp16 and self.bf16:
            raise InputValueError("fp16=True and bf16=True: choose one mixed-precision mode")
        vpp = self.virtual_pipeline_model_parallel_size
        if vpp is not None and self.pipeline_model_parallel_size <= 1:
            raise InputValueError(
                f"virtual_pipeline_model_parallel_size={vpp} needs "
                f"pipeline_model_parallel_size > 1 (got {self.pipeline_model_parallel_size})"
            )
        if self.tp_comm_overlap:
            raise InputValueError(
                "tp_comm_overlap=True needs Transformer Engine userbuffers, which mc's "
                "pure-torch layers do not use; set tp_comm_overlap=False"
            )

    def replace(self, **changes: object) -> ModelParallelConfig:
        """A validated copy with ``changes`` applied (unknown names are a ValueError)."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InputValueError(f"ModelParallelConfig has no field(s) {unknown}")
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return ModelParallelConfig(**values)
