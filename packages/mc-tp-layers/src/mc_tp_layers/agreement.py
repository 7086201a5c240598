r"""Agreement at construction: the ranks of a tensor-parallel group compare how they built
each layer, as it is built.

Why: a TP layer's peers must be built alike. A Column ``input_size`` or a Row
``output_size`` that differs across the ranks of a group aborts inside gloo or hangs at the
first collective; a ``num_embeddings`` that differs shifts every rank's vocabulary range; a
Row bias, ``skip_bias_add`` or ``input_is_parallel`` on one rank only, or a Row output size
that differs at equal numel, gives wrong numbers with no error at all.

Mechanism: each TP layer (:class:`~mc_tp_layers.layers.ColumnParallelLinear`,
:class:`~mc_tp_layers.layers.RowParallelLinear`,
:class:`~mc_tp_layers.layers.VocabParallelEmbedding`) ends its constructor, once every
argument was accepted and its parameters were made, with one :func:`mc_groups.cross_check`
over its TP group::

    construction   point "tensor-parallel layer construction", fields: the layer's class
                   and the sizes and flags below; one exchange of an 8-byte digest
    all equal      the constructor returns; nothing else is communicated, ever: no
                   exchange at the first forward, none per step, none under
                   torch.compile or in a CUDA graph
    different      the ranks exchange their fields (only then) and every rank of the group
                   raises the same TensorParallelAgreementError from the constructor,
                   naming the layer, each field that differs and the global ranks holding
                   each value (a layer of another class at the same point: its class)

Cost: one 8-byte exchange per layer at build on a group of more than one rank (point to
point on its own tag on gloo; on NCCL an all-gather and a device-to-host read), nothing
after. It is not recorded by :func:`mc_groups.record_collectives` (unless asked for with
``status_exchanges=True``), so collective counts do not change. The digest travels where
:func:`mc_groups.cross_check` puts it for the group's backend (the host on gloo and on
torch's fake backend without CUDA, the current CUDA device on NCCL), never on the default
device: layers built under ``torch.device("meta")`` (FSDP2's and torchtitan's meta
initialisation, the dry run on the fake backend) exchange as any other. A group of one rank
exchanges nothing.

What this catches that mc_groups' schedule check does not: the schedule check (opt-in, one
exchange per collective) compares each collective's op, numel, dtype and label as it is
issued, so it cannot see settings that leave those alike: a ``num_embeddings`` that
differs (the all-reduce of ``[b, s, h]`` has the same numel on every rank while the ranks
look up different rows), a Row bias, ``skip_bias_add`` or ``input_is_parallel`` on one rank
(local arithmetic after or before the same all-reduce), a Row output size at equal numel,
``gather_output`` or ``gtp_remat_size`` where the first differing collective is far from
the cause; and it is off unless asked for.

What it does not see: a layer built on some ranks only, after the last layer every rank
builds (its exchange waits for peers that never come; they wait in their next collective
over the group; both fail when the group's timeout expires, and with
``MC_CHECK_COLLECTIVE_SCHEDULE=1`` both name where each rank was at once); the weights'
values, the init method, the RNG tracker; and everything a layer receives per call
(inputs, ``weight=``, ``runtime_gather_output``): each forward checks those locally, as
Megatron's layers do, so a bad input on one rank raises there before that rank issues
anything, while its peers wait in the layer's next collective over the group until the
group's timeout. :func:`~mc_tp_layers.vocab_parallel_cross_entropy` compares its per-call
vocabulary slice across the ranks itself (see :mod:`mc_tp_layers.cross_entropy`).

Compared fields: Column ``input_size``, ``output_size``, ``bias``, ``gather_output``,
``skip_bias_add``, ``sequence_parallel``, ``params_dtype``, ``stride``, ``is_expert``,
``explicit_expert_comm``, ``disable_grad_reduce``, ``gtp_remat_size``, ``output_dtype``,
``defer_embedding_wgrad_compute``, ``wgrad_deferral_limit``; Row the same sizes and
``input_is_parallel``; ``VocabParallelEmbedding`` ``num_embeddings``, ``embedding_dim``,
``reduce_scatter_embeddings``, ``params_dtype``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist

import mc_groups as mg
from mc_groups.comm.cross_rank import Value

__all__ = ["TensorParallelAgreementError"]

_WHERE = "tensor-parallel layer construction"
_CLASS = "class"


class TensorParallelAgreementError(mg.AgreementError):
    """The ranks of a tensor-parallel group built a layer (or called the
    vocabulary-parallel cross-entropy) differently; every rank of the group raises it, with
    the same message."""


def _plain(value: object) -> Value:
    if isinstance(value, torch.dtype):
        return str(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def _agree(
    group: dist.ProcessGroup, kind: str, fields: Mapping[str, object], name: str | None
) -> None:
    """Compare the layer of class ``kind`` just built with ``fields`` (``name``: its label
    in a message, not compared) with its peers on ``group`` (module notes). Collective over
    ``group``; call it last in the constructor."""
    compared: dict[str, Value] = {_CLASS: kind}
    compared.update((key, _plain(value)) for key, value in fields.items())
    try:
        mg.cross_check(group, _WHERE, compared)
    except mg.AgreementError as err:
        raise TensorParallelAgreementError(
            _message(err, f"{kind} {name!r}" if name else kind),
            err.what,
            err.group_ranks,
            err.differences,
        ) from None


def _message(err: mg.AgreementError, layer: str) -> str:
    classes = [d for d in err.differences if d.field == _CLASS]
    if classes:  # the other fields of different classes are not comparable
        lines = [
            f"  class = {classes[0].values_text(', ')} (the ranks built different layers "
            "at this point of their construction order)"
        ]
    else:
        lines = [f"  {layer}: {d.field} = {d.values_text(', ')}" for d in err.differences]
    return "\n".join(
        [
            f"tensor-parallel group ranks {list(err.group_ranks)} built their layers "
            "differently (compared as each layer was built, before it communicated "
            "anything):",
            *lines,
            "Every rank of a tensor-parallel group must build the same layers, in the same "
            "order, with the same sizes and flags.",
        ]
    )
