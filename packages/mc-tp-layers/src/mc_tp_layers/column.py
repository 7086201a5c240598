r"""``ColumnParallelLinear``: ``Y = X·A + b`` with A split along its output dimension.

::

            A = [ A_1 | A_2 | … | A_W ]           (torch stores Aᵀ: weight [n/W, k] per rank)
    rank r: Y_r = X · A_r + b_r                    ([s, b, n/W])
            Y   = [ Y_1 | … | Y_W ]                (only with gather_output)

Collectives (W > 1; a weight that does not require grad uses the frozen-weight path):

    sequence_parallel off:  forward  —                        (all-gather Y if gather_output)
                            backward one all-reduce of dX      (async, overlaps the wgrad GEMM)
    sequence_parallel on:   forward  one all-gather of X along dim 0
                            backward one all-gather of X (async, overlaps the dgrad GEMM) and
                                     one reduce-scatter of dX (async, issued before the wgrad
                                     GEMM runs)

Experts (``is_expert`` with TP or EP > 1) communicate explicitly in the MoE layer: no
collective here. ``disable_grad_reduce`` drops the dX all-reduce (e.g. LoRA adapters).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from mc_groups import ProcessGroupCollection
from mc_groups.argcheck import check_flag, check_float_dtype, check_optional_str, check_tensor
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputValueError
from mc_tp_layers import _layer_base as base
from mc_tp_layers._config import (
    expert_parallel,
    gtp_remat_size,
    sequence_parallel,
)
from mc_tp_layers._layer_base import ParallelLinear
from mc_tp_layers._tp_groups import resolve_gtp_group, resolve_tp_group
from mc_tp_layers._validate import check_divisible, check_input, main_grad
from mc_tp_layers.gtp import unsharded_shape
from mc_tp_layers.initialization import InitMethod, WeightInit
from mc_tp_layers.linear import check_operands
from mc_tp_layers.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
)
from mc_tp_layers.random import RNGStatesTracker

__all__ = ["ColumnParallelLinear"]


class ColumnParallelLinear(ParallelLinear):
    """Linear layer with column parallelism (see the module notes for the math and schedule).

    Args:
        input_size: k, the first dimension of A (the input features).
        output_size: n, the second dimension of A; must divide by the TP size.
        config: the layer config (:class:`mc_groups.TransformerConfigLike`).
        init_method: fills a weight tensor in place; the bias always starts at zero.
        bias: allocate a bias ``[n/W]`` (TP-sharded like the weight).
        gather_output: all-gather Y so every rank holds ``[s, b, n]``.
        stride: the weight's parts are strided (fused weights; see
            :mod:`mc_tp_layers.initialization`).
        keep_master_weight_for_test: keep the CPU-initialised master weight as
            ``self.master_weight``.
        skip_bias_add: return the bias instead of adding it (for fusion by the caller).
        skip_weight_param_allocation: allocate no weight; forward must get ``weight=``.
        embedding_activation_buffer: with ``config.defer_embedding_wgrad_compute``, holds
            the inputs whose wgrad is deferred.
        grad_output_buffer: with ``config.defer_embedding_wgrad_compute``, holds the
            output gradients whose wgrad is deferred.
        is_expert: an MoE expert layer (``expt_tp`` group; no collectives here).
        tp_comm_buffer_name: Transformer-Engine userbuffer name; unused.
        disable_grad_reduce: skip the all-reduce of dX.
        tp_group: the tensor-parallel group (default: ``pg_collection``'s, then the
            default collection's).
        name: a label kept as ``self.name``.
        output_dtype: dtype of Y when it should differ from X's.
        pg_collection: groups to read ``tp`` / ``gtp_remat`` from.
        rng_tracker: the RNG tracker for device initialisation (mc addition: Megatron
            reads a global one).
        device: where to allocate (mc addition; default: CPU under CPU initialisation,
            else the group's device).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfigLike,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        skip_bias_add: bool = False,
        skip_weight_param_allocation: bool = False,
        embedding_activation_buffer: list[torch.Tensor] | None = None,
        grad_output_buffer: list[torch.Tensor] | None = None,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        disable_grad_reduce: bool = False,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
        output_dtype: torch.dtype | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config, input_size, output_size)
        self.gather_output = check_flag("gather_output", gather_output)
        self.skip_bias_add = check_flag("skip_bias_add", skip_bias_add)
        self.is_expert = check_flag("is_expert", is_expert)
        self.disable_grad_reduce = check_flag("disable_grad_reduce", disable_grad_reduce)
        with_bias = check_flag("bias", bias)
        keep_master = check_flag("keep_master_weight_for_test", keep_master_weight_for_test)
        skip_weight = check_flag("skip_weight_param_allocation", skip_weight_param_allocation)
        self.embedding_activation_buffer = base.check_buffer(
            "embedding_activation_buffer", embedding_activation_buffer
        )
        self.grad_output_buffer = base.check_buffer("grad_output_buffer", grad_output_buffer)
        self.tp_comm_buffer_name = check_optional_str("tp_comm_buffer_name", tp_comm_buffer_name)
        self.name = check_optional_str("name", name)
        self.output_dtype = check_float_dtype("output_dtype", output_dtype, allow_none=True)
        tracker = base.check_tracker(rng_tracker)
        explicit_device = base.check_device(device)
        self.tp_group = resolve_tp_group(
            tp_group, pg_collection, is_expert=self.is_expert, what="ColumnParallelLinear"
        )
        self.output_size_per_partition = check_divisible(
            output_size,
            self.tp_group.size(),
            "output_size",
            "choose an output_size that is a multiple of it",
        )
        self._check_arguments(input_size, stride, init_method)
        self._set_communication(pg_collection)
        init = WeightInit(self.config, init_method, tracker, self.tp_group)
        target = base.layer_device(explicit_device, self.config, self.tp_group)
        self.weight: torch.nn.Parameter | None = None
        if not skip_weight:
            init.check_tracker()
            shape = (self.output_size_per_partition, self.input_size)
            self.weight = self._new_weight(init, target, shape, 0, stride, keep_master)
        self._set_bias(
            self._new_bias(target, self.output_size_per_partition, True, 0, stride)
            if with_bias
            else None
        )
        self._record_construction(
            {
                "input_size": input_size,
                "output_size": output_size,
                "bias": with_bias,
                "gather_output": self.gather_output,
                "skip_bias_add": self.skip_bias_add,
                "sequence_parallel": self.sequence_parallel,
                "stride": stride,
                "is_expert": self.is_expert,
                "explicit_expert_comm": self.explicit_expert_comm,
                "disable_grad_reduce": self.disable_grad_reduce,
                "gtp_remat_size": self.gtp_remat_size,
                "output_dtype": self.output_dtype,
                "defer_embedding_wgrad_compute": self.config.defer_embedding_wgrad_compute,
                "wgrad_deferral_limit": self.config.wgrad_deferral_limit,
            },
            self.name,
        )

    def _set_communication(self, pg_collection: ProcessGroupCollection | None) -> None:
        """Which collectives this layer issues (see the module notes)."""
        world = int(self.tp_group.size())
        self.gtp_remat_size = gtp_remat_size(self.config)
        self.gtp_group = resolve_gtp_group(
            self.gtp_remat_size,
            pg_collection,
            is_expert=self.is_expert,
            what="ColumnParallelLinear",
        )
        self.expert_parallel = expert_parallel(self.config)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        self.sequence_parallel = sequence_parallel(self.config, world, "ColumnParallelLinear")
        self.allreduce_dgrad = (
            world > 1 and not self.sequence_parallel and not self.disable_grad_reduce
        )
        self.gradient_accumulation_fusion = bool(self.config.gradient_accumulation_fusion)
        # f (identity forward, all-reduce of dX in backward) only where the linear function
        # does not reduce dX itself and nothing else does (Megatron's condition)
        self._copy_input = not (
            self.allreduce_dgrad
            or self.sequence_parallel
            or self.explicit_expert_comm
            or self.disable_grad_reduce
        )

    def _check_arguments(self, input_size: int, stride: int, init_method: object) -> None:
        self._check_split(input_size, "output", self.output_size_per_partition, stride, init_method)
        if self.config.defer_embedding_wgrad_compute and (
            self.embedding_activation_buffer is None or self.grad_output_buffer is None
        ):
            raise InputValueError(
                "config.defer_embedding_wgrad_compute=True needs embedding_activation_buffer "
                "and grad_output_buffer lists; pass both (e.g. [] and [])"
            )

    def _resolve_weight(
        self, weight: torch.Tensor | None, own: torch.nn.Parameter | None
    ) -> torch.Tensor:
        """``weight`` (checked), else the layer's own weight ``own``."""
        if weight is None:
            if own is None:
                raise InputValueError(
                    "ColumnParallelLinear was built with skip_weight_param_allocation=True, so "
                    "forward needs weight=<tensor of shape "
                    f"[{self.output_size_per_partition}, {self.input_size}]>"
                )
            return own
        check_tensor("weight", weight)
        expected = (self.output_size_per_partition, self.input_size)
        actual = unsharded_shape(weight) if self.gtp_remat_size > 1 else tuple(weight.shape)
        if tuple(actual) != expected:
            raise InputValueError(
                f"weight has shape {tuple(weight.shape)} but this layer needs {list(expected)} "
                f"([output_size / TP size, input_size])"
            )
        return weight

    def _check_call(
        self, input_: object, weight: torch.Tensor | None, runtime_gather_output: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """A forward's arguments checked: the input, the weight and the bias to add."""
        own_weight, own_bias = self._weight_and_bias()
        w = self._resolve_weight(weight, own_weight)
        x = check_input(input_, self.input_size, "ColumnParallelLinear")
        bias = None if self.skip_bias_add else own_bias
        check_operands(x, w, bias, self.output_dtype, self.output_size_per_partition)
        if runtime_gather_output is not None:
            check_flag("runtime_gather_output", runtime_gather_output)
        if self.gradient_accumulation_fusion and w.requires_grad:
            main_grad(w)
        return x, w, bias

    def _defer_activation(self, input_parallel: torch.Tensor) -> None:
        buffer = self.embedding_activation_buffer
        limit = self.config.wgrad_deferral_limit
        if buffer is not None and (limit == 0 or len(buffer) < limit):
            buffer.append(input_parallel)

    def forward(
        self,
        input_: torch.Tensor,
        weight: torch.Tensor | None = None,
        runtime_gather_output: bool | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Y, bias)``: Y ``[s, b, n/W]`` (``[s, b, n]`` gathered); bias when ``skip_bias_add``.

        Args:
            input_: ``[s, b, k]`` (``[s/W, b, k]`` under sequence parallelism), or 2-D.
            weight: the weight to use (needed with ``skip_weight_param_allocation``).
            runtime_gather_output: overrides ``gather_output`` for this call (a bool, or
                None to keep it).

        The first forward first compares this TP group's pending layer constructions (see
        :mod:`mc_tp_layers.agreement`).
        """
        x, w, bias = self._checked(self._check_call, input_, weight, runtime_gather_output)
        deferring = self.config.defer_embedding_wgrad_compute and w.requires_grad
        if self._copy_input:
            x = copy_to_tensor_model_parallel_region(x, group=self.tp_group)
        if deferring:
            self._defer_activation(x)
        expert = self.explicit_expert_comm
        output_parallel = self._forward_impl(
            input=x,
            weight=w,
            bias=bias,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False if expert else self.allreduce_dgrad,
            sequence_parallel=False if expert else self.sequence_parallel,
            grad_output_buffer=self.grad_output_buffer if deferring else None,
            wgrad_deferral_limit=self.config.wgrad_deferral_limit if deferring else None,
            tp_group=self.tp_group,
            gtp_remat_size=self.gtp_remat_size,
            output_dtype=self.output_dtype,
        )
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if gather:
            output = gather_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)
        else:
            output = output_parallel
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        """Sizes, bias and TP degree, e.g. ``in_features=8, out_features=16, bias=True, TP=2``."""
        return (
            f"{self._repr_sizes()}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
