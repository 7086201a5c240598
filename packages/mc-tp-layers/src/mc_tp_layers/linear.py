r"""The linear autograd functions: GEMM plus the tensor-parallel communication around it.

``Y = X·Wᵀ + b`` with ``X: [s, b, k]`` (s: sequence, on dim 0) and ``W: [n, k]``.

Forward of :class:`LinearWithGradAccumulationAndAsyncCommunication`::

    W_full = all-gather(W) over gtp_remat          (only when gtp_remat_size > 1)
    X_tot  = all-gather(X) along dim 0 over TP      (only under sequence parallelism)
    Y      = X_tot · W_fullᵀ + b                    (saves X, not X_tot)

Backward, in issue order (collectives are asynchronous so they overlap the GEMMs)::

    1. start all-gather of X along dim 0          (SP, when the wgrad is computed now)
    2. dX = dY · W_full                            (dgrad GEMM; W_full re-gathered if GTP)
    3. wait for 1
    4. start all-reduce of dX over TP             (allreduce_dgrad), or
       start reduce-scatter of dX along dim 0     (SP; rank r keeps its rows)
    5. dW = dYᵀ · X_tot                            (wgrad GEMM, overlapping 4), either
         - returned as W's gradient, or
         - added into W.main_grad (gradient_accumulation_fusion: apex kernel or addmm_;
           W.grad_added_to_main_grad = True and a dummy gradient is returned when W
           carries that attribute, else None), or
         - deferred: dY is appended to grad_output_buffer (embedding wgrad deferral,
           see :func:`drain_embedding_wgrad_compute`)
       GTP: dW is padded, pre-scaled by the shard's gtp_wgrad_scale (1/G: the mean over
       gtp_remat; 1 under calculate_per_token_loss) and SUM-reduce-scattered over
       gtp_remat (rank g keeps its rows); see :mod:`mc_tp_layers.gtp`.
    6. db = Σ dY over every dim but the last
    7. wait for 4, return dX

:class:`LinearWithFrozenWeight` saves only W and returns only dX (plus db when the bias
needs a gradient): no weight gradient, no saved activations.

Both are applied in one place each (``_apply_linear``, :func:`linear_with_frozen_weight`):
the public functions check every argument first; a layer checks its own when it is built
and its operands per call (``_check_operands``), then applies through Megatron's
``_forward_impl`` hook. A row layer's linear carries the reduction of its output in the
same autograd node (``_apply_linear``'s ``reduce_output``). The GEMM kernels (TE,
apex, torch's mixed-dtype GEMM) are :mod:`mc_tp_layers._gemm`'s.

Embedding (LM-head) weight-gradient deferral: with ``config.defer_embedding_wgrad_compute``
the output layer (a :class:`~mc_tp_layers.ColumnParallelLinear` on the last pipeline
stage) appends its input to ``embedding_activation_buffer`` in forward and, in backward,
its output gradient to ``grad_output_buffer`` instead of running the wgrad GEMM (at most
``wgrad_deferral_limit`` micro-batches; 0 = all). The pipeline schedule then calls
:func:`drain_embedding_wgrad_compute` once, where the GEMMs can overlap other work.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_float_dtype, check_int, check_tensor, type_name
from mc_groups.comm import traceable
from mc_groups.config import TransformerConfigLike
from mc_groups.errors import InputTypeError, InputValueError
from mc_tp_layers._gemm import _linear_forward, _wgrad_gemm, accumulate_wgrad
from mc_tp_layers.gtp import gather_gtp_weight, reduce_scatter_gtp_grad, unsharded_shape
from mc_tp_layers.mappings import _apply, _min_dims, gather_from_sequence_parallel_region
from mc_tp_layers.utils import _resolve_tp_group

__all__ = [
    "LinearWithFrozenWeight",
    "LinearWithGradAccumulationAndAsyncCommunication",
    "drain_embedding_wgrad_compute",
    "linear_with_frozen_weight",
    "linear_with_grad_accumulation_and_async_allreduce",
]


class _Options(NamedTuple):
    """What backward needs besides the saved tensors."""

    gradient_accumulation_fusion: bool
    allreduce_dgrad: bool
    sequence_parallel: bool
    grad_output_buffer: list[torch.Tensor] | None
    wgrad_deferral_limit: int
    tp_group: dist.ProcessGroup
    gtp_remat_size: int
    output_dtype: torch.dtype | None


_NO_GRADS = (None,) * 8
"""The gradients of the function's eight non-tensor arguments."""


