"""The styles a plan names: small frozen records, one per transformation (policy only; the
conversion lives in :mod:`._convert`, the hooks in :mod:`._sequence`).

A plan maps fnmatch patterns over qualified module names to a style, a style name (the
names ``transformers`` uses in its ``tp_plan``) or a tuple of them applied in order (at most
one that replaces the module).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mc_groups.argcheck import check_flag, check_int, type_name
from mc_groups.errors import InputTypeError, InputValueError

__all__: list[str] = []  # private: tp_plan exports the styles


@dataclass(frozen=True)
class Colwise:
    """``nn.Linear`` → :class:`~mc_tp_layers.ColumnParallelLinear` (weight rows split).

    ``gather_output``: all-gather the output's last dim (``colwise_gather_output``); else
    each rank returns its ``[..., out/W]`` part (``colwise``). ``parts`` > 1: the weight
    packs ``parts`` equal blocks along its rows (``[gate; up]``, ``[q; k; v]`` of equal
    sizes); each block is split, rank r keeps ``[block_1,r; …; block_parts,r]`` (the
    partition stride of :mod:`mc_tp_layers.initialization`). ``block_input``: in a block with
    ``sequence_gather`` the layer checks that its input is the tensor that entered the
    block; ``False`` for a layer whose input the block first computes from that tensor with
    replicated modules tagged ``replicated_with_grad_allreduce`` (MLA's ``q_b_proj`` /
    ``kv_b_proj`` after the latent down projections): the block entry still sums its input
    grad.
    """

    gather_output: bool = False
    parts: int = 1
    block_input: bool = True

    def __post_init__(self) -> None:
        check_flag("gather_output", self.gather_output)
        check_int("parts", self.parts)
        check_flag("block_input", self.block_input)


@dataclass(frozen=True)
class Rowwise:
    """``nn.Linear`` → :class:`~mc_tp_layers.RowParallelLinear` (weight columns split, bias
    whole). ``split_input``: the input arrives whole and is split along its last dim first
    (``rowwise_split_input``; backward all-gathers the input grad's last dim); else it
    arrives split (``rowwise``, after a ``colwise``). Under sequence parallelism either
    reduce-scatters its output along the sequence; ``split_input`` then needs a
    ``sequence_gather`` on a module around it (its input must hold the whole sequence, as
    after a ``colwise_gather_output`` layer in the same block: Phi-3's attention)."""

    split_input: bool = False

    def __post_init__(self) -> None:
        check_flag("split_input", self.split_input)


@dataclass(frozen=True)
class VocabEmbedding:
    """``nn.Embedding`` → :class:`~mc_tp_layers.VocabParallelEmbedding` (vocabulary rows
    split, output all-reduced: every rank returns the full ``[b, s, h]``)."""


@dataclass(frozen=True)
class ColwiseRMSNorm:
    r"""An RMS norm over the whole output width of a ``colwise`` layer whose output stays
    split (OLMo-2's ``q_norm`` / ``k_norm`` over all heads) → mc's RMS norm over a split
    width: rank r keeps the weight's part r (the rows the ``colwise`` layer keeps, so only
    ``parts=1`` layers) and normalises its ``[..., n/W]`` part by the mean square of the
    whole row, whose sum of squares is all-reduced over the TP group::

        y_r = w_r · x_r / sqrt( (Σ_ranks Σ_j x_j²) / n + eps )     (in fp32, then cast)

    Collectives per norm and step: forward one all-reduce of ``[..., 1]`` (fp32), backward
    one all-reduce of its grad (each rank's part only reaches its own heads). The
    alternative, gathering the projection's output (``transformers``'
    ``colwise_gather_output``), moves ``[..., n]`` and runs attention whole on every rank.
    ``parallelize`` checks, on a copy and a random input, that the module computes
    ``weight · x / sqrt(mean(x²) + eps)`` (its ``eps`` read from ``variance_epsilon`` or
    ``eps``) before replacing it.
    """


@dataclass(frozen=True)
class ReplicatedWithGradAllReduce:
    """A replicated module inside the tensor-parallel region whose parameters each rank
    trains on only its part of the work (Qwen3's and Gemma-3's per-head ``q_norm`` /
    ``k_norm``: each rank normalises its own heads): its parameters are tagged
    ``sum_gradients_across_tp_domain`` (:mod:`mc_groups.param_attrs`), so
    ``mc_finalize.finalize_model_grads`` sums their grads over the TP group once per step,
    with or without sequence parallelism (as Megatron sums its q/k layernorms), and the
    global grad norm counts them once. Collectives: none in forward or backward; their
    grads join finalize's TP all-reduce."""


@dataclass(frozen=True)
class SequenceParallelNorm:
    """A module that works token by token (a norm) and runs on this rank's part of the
    sequence under sequence parallelism: its parameters are tagged ``sequence_parallel`` so
    ``mc_finalize.finalize_model_grads`` sums their grads over the TP group. No-op with
    sequence parallelism off.

    ``gather_output``: where the hidden states leave the model after this module (the
    final norm of a decoder without a head, e.g. a bare ``transformers`` ``LlamaModel``),
    its output ``[.., s/W, ..]`` is all-gathered along the sequence, so the model returns
    whole hidden states as one process would. Backward keeps this rank's part of the
    gradient without communicating: whatever follows runs replicated over the TP ranks
    (each computes the same from the same whole states), so every rank holds the full
    gradient already (Megatron's ``gather_from_sequence_parallel_region`` with
    ``tensor_parallel_output_grad=False``). Collectives: one all-gather of the module's
    output per forward, none in backward.
    """

    gather_output: bool = False

    def __post_init__(self) -> None:
        check_flag("gather_output", self.gather_output)


@dataclass(frozen=True)
class SequenceGather:
    """Where a block of ``colwise`` layers (attention, MLP, the LM head) enters the
    tensor-parallel region: under sequence parallelism its input is all-gathered along the
    sequence dim (backward: reduce-scatter); without, it is Megatron's ``f`` for the whole
    block (identity; backward: one all-reduce). Either way the block's ``colwise`` layers
    skip their own ``dX`` all-reduce (one collective per block instead of one per layer).
    The input is the first positional argument, else the keyword ``kwarg``."""

    kwarg: str = "hidden_states"


@dataclass(frozen=True)
class SequenceScatter:
    """Under sequence parallelism, keep this rank's part of the module's input along the
    sequence dim (no communication; backward all-gathers). Put it where the residual stream
    starts to be split (e.g. the first decoder layer). No-op with sequence parallelism off."""

    kwarg: str = "hidden_states"


Style = (
    Colwise
    | ColwiseRMSNorm
    | ReplicatedWithGradAllReduce
    | Rowwise
    | VocabEmbedding
    | SequenceParallelNorm
    | SequenceGather
    | SequenceScatter
)
"""One transformation a plan entry names (a style object; a plan may also name it by its
``transformers`` string)."""
Plan = Mapping[str, "str | Style | Sequence[str | Style]"]
"""Qualified-name patterns (fnmatch) → a style, a style name, or a sequence of them."""

_NAMED: Mapping[str, Style] = MappingProxyType(
    {
        "colwise": Colwise(),
        "colwise_gather_output": Colwise(gather_output=True),
        "colwise_rep": Colwise(gather_output=True),
        "packed_colwise": Colwise(parts=2),
        "rowwise": Rowwise(),
        "rowwise_split_input": Rowwise(split_input=True),
        "rowwise_rep": Rowwise(split_input=True),
        "embedding_rowwise": VocabEmbedding(),
        "colwise_rmsnorm": ColwiseRMSNorm(),
        "replicated_with_grad_allreduce": ReplicatedWithGradAllReduce(),
        "sequence_parallel": SequenceParallelNorm(),
        "sequence_gather": SequenceGather(),
        "sequence_scatter": SequenceScatter(),
    }
)
_STYLE_TYPES = (
    Colwise,
    ColwiseRMSNorm,
    ReplicatedWithGradAllReduce,
    Rowwise,
    VocabEmbedding,
    SequenceParallelNorm,
    SequenceGather,
    SequenceScatter,
)
REPLACING = (Colwise, ColwiseRMSNorm, Rowwise, VocabEmbedding)


def style_names() -> tuple[str, ...]:
    """The style names a plan may use (``transformers``' names, plus ``sequence_gather``,
    ``sequence_scatter`` and ``colwise_rmsnorm``)."""
    return tuple(_NAMED)


def name_of(style: Style) -> str | None:
    """The name a plan uses for ``style``, or ``None`` when it has none."""
    for name, known in _NAMED.items():
        if known == style:
            return name
    return None


def describe(style: Style) -> str:
    """The name a plan would use for ``style`` (or its repr)."""
    return name_of(style) or repr(style)


def resolve(pattern: str, value: object) -> tuple[Style, ...]:
    """The styles of one plan entry, or a ``ValueError``/``TypeError`` naming ``pattern``."""
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    if not items:
        raise InputValueError(f"plan[{pattern!r}] is empty; give a style name such as 'colwise'")
    styles: list[Style] = []
    for item in items:
        if isinstance(item, str):
            if item not in _NAMED:
                raise InputValueError(
                    f"plan[{pattern!r}] = {item!r}: mc does not offer this style; use one of "
                    f"{sorted(_NAMED)} (or drop the entry to keep the module replicated)"
                )
            styles.append(_NAMED[item])
        elif isinstance(item, _STYLE_TYPES):
            styles.append(item)
        else:
            raise InputTypeError(
                f"plan[{pattern!r}] holds {item!r} ({type_name(item)}); a plan value is a "
                "style name, a mc_tp_layers.tp_plan style, or a tuple of them"
            )
    replacing = [s for s in styles if isinstance(s, REPLACING)]
    if len(replacing) > 1:
        raise InputValueError(
            f"plan[{pattern!r}] replaces the module twice ({[describe(s) for s in replacing]}); "
            "keep one of them"
        )
    return tuple(styles)
