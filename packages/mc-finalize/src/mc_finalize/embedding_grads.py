"""Embedding weights duplicated on several pipeline stages.

With a tied input/output embedding and pp > 1 the word-embedding weight lives on the first
stage (input lookup) and a copy on the last stage (output projection). Each copy's grad
holds only its own use, and both must apply the total:

    g ← Σ_{embd group} g        (embd = first and last pipeline rank)

The position embedding of encoder-decoder splits is handled the same way over the
position-embedding group. One all-reduce (SUM) of the one weight's grad; nothing on ranks
outside the group (their group is None), when the group has one rank, when the stage has no
shared weight, or when the weight is frozen (its grad is None).

The chunk that holds the weight: ``model[0]`` on the first stage, ``model[-1]`` on the last
(with virtual stages the output layer is in the last chunk), ``model[-1]`` on a middle stage
when the model has MTP layers, else ``model[0]``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_finalize._flat import _allreduce_views
from mc_finalize._inputs import _as_chunks, _model_module, _resolve_group
from mc_finalize._settings import _read_settings, _Settings
from mc_finalize.grad_access import _grad_view
from mc_finalize.protocols import FinalizeConfig, ModelChunk
from mc_groups import param_attrs
from mc_groups.argcheck import check_flag, check_optional_group, type_name
from mc_groups.errors import InputTypeError, InputValueError

WeightGetter = Callable[[object], torch.nn.Parameter | None]


def _get_shared_word_embedding_weight(
    model_module: object, config: FinalizeConfig
) -> torch.nn.Parameter | None:
    """The shared word-embedding / output weight when it is duplicated across stages.

    A Megatron language model says so with ``share_embeddings_and_output_weights`` (or MTP
    layers, ``config.mtp_num_layers > 0``) and returns the weight from
    ``shared_embedding_or_output_weight()``. A model without that attribute marks the
    weight itself with ``shared_embedding=True``; the first such param is returned.
    """
    return _shared_word_embedding_weight(model_module, _read_settings(config))


def _shared_word_embedding_weight(
    model_module: object, settings: _Settings
) -> torch.nn.Parameter | None:
    """The core of :func:`_get_shared_word_embedding_weight` on read settings."""
    if not hasattr(model_module, "share_embeddings_and_output_weights") and not callable(
        getattr(model_module, "parameters", None)
    ):
        raise InputTypeError(
            f"model_module={model_module!r} must be the wrapped model (an object with "
            "parameters() or share_embeddings_and_output_weights)"
        )
    if hasattr(model_module, "share_embeddings_and_output_weights"):
        shared = bool(model_module.share_embeddings_and_output_weights)
        if not (shared or settings.mtp_num_layers > 0):
            return None
        getter = getattr(model_module, "shared_embedding_or_output_weight", None)
        if not callable(getter):
            raise InputTypeError(
                f"{type_name(model_module)} shares its embedding and output weights but "
                "has no shared_embedding_or_output_weight() to return that weight"
            )
        weight: torch.nn.Parameter | None = getter()
        return weight
    return _first_shared_embedding(model_module)


def _get_position_embedding_weight(model_module: object) -> torch.nn.Parameter:
    """``model_module.position_embeddings.weight``; a ValueError when the module has none."""
    embedding = getattr(model_module, "position_embeddings", None)
    weight = getattr(embedding, "weight", None)
    if not isinstance(weight, torch.nn.Parameter):
        raise InputValueError(
            f"{type_name(model_module)} has no position_embeddings.weight, but this rank is "
            "in a position-embedding group of more than one rank; give the stage its "
            "position_embeddings or leave pos_embd unset"
        )
    return weight


def _allreduce_word_embedding_grads(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    embd_group: dist.ProcessGroup | None = None,
    pp_group: dist.ProcessGroup | None = None,
) -> None:
    """All-reduce the shared word-embedding grad across the first and last pipeline stages.

    With both groups None, both come from the registered default collection (whose ``embd``
    is None on ranks that hold no embedding copy). With ``pp_group`` given, ``embd_group=None``
    means this rank is in no embedding group: nothing runs.
    """
    what = "_allreduce_word_embedding_grads"
    chunks = _as_chunks(model)
    settings = _read_settings(config)
    check_optional_group("embd_group", embd_group, what=what)
    check_optional_group("pp_group", pp_group, what=what)
    if embd_group is None and pp_group is None:
        embd_group = _resolve_group(None, "embd_group", "embd", what)
        pp_group = _resolve_group(None, "pp_group", "pp", what)
    weight = _stage_embedding_weight(chunks, settings, embd_group, pp_group, word=True)
    _reduce_embedding_grad(weight, embd_group)


def _allreduce_position_embedding_grads(
    model: Sequence[ModelChunk],
    config: FinalizeConfig,
    pos_emb_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
) -> None:
    """All-reduce ``position_embeddings.weight``'s grad across the position-embedding group.

    Keeps the position embeddings of encoder and decoder stages in sync. A missing weight on
    a member rank is a ValueError; a None group means this rank holds no copy.
    """
    what = "_allreduce_position_embedding_grads"
    chunks = _as_chunks(model)
    settings = _read_settings(config)
    check_optional_group("pos_emb_group", pos_emb_group, what=what)
    check_optional_group("pp_group", pp_group, what=what)
    weight = _stage_embedding_weight(chunks, settings, pos_emb_group, pp_group, word=False)
    _reduce_embedding_grad(weight, pos_emb_group)


def _allreduce_embedding_grad(
    model: Sequence[ModelChunk],
    embd_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    weight_getter: WeightGetter,
    skip_if_none: bool = True,
    config: FinalizeConfig | None = None,
) -> None:
    """All-reduce (SUM) the grad of ``weight_getter(model_module)`` over ``embd_group``.

    ``model_module`` is the wrapped model of the chunk that holds the weight (see the module
    docstring; ``pp_group`` tells first from last stage). A getter returning None skips
    quietly with ``skip_if_none`` and is a ValueError without it; a frozen weight (grad None)
    always skips. Nothing runs when ``embd_group`` is None or has one rank (the arguments
    are checked all the same).
    """
    check_optional_group("embd_group", embd_group, what="_allreduce_embedding_grad")
    check_optional_group("pp_group", pp_group, what="_allreduce_embedding_grad")
    if not callable(weight_getter):
        raise InputTypeError(
            f"weight_getter={weight_getter!r} must be a callable taking the model module and "
            "returning the weight (or None)"
        )
    check_flag("skip_if_none", skip_if_none)
    has_mtp = config is not None and _read_settings(config).mtp_num_layers > 0
    chunks = _as_chunks(model)
    weight = _embedding_weight(chunks, embd_group, pp_group, weight_getter, has_mtp, skip_if_none)
    _reduce_embedding_grad(weight, embd_group)


def _stage_embedding_weight(
    chunks: Sequence[ModelChunk],
    settings: _Settings,
    group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    *,
    word: bool,
) -> torch.nn.Parameter | None:
    """The weight this rank reduces over ``group``, or None (checked before I/O): the shared
    word embedding (``word``; a stage without one skips) or the position embedding (a
    member without one is a ValueError)."""
    getter: WeightGetter = (
        partial(_shared_word_embedding_weight, settings=settings)
        if word
        else _get_position_embedding_weight
    )
    has_mtp = settings.mtp_num_layers > 0
    return _embedding_weight(chunks, group, pp_group, getter, has_mtp, skip_if_none=word)


def _reduce_embedding_grad(
    weight: torch.nn.Parameter | None, embd_group: dist.ProcessGroup | None
) -> None:
    """The core of the embedding steps: ``g ← Σ_{embd_group} g`` for the weight found by
    :func:`_embedding_weight` (None: this rank has nothing to do; a frozen weight, whose
    grad is None, neither)."""
    if weight is None or embd_group is None:
        return
    view = _grad_view(weight)
    if view is not None:
        _allreduce_views([view], embd_group, mg.ReduceOp.SUM, "embedding grads")


def _is_multi_rank(group: dist.ProcessGroup | None) -> bool:
    return group is not None and mg.group_size(group) > 1


def _embedding_weight(
    chunks: Sequence[ModelChunk],
    embd_group: dist.ProcessGroup | None,
    pp_group: dist.ProcessGroup | None,
    weight_getter: WeightGetter,
    has_mtp: bool,
    skip_if_none: bool,
) -> torch.nn.Parameter | None:
    """The weight to reduce, or None when this rank has nothing to do (checked before I/O)."""
    if not _is_multi_rank(embd_group):
        return None
    if pp_group is None:
        raise mg.MissingGroupError(
            "an embedding group of more than one rank needs pp_group to tell the first "
            "pipeline stage from the last; pass pg_collection.pp"
        )
    weight = weight_getter(_model_module(_embedding_chunk(chunks, pp_group, has_mtp)))
    if weight is None and not skip_if_none:
        raise InputValueError(
            "weight_getter returned None on a rank of an embedding group of more than one "
            "rank; every member must hold the weight (or pass skip_if_none=True)"
        )
    return weight


def _embedding_chunk(
    chunks: Sequence[ModelChunk], pp: dist.ProcessGroup, has_mtp: bool
) -> ModelChunk:
    stage, stages = mg.group_rank(pp), mg.group_size(pp)
    if stage == 0:
        return chunks[0]
    if stage == stages - 1:
        return chunks[-1]
    return chunks[-1] if has_mtp else chunks[0]


def _first_shared_embedding(module: object) -> torch.nn.Parameter | None:
    parameters = getattr(module, "parameters", None)
    if not callable(parameters):
        return None
    for param in parameters():
        if param_attrs.is_shared_embedding(param):
            found: torch.nn.Parameter = param
            return found
    return None
