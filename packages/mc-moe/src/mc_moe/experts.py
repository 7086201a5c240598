r"""A ``transformers`` experts module split over ``ep`` and ``expt_tp``, run through the
token dispatcher.

``transformers`` (5.x) keeps a MoE layer's experts in one module whose weights are 3-D
parameters (``@use_experts_implementation``): for E experts of width I on hidden size H,
``gate_up_proj`` ``[E, 2I, H]`` (``[E, H, 2I]`` when transposed, gpt-oss) and
``down_proj`` ``[E, H, I]`` (``[E, I, H]``), optional biases ``gate_up_proj_bias``
``[E, 2I]`` / ``down_proj_bias`` ``[E, H]``, the gate/up halves concatenated
(``[gate; up]``) or interleaved (``gate0, up0, gate1, …``: gpt-oss), and the module's own
``_apply_gate`` (``act(gate) · up``, or gpt-oss's clamped variant) or ``act_fn``. Its
forward takes ``(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``.

:func:`shard_experts` converts one such module in place, keeping its class, attributes and
parameter names (so its state-dict keys stay the model's):

- **over ep** (P ranks): rank p keeps experts ``p·E/P … (p+1)·E/P − 1`` (dim 0 of every
  expert parameter);
- **over expt_tp** (Q ranks, Megatron's expert TP): the gate/up projection column-parallel
  (its 2I outputs split; ``[gate; up]`` with stride 2 so rank q keeps ``[gate_q; up_q]``,
  interleaved pairs contiguously, so rank q keeps whole (gate, up) pairs), the down
  projection row-parallel (its I inputs split); the gate/up bias split with its outputs; the
  down bias whole, added by etp rank 0 only (forward) while every etp rank gets its full
  gradient (each holds the gradient of every row it computed: the reduce-scatter's
  backward is an all-gather), so the copies stay equal without a reduction;
- **tags** (:mod:`mc_groups.param_attrs`): ``allreduce=False`` when EP > 1 or expert TP ≠
  TP (Megatron's rule; mc DDP then keeps them in the expert buffers reduced over
  ``expt_dp``), and at expert TP > 1 ``tensor_model_parallel`` / ``partition_dim`` /
  ``partition_stride`` on the split ones (the grad norm counts them on every etp rank;
  ``mc_tp_layers.full_state_dict`` gathers them over the module's ``tp_group`` = expt_tp);
- **forward**: the module's ``forward`` becomes the dispatcher's (:mod:`mc_moe.dispatcher`)
  around a loop over the local experts: for local expert e with rows ``X_e``::

      Y_e = down_e( gate(X_e · W_gu,eᵀ + b_gu,e) ) (+ b_down,e on etp rank 0)

  every local expert's weights are used even when it got no rows (an empty product), so
  DDP's gradient hooks fire on every rank.

torchtitan's ``GroupedExperts`` (``w1`` ``[E, I, H]``, ``w2`` ``[E, H, I]``, ``w3``
``[E, I, H]``; ``forward(x, num_tokens_per_expert)`` on rows its MoE module already grouped
by expert) is converted the same way (``grouped`` layout): ``w1`` / ``w3`` split over
expt_tp along I (dim 1), ``w2`` along I (dim 2); its forward becomes
:meth:`~mc_moe.dispatcher.TokenDispatcher.grouped` around the module's own class forward on
the local experts' rows (at expert TP > 1 it returns partial sums, which the dispatcher's
reduce-scatter adds).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import mc_groups as mg
from mc_groups import param_attrs
from mc_groups.argcheck import type_name
from mc_groups.errors import InputTypeError, InputValueError
from mc_moe.dispatcher import TokenDispatcher

__all__ = ["ExpertWeights", "is_converted", "read_experts", "shard_experts"]

DISPATCHER_ATTR = "_mc_moe_dispatcher"


@dataclass(frozen=True)
class ExpertWeights:
    """How a ``transformers`` experts module stores its weights (module notes).

    Attributes:
        num_experts: E (dim 0 of every expert parameter).
        intermediate: I (the width of one expert's gate, up and down projections).
        hidden: H.
        up: ``gate_up_proj`` (gated) or ``up_proj``.
        gated: the up projection carries gate and up halves (``_apply_gate``), else
            ``act_fn`` alone.
        transposed: weights stored ``[E, in, out]`` (``x @ W``) rather than ``[E, out, in]``.
        concatenated: ``[gate; up]`` halves (else interleaved pairs).
        bias: ``<up>_bias`` and ``down_proj_bias`` exist.
        grouped: torchtitan's ``GroupedExperts`` (``w1``, ``w2``, ``w3``; module notes).
    """

    num_experts: int
    intermediate: int
    hidden: int
    up: str
    gated: bool
    transposed: bool
    concatenated: bool
    bias: bool
    grouped: bool = False

    def names(self) -> tuple[str, ...]:
        """The expert parameters' names."""
        if self.grouped:
            return ("w1", "w2", "w3")
        base = (self.up, "down_proj")
        return (*base, f"{self.up}_bias", "down_proj_bias") if self.bias else base

    def split_dim(self, name: str) -> int | None:
        """The dim ``name`` is split along over expt_tp (None: kept whole)."""
        if self.grouped:
            return 2 if name == "w2" else 1  # I: dim 1 of [E, I, H], dim 2 of [E, H, I]
        if name == "down_proj_bias":
            return None
        if name == f"{self.up}_bias":
            return 1
        up_out = 2 if self.transposed else 1  # the output dim of [E, out, in] / [E, in, out]
        return up_out if name == self.up else 3 - up_out

    def stride(self, name: str) -> int:
        """``[gate; up]`` outputs are split half by half (stride 2); everything else plainly."""
        packed = self.gated and self.concatenated and not self.grouped
        return 2 if packed and name in (self.up, f"{self.up}_bias") else 1


def read_experts(module: torch.nn.Module, name: str) -> ExpertWeights:
    """The layout of ``transformers`` (or torchtitan's ``GroupedExperts``) experts module
    ``name``, or an error naming what it lacks (a module that is neither)."""
    if getattr(module, "has_post_expert_norm", False):
        raise InputValueError(
            f"{name} ({type_name(module)}) applies a norm after each expert "
            "(has_post_expert_norm=True), which mc_moe does not offer; keep its experts whole "
            "(drop its ep_plan / tp_plan entries)"
        )
    gated = bool(getattr(module, "has_gate", True))
    up = "gate_up_proj" if gated else "up_proj"
    params = dict(module.named_parameters(recurse=False))
    if up not in params and all(n in params and params[n].dim() == 3 for n in ("w1", "w2", "w3")):
        return _read_grouped(module, name, params)
    missing = [n for n in (up, "down_proj") if n not in params or params[n].dim() != 3]
    if missing:
        raise InputTypeError(
            f"{name} ({type_name(module)}) has no 3-D expert parameter(s) {missing}: mc_moe "
            "converts transformers' experts modules (gate_up_proj [E, 2I, H] and down_proj "
            "[E, H, I], @use_experts_implementation); point the plan entry at such a module"
        )
    transposed = bool(getattr(module, "is_transposed", False))
    down = params["down_proj"]
    experts, hidden, inter = (
        (down.shape[0], down.shape[2], down.shape[1])
        if transposed
        else (down.shape[0], down.shape[1], down.shape[2])
    )
    layout = ExpertWeights(
        num_experts=int(experts),
        intermediate=int(inter),
        hidden=int(hidden),
        up=up,
        gated=gated,
        transposed=transposed,
        concatenated=bool(getattr(module, "is_concatenated", True)),
        bias=bool(getattr(module, "has_bias", False)),
    )
    _check_shapes(module, name, layout, params)
    return layout


def _read_grouped(
    module: torch.nn.Module, name: str, params: dict[str, torch.nn.Parameter]
) -> ExpertWeights:
    """torchtitan's ``GroupedExperts``: ``w1`` / ``w3`` ``[E, I, H]``, ``w2`` ``[E, H, I]``."""
    experts, inter, hidden = (int(n) for n in params["w1"].shape)
    layout = ExpertWeights(
        num_experts=experts,
        intermediate=inter,
        hidden=hidden,
        up="w1",
        gated=True,
        transposed=False,
        concatenated=True,
        bias=False,
        grouped=True,
    )
    expected = {"w1": (experts, inter, hidden), "w2": (experts, hidden, inter)}
    expected["w3"] = expected["w1"]
    for pname, shape in expected.items():
        if tuple(params[pname].shape) != shape:
            raise InputValueError(
                f"{name}.{pname} has shape {tuple(params[pname].shape)}, expected {shape} for "
                f"{type_name(module)} ({experts} experts, hidden {hidden}, width {inter}): mc_moe "
                "reads torchtitan's GroupedExperts layout (w1, w3 [E, I, H]; w2 [E, H, I])"
            )
    if set(params) != set(expected):
        raise InputValueError(
            f"{name} ({type_name(module)}) holds parameters {sorted(set(params) - set(expected))} "
            "besides w1, w2, w3; mc_moe splits only torchtitan's expert weights"
        )
    return layout


def _check_shapes(
    module: torch.nn.Module,
    name: str,
    layout: ExpertWeights,
    params: dict[str, torch.nn.Parameter],
) -> None:
    e, h, i = layout.num_experts, layout.hidden, layout.intermediate
    width = 2 * i if layout.gated else i
    up = (e, h, width) if layout.transposed else (e, width, h)
    expected: dict[str, tuple[int, ...]] = {
        layout.up: up,
        "down_proj": (e, i, h) if layout.transposed else (e, h, i),
    }
    if layout.bias:
        expected.update({f"{layout.up}_bias": (e, width), "down_proj_bias": (e, h)})
    for pname, shape in expected.items():
        got = tuple(params[pname].shape) if pname in params else None
        if got != shape:
            raise InputValueError(
                f"{name}.{pname} has shape {got}, expected {shape} for {type_name(module)} "
                f"({e} experts, hidden {h}, width {i}): mc_moe reads transformers' layout"
            )
    extra = sorted(set(params) - set(expected))
    if extra:
        raise InputValueError(
            f"{name} ({type_name(module)}) holds parameters {extra} besides its expert weights; "
            "mc_moe splits only transformers' gate/up and down projections (and their biases)"
        )


def is_converted(module: torch.nn.Module) -> bool:
    """``module`` is an experts module :func:`shard_experts` converted."""
    return isinstance(getattr(module, DISPATCHER_ATTR, None), TokenDispatcher)


def shard_experts(
    module: torch.nn.Module,
    layout: ExpertWeights,
    pg_collection: mg.ProcessGroupCollection,
    *,
    tp_size: int,
) -> None:
    """Convert ``module`` in place (module notes): keep this rank's experts and expert-TP
    shards, tag them, run its forward through a :class:`~mc_moe.dispatcher.TokenDispatcher`.
    The caller checked the sizes (E divisible by EP, I by expert TP); ``tp_size`` is the
    dense TP size (for the ``allreduce`` tag). No communication."""
    ep = pg_collection.require("ep", "expert parallelism")
    expt_tp = pg_collection.require("expt_tp", "expert parallelism")
    tp_ep = pg_collection.require("tp_ep", "expert parallelism")
    dispatcher = TokenDispatcher(layout.num_experts, ep, expt_tp, tp_ep)
    etp = mg.group_size(expt_tp)
    allreduce = not (dispatcher.ep_size > 1 or etp != tp_size)
    first, local = dispatcher.first_local_expert, dispatcher.num_local_experts
    for pname in layout.names():
        old = module.get_parameter(pname)
        with torch.no_grad():
            piece = old.detach().narrow(0, first, local)
            dim = layout.split_dim(pname)
            if dim is not None and etp > 1:
                piece = _etp_piece(piece, dim, layout.stride(pname), mg.group_rank(expt_tp), etp)
            new = torch.nn.Parameter(piece.contiguous().clone(), requires_grad=old.requires_grad)
        param_attrs.mark_allreduce(new, allreduce)
        if dim is not None and etp > 1:
            param_attrs.set_tensor_model_parallel_attributes(new, True, dim, layout.stride(pname))
        setattr(module, pname, new)
    # the shards replace the whole experts on purpose: a mark record made before (by
    # mc_tp_layers.parallelize) would refuse their shapes; mc_moe.parallelize records anew
    module.__dict__.pop(param_attrs.MARK_RECORD, None)
    setattr(module, "tp_group", expt_tp)  # noqa: B010  (mc_tp_layers.full_state_dict: its group)
    setattr(module, DISPATCHER_ATTR, dispatcher)
    module.forward = types.MethodType(_grouped_forward if layout.grouped else _forward, module)


def _etp_piece(piece: torch.Tensor, dim: int, stride: int, rank: int, world: int) -> torch.Tensor:
    size = piece.shape[dim] // (stride * world)
    blocks = [piece.narrow(dim, (j * world + rank) * size, size) for j in range(stride)]
    return torch.cat(blocks, dim)


def _forward(
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
) -> torch.Tensor:
    dispatcher: TokenDispatcher = getattr(self, DISPATCHER_ATTR)
    return dispatcher(
        hidden_states, top_k_index, top_k_weights, lambda x, n: _local_experts(self, x, n)
    )


def _grouped_forward(
    self: torch.nn.Module, x: torch.Tensor, num_tokens_per_expert: torch.Tensor
) -> torch.Tensor:
    """torchtitan's interface: ``x`` grouped by expert, ``num_tokens_per_expert`` ``[E]``; the
    local experts run through the module's own class forward."""
    dispatcher: TokenDispatcher = getattr(self, DISPATCHER_ATTR)
    own = type(self).forward

    def local(rows: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        out: torch.Tensor = own(self, rows, torch.tensor(list(counts), device=rows.device))
        return out

    return dispatcher.grouped(x, num_tokens_per_expert, local)


class _OnFirstRank(torch.autograd.Function):
    """``x`` on the first etp rank, zeros elsewhere; backward passes the gradient whole on
    every rank (each holds the full gradient of the rows it computed)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, first: bool) -> torch.Tensor:
        return x if first else torch.zeros_like(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def _local_experts(
    module: torch.nn.Module, rows: torch.Tensor, counts: Sequence[int]
) -> torch.Tensor:
    """Each local expert on its contiguous rows (module notes)."""
    dispatcher: TokenDispatcher = getattr(module, DISPATCHER_ATTR)
    gated = bool(getattr(module, "has_gate", True))
    transposed = bool(getattr(module, "is_transposed", False))
    bias = bool(getattr(module, "has_bias", False))
    up = module.get_parameter("gate_up_proj" if gated else "up_proj")
    down = module.get_parameter("down_proj")
    first_etp = mg.group_rank(dispatcher.expt_tp) == 0
    outs = []
    for e, x in enumerate(torch.split(rows, list(counts), dim=0)):
        w_up, w_down = up[e], down[e]
        h = x @ w_up if transposed else x @ w_up.t()
        if bias:
            h = h + module.get_parameter(f"{'gate_up_proj' if gated else 'up_proj'}_bias")[e]
        h = module._apply_gate(h) if gated else module.act_fn(h)  # type: ignore[operator]
        y = h @ w_down if transposed else h @ w_down.t()
        if bias:
            bias_e = module.get_parameter("down_proj_bias")[e]
            y = y + _OnFirstRank.apply(bias_e, first_etp)  # type: ignore[no-untyped-call]
        outs.append(y)
    return torch.cat(outs, dim=0)