class LinearWithGradAccumulationAndAsyncCommunication(torch.autograd.Function):
    """See :func:`linear_with_grad_accumulation_and_async_allreduce` and the module notes."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        allreduce_dgrad: bool,
        sequence_parallel: bool,
        grad_output_buffer: list[torch.Tensor] | None,
        wgrad_deferral_limit: int,
        tp_group: dist.ProcessGroup,
        gtp_remat_size: int,
        output_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """Gather (GTP weight, SP input), then ``Y = X_tot · Wᵀ + b``."""
        opts = _Options(
            gradient_accumulation_fusion,
            allreduce_dgrad,
            sequence_parallel,
            grad_output_buffer,
            wgrad_deferral_limit,
            tp_group,
            gtp_remat_size,
            output_dtype,
        )
        return _forward(ctx, input, weight, bias, opts)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """dgrad, overlapped reductions, wgrad (see the module notes for the order)."""
        return (*_backward(ctx, grad_output), *_NO_GRADS)


def _forward(
    ctx: Any, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, opts: _Options
) -> torch.Tensor:
    """The forward of both linear functions (Megatron's and :class:`_LinearThenReduce`);
    saves what :func:`_backward` needs on ``ctx``."""
    if opts.gradient_accumulation_fusion and _hand_wgrad_to_autograd(weight):
        opts = opts._replace(gradient_accumulation_fusion=False)
    ctx.opts = opts
    ctx.save_for_backward(input, weight)
    # main_grad is kept on ctx, not saved: a weight shared by several layers (an MTP
    # head) would otherwise trip autograd's in-place version check.
    ctx.main_grad = param_attrs.main_grad_of(weight) if opts.gradient_accumulation_fusion else None
    ctx.use_bias = bias is not None
    group, output_dtype = opts.tp_group, opts.output_dtype
    total_input = (
        traceable.all_gather_tensor(input, group, label="tp gather dim 0")
        if opts.sequence_parallel
        else input
    )
    full_weight = weight if opts.gtp_remat_size == 1 else gather_gtp_weight(weight)
    if output_dtype is None or output_dtype == input.dtype:
        return F.linear(total_input, full_weight, bias)
    return _linear_forward(total_input, full_weight, bias, output_dtype)


def _backward(
    ctx: Any, grad_output: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(dX, dW, db)`` of :func:`_forward`."""
    input, weight = ctx.saved_tensors
    opts: _Options = ctx.opts
    if grad_output.dtype != input.dtype:
        grad_output = grad_output.to(input.dtype)
    grad_output = grad_output.contiguous()
    buffer = opts.grad_output_buffer
    wgrad_now = buffer is None or not _defer_wgrad(buffer, opts.wgrad_deferral_limit, grad_output)
    gather = (
        traceable.start_all_gather(input, opts.tp_group, label="tp gather dim 0")
        if wgrad_now and opts.sequence_parallel
        else None
    )
    full_weight = weight if opts.gtp_remat_size == 1 else gather_gtp_weight(weight)
    grad_input = grad_output.matmul(full_weight)
    total_input = input if gather is None else gather.wait()
    dgrad_reduction = _start_dgrad_reduction(grad_input, opts)
    # as rows, once, for dW and db (a 2-D tensor is its own rows: a view costs ~0.5 µs)
    rows, total_rows = grad_output, total_input
    if rows.dim() != 2:
        rows = rows.reshape(-1, rows.shape[-1])
    if total_rows.dim() != 2:
        total_rows = total_rows.reshape(-1, total_rows.shape[-1])
    grad_weight = _weight_grad(weight, ctx.main_grad, rows, total_rows, opts, wgrad_now)
    grad_bias = rows.sum(dim=0) if ctx.use_bias else None
    grad_input = grad_input if dgrad_reduction is None else dgrad_reduction.wait()
    return grad_input, grad_weight, grad_bias


def _hand_wgrad_to_autograd(weight: torch.Tensor) -> bool:
    """While compiling, a DDP-managed weight (one with ``grad_added_to_main_grad``) gets
    its ``dW`` as an ordinary gradient, which DDP's hook adds into ``main_grad``: a
    compiled backward cannot set the flag each step (a Python attribute), and without it
    the hook would add the dummy gradient too. Same ``main_grad``, one temporary more."""
    return torch.compiler.is_compiling() and param_attrs.has_grad_added_flag(weight)


def _defer_wgrad(buffer: list[torch.Tensor], limit: int, grad_output: torch.Tensor) -> bool:
    """Keep ``grad_output`` in the deferral buffer (True) while it holds fewer than
    ``limit`` (0: no limit); False: the wgrad is computed now."""
    if limit == 0 or len(buffer) < limit:
        buffer.append(grad_output)
        return True
    return False


def _start_dgrad_reduction(
    grad_input: torch.Tensor, opts: _Options
) -> traceable.PendingTensor | None:
    """Issue the dgrad's reduction; ``wait()`` returns the reduced dgrad. None: there is
    none (the dgrad is final)."""
    if opts.sequence_parallel:
        return traceable.start_reduce_scatter(
            grad_input, opts.tp_group, label="tp reduce-scatter dim 0"
        )
    if opts.allreduce_dgrad and opts.tp_group.size() > 1:
        return traceable.start_all_reduce(
            grad_input, opts.tp_group, label="tp dgrad all-reduce", inplace=True
        )
    return None


def _weight_grad(
    weight: torch.Tensor,
    main_grad: torch.Tensor | None,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
    opts: _Options,
    wgrad_now: bool,
) -> torch.Tensor | None:
    """``dW`` for autograd (or accumulated into ``main_grad``); ``grad_output`` and
    ``total_input`` as rows (2-D), as every helper below takes them."""
    if opts.gradient_accumulation_fusion:
        if wgrad_now:
            assert main_grad is not None  # checked before forward
            _accumulate_into_main_grad(weight, main_grad, grad_output, total_input, opts)
        return _dummy_grad(weight, main_grad)
    if opts.gtp_remat_size == 1:
        return _new_wgrad(weight, weight.shape, grad_output, total_input)
    return _gtp_wgrad(weight, weight, grad_output, total_input)


def _accumulate_into_main_grad(
    weight: torch.Tensor,
    main_grad: torch.Tensor,
    grad_output: torch.Tensor,
    total_input: torch.Tensor,
    opts: _Options,
) -> None:
    if opts.gtp_remat_size == 1:
        accumulate_wgrad(main_grad, grad_output, total_input)
        return
    main_grad.add_(_gtp_wgrad(weight, main_grad, grad_output, total_input))


def _new_wgrad(
    like: torch.Tensor, shape: Sequence[int], grad_output: torch.Tensor, total_input: torch.Tensor
) -> torch.Tensor:
    """``dW = dYᵀ · X_tot`` (rows) into a new ``shape`` tensor with ``like``'s dtype and
    device (operands of that dtype: the GEMM's own output, without allocating one first)."""
    if grad_output.dtype == like.dtype and total_input.dtype == like.dtype:
        return grad_output.t().mm(total_input)
    out = torch.empty(shape, dtype=like.dtype, device=like.device)
    return _wgrad_gemm(out, grad_output, total_input)


def _gtp_wgrad(
    weight: torch.Tensor, like: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor
) -> torch.Tensor:
    """The gtp_remat shard's part of the full ``dW`` (computed in ``like``'s dtype), reduced
    over the gtp_remat group (mean, or sum under per-token loss)."""
    full = _new_wgrad(like, unsharded_shape(weight), grad_output, total_input)
    return reduce_scatter_gtp_grad(full, weight)


def _dummy_grad(weight: torch.Tensor, main_grad: torch.Tensor | None) -> torch.Tensor | None:
    """What autograd gets for W when the gradient went into ``main_grad``.

    A weight managed by a DDP wrapper carries ``grad_added_to_main_grad``: it gets a dummy
    gradient (so DDP's hook runs on the backward thread, as in Megatron) and the flag is
    set so the hook does not add it again. Any other weight gets None.
    """
    if not param_attrs.has_grad_added_flag(weight):
        return None
    param_attrs.mark_grad_added_to_main_grad(weight)
    shape = weight.shape if main_grad is None else main_grad.shape
    make = torch.zeros if param_attrs.zeroes_wgrad(weight) else torch.empty
    return make(shape, dtype=weight.dtype, device=weight.device)


class LinearWithFrozenWeight(torch.autograd.Function):
    """Linear whose weight gets no gradient: saves only W; backward returns only dX.

    Forward and dgrad are the same GEMMs as
    :class:`LinearWithGradAccumulationAndAsyncCommunication`. With ``allreduce_dgrad`` the
    dgrad is all-reduced over ``tp_group`` (synchronously: there is no wgrad to overlap).
    A bias that requires grad gets ``Σ dY`` (Megatron returns None there).
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        allreduce_dgrad: bool,
        tp_group: dist.ProcessGroup,
        output_dtype: torch.dtype | None,
    ) -> torch.Tensor:
        """``Y = X · Wᵀ + b``; saves W only."""
        ctx.save_for_backward(weight)
        ctx.allreduce_dgrad, ctx.tp_group = allreduce_dgrad, tp_group
        ctx.input_dtype = input.dtype
        ctx.bias_grad = bias is not None and bias.requires_grad
        return _linear_forward(input, weight, bias, output_dtype)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``dX = dY · W`` (all-reduced over TP when asked)."""
        (weight,) = ctx.saved_tensors
        grad_output = grad_output.to(ctx.input_dtype)
        grad_input = grad_output.matmul(weight.to(ctx.input_dtype))
        if ctx.allreduce_dgrad and ctx.tp_group.size() > 1:
            grad_input = traceable.all_reduce_tensor(
                grad_input, ctx.tp_group, label="tp frozen-weight dgrad all-reduce", inplace=True
            )
        rows = grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = rows.sum(dim=0) if ctx.bias_grad else None
        return grad_input, None, grad_bias, None, None, None


def _check_common(
    input: object,
    weight: object,
    bias: object,
    allreduce_dgrad: object,
    sequence_parallel: object,
    gtp_remat_size: object,
    output_dtype: object,
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype | None]:
    """Types, shapes, dtypes and devices of a linear call (cheap: no device sync)."""
    check_flag("allreduce_dgrad", allreduce_dgrad)
    check_flag("sequence_parallel", sequence_parallel)
    x, w = check_tensor("input", input), check_tensor("weight", weight)
    b = None if bias is None else check_tensor("bias", bias)
    out_dtype = check_float_dtype("output_dtype", output_dtype, allow_none=True)
    _min_dims(x, 1, "input")
    if allreduce_dgrad and sequence_parallel:
        raise InputValueError(
            "allreduce_dgrad=True and sequence_parallel=True: under sequence parallelism the "
            "dgrad is reduce-scattered, not all-reduced; pass allreduce_dgrad=False"
        )
    gtp = check_int("gtp_remat_size", gtp_remat_size)
    full = _weight_shape(w, gtp)
    if len(full) != 2 or full[1] != x.shape[-1]:
        raise InputValueError(
            f"input has shape {tuple(x.shape)} but the weight is {list(full)}: the input's "
            "last dimension must equal the weight's second"
        )
    _check_dtypes(x, w, out_dtype)
    if b is not None:
        _check_bias(b, full[0], x, w, out_dtype)
    return x, w, out_dtype


def _weight_shape(w: torch.Tensor, gtp_remat_size: int) -> tuple[int, ...]:
    """The (unsharded) weight shape; a gtp_remat shard needs its own ``gtp_remat_size``."""
    shard_size = param_attrs.gtp_remat_size_of(w) if param_attrs.is_gtp_weight_remat(w) else None
    if gtp_remat_size == 1 and shard_size is None:
        return tuple(w.shape)
    if shard_size != gtp_remat_size:
        raise InputValueError(
            f"gtp_remat_size={gtp_remat_size} but the weight (shape {tuple(w.shape)}) is "
            + ("not a gtp_remat shard" if shard_size is None else f"a shard over {shard_size}")
            + "; pass the gtp_remat_size the weight was sharded with "
            "(shard_weight_for_gtp), or 1 for a plain weight"
        )
    return unsharded_shape(w)


def _check_dtypes(x: torch.Tensor, w: torch.Tensor, output_dtype: torch.dtype | None) -> None:
    for name, t in (("input", x), ("weight", w)):
        if not t.dtype.is_floating_point:
            raise InputTypeError(f"{name} holds {t.dtype}; the linear layer needs floating point")
    _check_operands(x, w, None, output_dtype)


def _check_operands(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    output_dtype: torch.dtype | None,
    rows: int = 0,
    width: int | None = None,
) -> None:
    """What a layer checks of its operands per call (a few attribute reads; their types,
    sizes and flags were checked when it was built): ``x`` on ``w``'s device, in its dtype
    unless ``output_dtype`` says otherwise; ``b`` (when given) ``[rows]`` on that device,
    in ``x``'s dtype likewise; ``w``'s second dimension ``x``'s last (or ``width``, the
    width ``x`` has once the layer split it)."""
    if w.dim() != 2 or w.shape[1] != (x.shape[-1] if width is None else width):
        raise InputValueError(
            f"input has shape {tuple(x.shape)} but the weight is {list(w.shape)}: the input's "
            "last dimension must equal the weight's second"
        )
    if x.device != w.device:
        raise InputValueError(
            f"input is on {x.device} but the weight on {w.device}; move the input there"
        )
    if (output_dtype is None or output_dtype == x.dtype) and x.dtype != w.dtype:
        raise InputTypeError(
            f"input holds {x.dtype} but the weight {w.dtype}; cast the input to "
            f"{w.dtype}, or pass output_dtype=<dtype of the result> to compute in the wider "
            "of the two"
        )
    if b is not None and (b.shape[0] != rows or b.dim() != 1 or b.device != w.device or (
        b.dtype != x.dtype and (output_dtype is None or output_dtype == x.dtype)
    )):  # fmt: skip
        _check_bias(b, rows, x, w, output_dtype)


def _check_bias(
    b: torch.Tensor,
    rows: int,
    x: torch.Tensor,
    w: torch.Tensor,
    output_dtype: torch.dtype | None,
) -> None:
    if tuple(b.shape) != (rows,) or b.device != w.device:
        raise InputValueError(
            f"bias has shape {tuple(b.shape)} on {b.device} but the weight has {rows} output "
            f"rows on {w.device}; the bias must be [{rows}] on the weight's device"
        )
    if (output_dtype is None or output_dtype == x.dtype) and b.dtype != x.dtype:
        raise InputTypeError(f"bias holds {b.dtype} but the input {x.dtype}; they must match")


def _check_main_grad(weight: torch.Tensor) -> None:
    """A ``ValueError`` unless ``weight.main_grad`` is a tensor of the weight's shape."""
    grad = param_attrs.main_grad_or_none(weight)
    if not isinstance(grad, torch.Tensor):
        raise InputValueError(
            f"gradient_accumulation_fusion=True but the weight (shape {tuple(weight.shape)}) "
            "has no main_grad tensor to accumulate into; wrap the model in a DDP that "
            "allocates main_grad (mc_ddp.DistributedDataParallel) or set "
            "config.gradient_accumulation_fusion=False"
        )
    if grad.shape != weight.shape:
        raise InputValueError(
            f"weight.main_grad has shape {tuple(grad.shape)} but the weight has "
            f"{tuple(weight.shape)}; main_grad must have the weight's shape"
        )
    # A fused kernel (apex, addmm_) would write through the view's data pointer: a grad
    # buffer offloaded with offload_grad_buffers() has freed its storage. Not while
    # compiling (Dynamo cannot read a storage's size): offloaded buffers belong to mc DDP,
    # whose weights get their wgrad through autograd there and DDP's hook refuses them.
    if grad.numel() and not torch.compiler.is_compiling() and grad.untyped_storage().nbytes() == 0:
        raise RuntimeError(
            f"weight.main_grad (shape {tuple(grad.shape)}) has no storage: its grad buffer is "
            "offloaded; call restore_grad_buffers() before the next forward with "
            "gradient_accumulation_fusion"
        )


def _check_deferral(grad_output_buffer: object, wgrad_deferral_limit: object, fusion: bool) -> int:
    limit = check_int(
        "wgrad_deferral_limit",
        0 if wgrad_deferral_limit is None else wgrad_deferral_limit,
        minimum=0,
    )
    if grad_output_buffer is None:
        return limit
    if not isinstance(grad_output_buffer, list):
        raise InputTypeError(
            f"grad_output_buffer must be a list or None, got {type_name(grad_output_buffer)}"
        )
    if not fusion:
        raise InputValueError(
            "grad_output_buffer (embedding wgrad deferral) needs "
            "gradient_accumulation_fusion=True: the deferred weight gradient is added into "
            "weight.main_grad by drain_embedding_wgrad_compute"
        )
    return limit


def _warn_device_connections() -> None:
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        warnings.warn(
            "set CUDA_DEVICE_MAX_CONNECTIONS=1 so the asynchronous TP collectives are "
            "scheduled before the GEMMs they should overlap",
            stacklevel=4,
        )


def linear_with_grad_accumulation_and_async_allreduce(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    tp_group: dist.ProcessGroup | None = None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``Y = X·Wᵀ + b`` with TP communication overlapped with the backward GEMMs.

    Args:
        input: ``X``, ``[s, b, k]`` (any leading dims); under ``sequence_parallel`` this
            rank's ``[s/W, b, k]`` rows, all-gathered along dim 0 before the GEMM.
        weight: ``W``, ``[n, k]`` (a gtp_remat shard when ``gtp_remat_size > 1``).
        bias: ``b``, ``[n]`` or None.
        gradient_accumulation_fusion: add ``dW`` into ``weight.main_grad`` (apex's kernel
            when importable, ``addmm_`` otherwise; same numbers) instead of returning it.
        allreduce_dgrad: all-reduce ``dX`` over ``tp_group``, asynchronously, overlapped
            with the wgrad GEMM. Must be False under ``sequence_parallel``.
        sequence_parallel: gather ``X`` along dim 0 in forward (re-gathered asynchronously
            in backward, overlapped with the dgrad GEMM) and reduce-scatter ``dX`` along
            dim 0 in backward (overlapped with the wgrad GEMM).
        grad_output_buffer: embedding wgrad deferral: ``dY`` is appended here instead of
            computing ``dW`` (while fewer than ``wgrad_deferral_limit`` are held; 0 = no
            limit). Needs ``gradient_accumulation_fusion``.
        wgrad_deferral_limit: see ``grad_output_buffer`` (None reads as 0).
        tp_group: the tensor-parallel group (None: the default collection's ``tp``).
        gtp_remat_size: > 1 when ``weight`` is a gtp_remat shard: all-gathered over its
            ``group`` before each GEMM, ``dW`` reduce-scattered (see :mod:`mc_tp_layers.gtp`).
        output_dtype: dtype of ``Y`` when it should differ from ``X``'s (exact torch path,
            see :func:`mc_tp_layers.layers._linear_forward`); ``dX`` keeps ``X``'s dtype.

    Every argument is checked before any collective is issued. See the module notes for
    the collective schedule.
    """
    fusion = check_flag("gradient_accumulation_fusion", gradient_accumulation_fusion)
    x, w, out_dtype = _check_common(
        input, weight, bias, allreduce_dgrad, sequence_parallel, gtp_remat_size, output_dtype
    )
    group = _resolve_tp_group(
        tp_group, None, what="linear_with_grad_accumulation_and_async_allreduce"
    )
    if fusion:
        _check_main_grad(w)
    limit = _check_deferral(grad_output_buffer, wgrad_deferral_limit, fusion)
    return _apply_linear(
        x, w, bias, fusion, allreduce_dgrad, sequence_parallel, grad_output_buffer, limit, group,
        gtp_remat_size, out_dtype,
    )  # fmt: skip


_Reduction = Literal["all-reduce", "reduce-scatter"]
"""The reduction of a row-parallel layer's output over TP that ``_apply_linear`` can
fuse into the linear's autograd node: the SUM all-reduce, or under sequence parallelism
the SUM reduce-scatter along dim 0."""


def _apply_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: int | None = 0,
    tp_group: dist.ProcessGroup | None = None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
    *,
    reduce_output: _Reduction | None = None,
) -> torch.Tensor:
    """:class:`LinearWithGradAccumulationAndAsyncCommunication` applied to checked
    arguments: the one place it is applied, after
    :func:`linear_with_grad_accumulation_and_async_allreduce`'s checks or a layer's (its
    construction and ``_check_operands`` per call). ``tp_group`` is a live group.

    ``reduce_output`` (a row-parallel layer's linear): the output is then reduced over
    ``tp_group`` in the same autograd node (:class:`_LinearThenReduce`), where Megatron
    applies a second Function (``_ReduceFromModelParallelRegion`` or
    ``_ReduceScatterToSequenceParallelRegion``): the same collectives, values and
    gradients, one Python node less per call (about 5 % of a small TP block's host time,
    ``benchmarks/host_cost.py --part tp-host``).
    """
    if grad_output_buffer is not None and torch.compiler.is_compiling():
        raise InputValueError(
            "grad_output_buffer (embedding wgrad deferral, "
            "config.defer_embedding_wgrad_compute) does not run under torch.compile: its "
            "backward appends to a Python list, which a compiled backward cannot do each "
            "step; leave the output layer uncompiled or switch the deferral off"
        )
    if input.is_cuda and (sequence_parallel or allreduce_dgrad):
        _warn_device_connections()
    if reduce_output is None:
        out: torch.Tensor = LinearWithGradAccumulationAndAsyncCommunication.apply(  # type: ignore[no-untyped-call]
            input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
            sequence_parallel, grad_output_buffer, wgrad_deferral_limit or 0, tp_group,
            gtp_remat_size, output_dtype,
        )  # fmt: skip
    else:  # a row layer's linear: no dgrad reduction, no SP gather, no deferral
        out = _LinearThenReduce.apply(  # type: ignore[no-untyped-call]
            input, weight, bias, gradient_accumulation_fusion, tp_group, gtp_remat_size,
            reduce_output == "reduce-scatter",
        )  # fmt: skip
    return out


class _LinearThenReduce(torch.autograd.Function):
    """The linear function, then the SUM of its output over ``tp_group``: one autograd node
    (see ``_apply_linear``)::

        forward:   P  = X·Wᵀ (+ b)                 (the linear's forward: saves X and W)
                   Y  = all-reduce(P), in place     | reduce-scatter(P) along dim 0
        backward:  dP = dY                          | all-gather(dY) along dim 0
                   then the linear's backward on dP

    The same collectives, in the same order and with the same labels, as Megatron's two
    Functions. A row layer's linear reduces no dgrad, gathers no input along the sequence
    and defers no wgrad: its arguments are the ones that vary."""

    @staticmethod
    def forward(
        ctx: Any,
        input: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        gradient_accumulation_fusion: bool,
        tp_group: dist.ProcessGroup,
        gtp_remat_size: int,
        scatter: bool,
    ) -> torch.Tensor:
        """``P`` (nothing else holds it), then its reduction over ``tp_group``."""
        opts = _Options(
            gradient_accumulation_fusion, False, False, None, 0, tp_group, gtp_remat_size, None
        )
        partial = _forward(ctx, input, weight, bias, opts)
        ctx.scatter = scatter
        if scatter:
            return traceable.reduce_scatter_tensor(
                partial, tp_group, label="tp reduce-scatter dim 0"
            )
        return traceable.all_reduce_tensor(partial, tp_group, label="tp all-reduce", inplace=True)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        """``dP`` (``dY``, or ``dY`` all-gathered along dim 0), then the linear's backward."""
        if ctx.scatter:
            grad_output = traceable.all_gather_tensor(
                grad_output, ctx.opts.tp_group, label="tp gather dim 0"
            )
        return (*_backward(ctx, grad_output), None, None, None, None)


def linear_with_frozen_weight(
    input: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    gradient_accumulation_fusion: bool,
    allreduce_dgrad: bool,
    sequence_parallel: bool,
    tp_group: dist.ProcessGroup | None,
    grad_output_buffer: list[torch.Tensor] | None = None,
    wgrad_deferral_limit: None = None,
    gtp_remat_size: int = 1,
    output_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``Y = X·Wᵀ + b`` for a weight that is not trained (``weight.requires_grad`` False).

    Saves only the weight (no activations) and computes no weight gradient. Under
    ``sequence_parallel`` ``X`` is all-gathered along dim 0 in forward and ``dX``
    reduce-scattered in backward (through :func:`gather_from_sequence_parallel_region`);
    otherwise ``allreduce_dgrad`` all-reduces ``dX`` over ``tp_group``. With
    ``gtp_remat_size > 1`` the weight shard is all-gathered first.
    ``gradient_accumulation_fusion`` is ignored (nothing to accumulate);
    ``grad_output_buffer`` and ``wgrad_deferral_limit`` must stay None (deferral exists only
    for trained weights).
    """
    check_flag("gradient_accumulation_fusion", gradient_accumulation_fusion)
    x, w, out_dtype = _check_common(
        input, weight, bias, allreduce_dgrad, sequence_parallel, gtp_remat_size, output_dtype
    )
    if grad_output_buffer is not None or wgrad_deferral_limit is not None:
        raise InputValueError(
            "grad_output_buffer and wgrad_deferral_limit are only supported by "
            "linear_with_grad_accumulation_and_async_allreduce; pass None"
        )
    group = _resolve_tp_group(tp_group, None, what="linear_with_frozen_weight")
    if sequence_parallel:
        x = gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
    full = gather_gtp_weight(w) if gtp_remat_size > 1 else w
    return _apply(LinearWithFrozenWeight, x, full, bias, allreduce_dgrad, group, out_dtype)


# -- embedding wgrad deferral: the held wgrads computed later --------------------------


def _check_drain(
    config: object,
    activations: object,
    grads: object,
    weight: object,
    group: dist.ProcessGroup,
) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor, bool]:
    """Every argument and every buffered pair, before anything is popped or communicated:
    a failing drain leaves both buffers as they were."""
    sequence_parallel = check_flag(
        "config.sequence_parallel", getattr(config, "sequence_parallel", None)
    )
    xs = _check_buffer_list("embedding_activation_buffer", activations)
    dys = _check_buffer_list("grad_output_buffer", grads)
    w = check_tensor("weight", weight)
    if len(xs) != len(dys):
        raise InputValueError(
            f"embedding_activation_buffer holds {len(xs)} tensors but "
            f"grad_output_buffer holds {len(dys)}; both must hold one per deferred "
            "micro-batch (drain after every deferred backward ran)"
        )
    main_grad = param_attrs.main_grad_or_none(w)
    if not isinstance(main_grad, torch.Tensor):
        raise InputValueError(
            "drain_embedding_wgrad_compute adds into weight.main_grad, which this weight "
            f"(shape {tuple(w.shape)}) lacks; wrap the model in a DDP that allocates it"
        )
    if w.dim() != 2 or main_grad.shape != w.shape:
        raise InputValueError(
            f"weight has shape {tuple(w.shape)} and weight.main_grad {tuple(main_grad.shape)}; "
            "drain needs a 2-D weight [n, k] and a main_grad of its shape"
        )
    gather = sequence_parallel and group.size() > 1
    for index, (x, dy) in enumerate(zip(xs, dys, strict=True)):
        _check_pair(index, x, dy, w, int(group.size()) if sequence_parallel else 1)
    return xs, dys, main_grad, gather


def _check_buffer_list(name: str, value: object) -> list[torch.Tensor]:
    if not isinstance(value, list):
        raise InputTypeError(f"{name} must be a list, got {type_name(value)}")
    return value


def _check_pair(index: int, x: object, dy: object, w: torch.Tensor, rows_factor: int) -> None:
    """Pair ``index``: ``X [.., k]`` (this rank's rows under SP) and ``dY [.., n]`` with
    ``rows(X) · W == rows(dY)``, floating, on the weight's device."""
    x = check_tensor(f"embedding_activation_buffer[{index}]", x)
    dy = check_tensor(f"grad_output_buffer[{index}]", dy)
    n, k = w.shape
    for name, t, last in (("embedding_activation_buffer", x, k), ("grad_output_buffer", dy, n)):
        if t.dim() < 1 or t.shape[-1] != last or not t.dtype.is_floating_point:
            raise InputValueError(
                f"{name}[{index}] is {t.dtype} of shape {tuple(t.shape)}; it must be a "
                f"floating tensor [..., {last}] for a weight of shape {tuple(w.shape)}"
            )
        if t.device != w.device:
            raise InputValueError(f"{name}[{index}] is on {t.device} but the weight on {w.device}")
    rows_x, rows_dy = x.numel() // k * rows_factor, dy.numel() // n
    if rows_x != rows_dy:
        gathered = f" (× {rows_factor} ranks under sequence parallelism)" if rows_factor > 1 else ""
        raise InputValueError(
            f"pair {index}: the activation has {x.numel() // k} rows{gathered} but the output "
            f"gradient {rows_dy}; each pair must come from the same micro-batch"
        )


def drain_embedding_wgrad_compute(
    config: TransformerConfigLike,
    embedding_activation_buffer: list[torch.Tensor],
    grad_output_buffer: list[torch.Tensor],
    weight: torch.Tensor,
    tp_group: dist.ProcessGroup | None = None,
) -> None:
    """Add every deferred ``dW = dYᵢᵀ · Xᵢ`` into ``weight.main_grad`` and empty both buffers.

    Pairs are taken in order (activation i with gradient i). Under
    ``config.sequence_parallel`` each ``Xᵢ`` is this rank's rows and is all-gathered along
    dim 0 over ``tp_group`` first; the gather of pair i+1 is issued before the GEMM of
    pair i so the two overlap. ``tp_group`` None reads the default collection's ``tp``.

    Every argument and every pair (types, shapes against the weight, devices, equal
    lengths) is checked before the first pair is taken: a drain that raises leaves both
    buffers untouched.
    """
    group = _resolve_tp_group(tp_group, None, what="drain_embedding_wgrad_compute")
    activations, grads, main_grad, gather = _check_drain(
        config, embedding_activation_buffer, grad_output_buffer, weight, group
    )
    if not activations:
        return
    pending: traceable.PendingTensor | None = _start_gather(activations.pop(0), group, gather)
    while pending is not None:
        current = pending
        upcoming = activations.pop(0) if activations else None
        pending = None if upcoming is None else _start_gather(upcoming, group, gather)
        total_input = current.wait()
        grad_output = grads.pop(0)
        accumulate_wgrad(
            main_grad,
            grad_output.reshape(-1, grad_output.shape[-1]),
            total_input.reshape(-1, total_input.shape[-1]),
        )


def _start_gather(
    x: torch.Tensor, group: dist.ProcessGroup, gather: bool
) -> traceable.PendingTensor:
    if not gather:
        return traceable.PendingTensor(x)
    return traceable.start_all_gather(x, group, label="tp gather dim 0")
