"""Checks on the model list, num_tokens and flags, and where a step's group comes from."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize.protocols import ModelChunk
from mc_groups.argcheck import check_flag, check_optional_group, type_name
from mc_groups.errors import InputTypeError, InputValueError

# What the step helpers call (Megatron's read only named_parameters() / modules(), and its
# tests pass plain torch.nn.Module chunks); finalize_model_grads also calls finish_grad_sync.
STEP_METHODS = ("named_parameters", "parameters")
FINALIZE_METHODS = ("finish_grad_sync", *STEP_METHODS)
# Half-precision counts are exact only up to 2048 (fp16) / 256 (bf16) tokens.
_TOKEN_DTYPES = (torch.int32, torch.int64, torch.float32, torch.float64)


def _as_chunks(model: object, methods: Sequence[str] = STEP_METHODS) -> list[ModelChunk]:
    """``model`` as a non-empty list of chunks that each have ``methods``, or a
    TypeError/ValueError saying what is wrong."""
    if isinstance(model, torch.nn.Module) or not isinstance(model, list | tuple):
        raise InputTypeError(
            f"model must be a list of model chunks (one per virtual pipeline stage), got "
            f"{type_name(model)}; pass [model] for a single chunk"
        )
    if not model:
        raise InputValueError("model=[] holds no model chunk; pass the chunks this rank owns")
    from mc_finalize._fsdp2 import is_fsdp2  # noqa: PLC0415 (a sibling importing this one)

    for index, chunk in enumerate(model):  # FSDP2 reduced in backward: no finish_grad_sync
        own = [m for m in methods if m != "finish_grad_sync"] if is_fsdp2(chunk) else methods
        _check_methods([chunk], own, index)
    for index, chunk in enumerate(model):
        first = next(i for i, other in enumerate(model) if other is chunk)
        if first != index:
            raise InputValueError(
                f"model[{index}] is the same object as model[{first}]: each model chunk must "
                "appear once (its grads would be reduced and scaled twice)"
            )
    return list(model)


def _check_methods(chunks: Sequence[object], methods: Sequence[str], first: int = 0) -> None:
    """Every chunk has every method of ``methods`` (``scale_gradients`` is needed only with
    per-token loss); ``first``: the index of ``chunks[0]`` in the model list."""
    for index, chunk in enumerate(chunks, start=first):
        missing = [m for m in methods if not callable(getattr(chunk, m, None))]
        if missing:
            raise InputTypeError(
                f"model[{index}] ({type_name(chunk)}) lacks {missing}; a model chunk is a "
                "torch.nn.Module (finalize_model_grads: DDP-wrapped, e.g. "
                "mc_ddp.DistributedDataParallel, a module under FSDP2's fully_shard, or any "
                "object with finish_grad_sync, "
                "named_parameters and parameters; scale_gradients with per-token loss)"
            )


def _config_of(chunks: Sequence[ModelChunk]) -> object:
    from mc_finalize._fsdp2 import config_of  # noqa: PLC0415 (a sibling importing this one)

    config = config_of(chunks)
    if config is None:
        raise InputTypeError(
            f"model[0] ({type_name(chunks[0])}) has no config; finalize_model_grads "
            "reads the config from model[0].config, or the one mc_tp_layers.parallelize "
            "recorded on the model"
        )
    return config


def _resolve_group(
    group: dist.ProcessGroup | None, arg: str, field: str, needed_for: str
) -> dist.ProcessGroup | None:
    """``group`` (argument ``arg``), or field ``field`` of the registered default collection
    when ``group`` is None (:func:`mc_groups.collection_or_default`).

    The default's field may itself be None (e.g. ``embd`` on a middle pipeline stage).
    """
    if check_optional_group(arg, group, what=needed_for) is not None:
        return group
    collection = mg.collection_or_default(None, needed_for, explicit=f"{arg}=pg_collection.{field}")
    found: dist.ProcessGroup | None = getattr(collection, field)
    return found


def _require_group(
    group: dist.ProcessGroup | None, arg: str, field: str, needed_for: str
) -> dist.ProcessGroup:
    """Like :func:`_resolve_group`, but a missing group is a ``MissingGroupError``."""
    found = _resolve_group(group, arg, field, needed_for)
    if found is None:
        raise mg.MissingGroupError(
            f"{needed_for} needs the {field} group, but none was passed and the default "
            f"ProcessGroupCollection has {field}=None; pass it explicitly"
        )
    return found


def _modules(chunk: ModelChunk) -> Iterator[object]:
    """Every submodule of the chunk (nothing when the chunk has no ``modules()``)."""
    modules = getattr(chunk, "modules", None)
    if callable(modules):
        yield from modules()


def _model_module(chunk: ModelChunk) -> object:
    """The wrapped model: follow ``.module`` until an object with ``pre_process``.

    Megatron's wrappers (DDP, Float16Module) hold the model in ``.module``; a chain that
    never reaches ``pre_process`` yields its innermost object.
    """
    current: object = chunk
    while not hasattr(current, "pre_process"):
        inner = getattr(current, "module", None)
        if inner is None:
            break
        current = inner
    return current


def _check_force(force_all_reduce: object) -> bool:
    """None reads as False (Megatron's signature allows it); anything else is a bool."""
    if force_all_reduce is None:
        return False
    return check_flag("force_all_reduce", force_all_reduce)


def _check_num_tokens(
    num_tokens: object, chunks: Sequence[ModelChunk], per_token: bool
) -> torch.Tensor | None:
    """The types every rank can check alone (a tensor of one count, an exact dtype, the
    model's device), and ``num_tokens`` iff ``config.calculate_per_token_loss``.

    A missing count under per-token loss is not refused here: ranks can disagree on it (a
    data-dependent count on one rank only), and a rank raising alone would leave its peers
    waiting in the reduction. It takes part in the token reduction as an invalid count
    instead, so every rank raises the same error (see ``finalize._reduce_num_tokens``).
    """
    if num_tokens is None:
        return None
    if not per_token:
        raise InputValueError(
            "num_tokens was given but config.calculate_per_token_loss=False: DDP already "
            "averaged the grads over the data-parallel ranks, so dividing by the token count "
            "would shrink them again; pass num_tokens only with calculate_per_token_loss=True "
            "(Megatron's schedules pass it exactly then)"
        )
    if not isinstance(num_tokens, torch.Tensor):
        raise InputTypeError(
            f"num_tokens must be a torch.Tensor holding this rank's token count, got "
            f"{type_name(num_tokens)}; e.g. torch.tensor(n, dtype=torch.int64)"
        )
    if num_tokens.dim() > 1 or num_tokens.numel() != 1:
        raise InputValueError(
            f"num_tokens has shape {tuple(num_tokens.shape)}; it must hold one count "
            "(shape () or (1,)): sum the per-micro-batch counts first"
        )
    if num_tokens.dtype not in _TOKEN_DTYPES:
        raise InputTypeError(
            f"num_tokens has dtype {num_tokens.dtype}; use torch.int64 (or int32, float32, "
            "float64): half-precision and bool cannot hold token counts exactly"
        )
    param = next(iter(chunks[0].parameters()), None)
    if param is not None and num_tokens.device != param.device:
        raise InputValueError(
            f"num_tokens is on {num_tokens.device} but the model is on {param.device}; "
            "move it with num_tokens.to(device) (the collective needs both on one device)"
        )
    return num_tokens
