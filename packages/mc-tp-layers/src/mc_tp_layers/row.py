r"""``RowParallelLinear``: ``Y = X·A + b`` with A split along its input dimension.

::

            A = [ A_1 ; A_2 ; … ; A_W ]  (rows)    X = [ X_1 | … | X_W ]   (last dim)
    rank r: Y_r = X_r · A_r                        (a partial sum, [s, b, n])
            Y   = Σ_r Y_r + b                       (all-reduce, or reduce-scatter along
                                                    dim 0 under sequence parallelism)

torch stores Aᵀ: the weight is ``[n, k/W]`` per rank; the bias ``[n]`` is replicated and
added after the reduction.

Collectives (W > 1)::

    sequence_parallel off: forward  one all-reduce of Y          backward —
    sequence_parallel on:  forward  one reduce-scatter of Y      backward one all-gather
                                    along dim 0                           of dY along dim 0

With ``input_is_parallel=False`` the input ``[.., k]`` is first split along its last dim
(no communication; backward all-gathers dX). Experts (``is_expert`` with TP or EP > 1)
return the partial sums: the MoE layer reduces them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from mc_groups import ProcessGroupCollection, param_attrs
from mc_groups.argcheck import check_flag, check_optional_str
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputValueError
from mc_tp_layers import _layer_base as base
from mc_tp_layers._config import expert_parallel, gtp_remat_size
from mc_tp_layers._layer_base import ParallelLinear
from mc_tp_layers._tp_groups import resolve_gtp_group, resolve_tp_group
from mc_tp_layers._validate import check_divisible, check_input, check_sequence, main_grad
from mc_tp_layers.initialization import InitMethod, WeightInit
from mc_tp_layers.linear import Reduction, apply_linear, check_operands
from mc_tp_layers.mappings import (
    reduce_layer_output,
    reduce_scatter_layer_output,
    scatter_to_tensor_model_parallel_region,
)
from mc_tp_layers.random import RNGStatesTracker

__all__ = ["RowParallelLinear"]


class RowParallelLinear(ParallelLinear):
    """Linear layer with row parallelism (see the module notes for the math and schedule).

    Args:
        input_size: k, the first dimension of A; must divide by the TP size.
        output_size: n, the second dimension of A.
        config: the layer config (:class:`mc_groups.TransformerConfigLike`).
        init_method: fills a weight tensor in place; the bias always starts at zero.
        bias: allocate a replicated bias ``[n]``.
        input_is_parallel: the input is already split along its last dim (required under
            sequence parallelism).
        skip_bias_add: return the bias instead of adding it.
        stride: the weight's parts are strided along the input dim.
        keep_master_weight_for_test: keep the CPU master weight as ``self.master_weight``.
        is_expert: an MoE expert layer (``expt_tp`` group; no reduction here).
        tp_comm_buffer_name: Transformer-Engine userbuffer name; unused.
        tp_group: the tensor-parallel group (default: ``pg_collection``'s, then the
            default collection's).
        name: a label kept as ``self.name``.
        pg_collection: groups to read ``tp`` / ``gtp_remat`` from.
        rng_tracker: the RNG tracker for device initialisation (mc addition).
        device: where to allocate (mc addition).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfigLike,
        init_method: InitMethod,
        bias: bool,
        input_is_parallel: bool,
        skip_bias_add: bool,
        stride: int = 1,
        keep_master_weight_for_test: bool = False,
        is_expert: bool = False,
        tp_comm_buffer_name: str | None = None,
        tp_group: dist.ProcessGroup | None = None,
        name: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        rng_tracker: RNGStatesTracker | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__(config, input_size, output_size)
        self.input_is_parallel = check_flag("input_is_parallel", input_is_parallel)
        self.skip_bias_add = check_flag("skip_bias_add", skip_bias_add)
        self.is_expert = check_flag("is_expert", is_expert)
        with_bias = check_flag("bias", bias)
        keep_master = check_flag("keep_master_weight_for_test", keep_master_weight_for_test)
        self.tp_comm_buffer_name = check_optional_str("tp_comm_buffer_name", tp_comm_buffer_name)
        self.name = check_optional_str("name", name)
        tracker = base.check_tracker(rng_tracker)
        explicit_device = base.check_device(device)
        self.sequence_parallel = self.config.sequence_parallel
        if self.sequence_parallel and not self.input_is_parallel:
            raise InputValueError(
                "config.sequence_parallel=True needs input_is_parallel=True: under sequence "
                "parallelism the input arrives split along its last dim"
            )
        self.tp_group = resolve_tp_group(
            tp_group, pg_collection, is_expert=self.is_expert, what="RowParallelLinear"
        )
        world = int(self.tp_group.size())
        self.input_size_per_partition = check_divisible(
            input_size, world, "input_size", "choose an input_size that is a multiple of it"
        )
        self._check_split(output_size, "input", self.input_size_per_partition, stride, init_method)
        self.gtp_remat_size = gtp_remat_size(self.config)
        self.gtp_group = resolve_gtp_group(
            self.gtp_remat_size, pg_collection, is_expert=self.is_expert, what="RowParallelLinear"
        )
        self.expert_parallel = expert_parallel(self.config)
        self.explicit_expert_comm = self.is_expert and (world > 1 or self.expert_parallel)
        self.gradient_accumulation_fusion = self.config.gradient_accumulation_fusion
        # How the output is reduced over TP (None: an expert's partial sums stay as they
        # are, the MoE layer reduces them; nothing to reduce on one rank), and whether
        # _forward_impl does it (its default; an override returns the partial sums)
        self._reduction: Reduction | None = None
        if not self.explicit_expert_comm and world > 1:
            self._reduction = "reduce-scatter" if self.sequence_parallel else "all-reduce"
        self._linear_reduces = type(self)._forward_impl is RowParallelLinear._forward_impl
        target = base.layer_device(explicit_device, self.config, self.tp_group)
        init = WeightInit(self.config, init_method, tracker, self.tp_group)
        init.check_tracker()
        shape = (self.output_size, self.input_size_per_partition)
        self.weight = self._new_weight(init, target, shape, 1, stride, keep_master)
        self._set_bias(self._make_bias(target) if with_bias else None)
        self._record_construction(
            {
                "input_size": input_size,
                "output_size": output_size,
                "bias": with_bias,
                "input_is_parallel": self.input_is_parallel,
                "skip_bias_add": self.skip_bias_add,
                "sequence_parallel": self.sequence_parallel,
                "stride": stride,
                "is_expert": self.is_expert,
                "explicit_expert_comm": self.explicit_expert_comm,
                "gtp_remat_size": self.gtp_remat_size,
            },
            self.name,
        )

    def _make_bias(self, device: torch.device) -> torch.nn.Parameter:
        bias = self._new_bias(device, self.output_size, False, -1, 1)
        # Under SP each rank's bias gradient sums only its own rows: finalize_model_grads
        # all-reduces parameters tagged sequence_parallel over the dense TP group. An expert
        # layer's bias is not tagged (mc differs from Megatron-Core here): its tokens come
        # from the MoE dispatcher, not from a reduce-scatter over the dense TP group, and its
        # grad is reduced by DDP (over expt_dp when ETP != TP), so the TP sum would double
        # count it (a doubled grad at TP = 2, ETP = 1: integration_tests/test_parity_experts).
        tagged = self.sequence_parallel and not self.is_expert
        param_attrs.mark_sequence_parallel(bias, tagged)
        return bias

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(Y, bias)``: Y ``[s, b, n]`` (``[s/W, b, n]`` under SP); bias when ``skip_bias_add``.

        Args:
            input_: ``[s, b, k/W]`` when ``input_is_parallel`` else ``[s, b, k]`` (or 2-D).

        The first forward first compares this TP group's pending layer constructions (see
        :mod:`mc_tp_layers.agreement`).
        """
        x, weight, bias = self._checked(self._check_call, input_)
        if not (self.input_is_parallel or self.explicit_expert_comm):
            x = scatter_to_tensor_model_parallel_region(x, group=self.tp_group)
        output = self._forward_impl(
            input=x,
            weight=weight,
            bias=None,
            gradient_accumulation_fusion=self.gradient_accumulation_fusion,
            allreduce_dgrad=False,
            sequence_parallel=False,
            tp_group=self.tp_group,
            gtp_remat_size=self.gtp_remat_size,
        )
        if not self._linear_reduces:
            output = self._reduce(output)
        if self.skip_bias_add or bias is None:
            return output, bias if self.skip_bias_add else None
        return output + bias, None

    def _forward_impl(
        self, input: torch.Tensor, weight: torch.Tensor, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        """Megatron's hook for the layer's linear; this default also reduces the output
        over TP (all-reduce, or reduce-scatter along dim 0 under sequence parallelism;
        nothing for an expert layer): in the linear's own autograd node when the weight
        is trained (:func:`~mc_tp_layers.linear.apply_linear`'s ``reduce_output``: one
        node less per call than Megatron's two Functions, same collectives and values),
        else after the frozen-weight function. An override keeps Megatron's contract: it
        returns the partial sums, and forward reduces them (``_linear_reduces``, decided
        when the layer is built)."""
        if self._reduction is None or not weight.requires_grad:
            return self._reduce(super()._forward_impl(input, weight, *args, **kwargs))
        return apply_linear(input, weight, *args, reduce_output=self._reduction, **kwargs)

    def _check_call(
        self, input_: object
    ) -> tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter | None]:
        """A forward's input checked, with the weight and bias it meets."""
        last = self.input_size_per_partition if self.input_is_parallel else self.input_size
        x = check_input(input_, last, "RowParallelLinear")
        weight, bias = self._weight_and_bias()
        check_operands(x, weight, None, None, width=self.input_size_per_partition)
        if self.sequence_parallel and not self.explicit_expert_comm:
            check_sequence(x, int(self.tp_group.size()))
        if self.gradient_accumulation_fusion and weight.requires_grad:
            main_grad(weight)
        return x, weight, bias

    def _reduce(self, output_parallel: torch.Tensor) -> torch.Tensor:
        """Megatron's reduction of the partial sums, as its own autograd Function."""
        if self.explicit_expert_comm:
            return output_parallel
        if self.sequence_parallel:
            return reduce_scatter_layer_output(output_parallel, self.tp_group)
        return reduce_layer_output(output_parallel, self.tp_group)

    def extra_repr(self) -> str:
        """Sizes, bias and TP degree, e.g. ``in_features=16, out_features=8, bias=True, TP=2``."""
        return (
            f"{self._repr_sizes()}, input_is_parallel={self.input_is_parallel}, "
            f"sequence_parallel={self.sequence_parallel}"
        )
