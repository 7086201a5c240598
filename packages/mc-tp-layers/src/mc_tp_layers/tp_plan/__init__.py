r"""Give any model Megatron's tensor-parallel layers with one call.

::

    from mc_tp_layers import parallelize
    model = LlamaForCausalLM(config)                       # nn.Linear / nn.Embedding inside
    parallelize(model, model.tp_plan, config=cfg, pg_collection=pgc)

The two type aliases (Style, Plan): a ``Style`` is one of the style records below, a
``Plan`` maps fnmatch patterns to a style, a style name or a sequence of them.

``plan`` is plain data, as in ``torch.distributed.tensor.parallel.parallelize_module``:
fnmatch patterns over qualified module names → a style. The style names are those of
``transformers``' ``tp_plan`` (``colwise``, ``rowwise``, ``colwise_gather_output`` /
``colwise_rep``, ``rowwise_split_input`` / ``rowwise_rep``, ``packed_colwise``,
``embedding_rowwise``, ``replicated_with_grad_allreduce``, ``sequence_parallel``), plus
``sequence_gather`` and
``sequence_scatter`` for sequence parallelism and ``colwise_rmsnorm`` for a norm over a
split width; mc does not import ``transformers``.

1. Replacing styles (:class:`Colwise`, :class:`Rowwise`, :class:`VocabEmbedding`) build
   :class:`~mc_tp_layers.ColumnParallelLinear` / :class:`~mc_tp_layers.RowParallelLinear` /
   :class:`~mc_tp_layers.VocabParallelEmbedding` from the module's current weights;
   :class:`ColwiseRMSNorm` splits an RMS norm that follows a ``colwise`` layer (OLMo-2's
   ``q_norm``).
2. Sequence styles (:class:`SequenceParallelNorm`, :class:`SequenceGather`,
   :class:`SequenceScatter`): with ``config.sequence_parallel`` the residual stream between
   blocks is split along ``sequence_dim``, gathered where a block of ``colwise`` layers
   starts and reduce-scattered by its ``rowwise`` output layer. Without it, only
   ``SequenceGather`` acts: the block's input grad is all-reduced once for all its
   ``colwise`` layers.
3. :func:`sequence_parallel_plan` derives those entries from a decoder's module tree and
   returns the whole plan: ``parallelize(model, sequence_parallel_plan(model), ...)``.
4. :func:`full_state_dict` / :func:`load_full_state_dict` go back to one piece and back
   (:mod:`mc_tp_layers.shards`: for any mc model, re-exported here).
5. :func:`vocab_parallel_causal_lm_loss`: the loss of a ``colwise`` LM head without
   gathering the logits.

docs/parallelize.md walks through a ``transformers`` Llama at TP × DP with sequence
parallelism.
"""

from __future__ import annotations

from mc_tp_layers.shards import full_state_dict, load_full_state_dict
from mc_tp_layers.tp_plan._convert import parallelize
from mc_tp_layers.tp_plan._loss import vocab_parallel_causal_lm_loss
from mc_tp_layers.tp_plan._sp_plan import sequence_parallel_plan
from mc_tp_layers.tp_plan._styles import (
    Colwise,
    ColwiseRMSNorm,
    Plan,
    ReplicatedWithGradAllReduce,
    Rowwise,
    SequenceGather,
    SequenceParallelNorm,
    SequenceScatter,
    Style,
    VocabEmbedding,
    style_names,
)

__all__ = [
    "Colwise",
    "ColwiseRMSNorm",
    "Plan",
    "ReplicatedWithGradAllReduce",
    "Rowwise",
    "SequenceGather",
    "SequenceParallelNorm",
    "SequenceScatter",
    "Style",
    "VocabEmbedding",
    "full_state_dict",
    "load_full_state_dict",
    "parallelize",
    "sequence_parallel_plan",
    "style_names",
    "vocab_parallel_causal_lm_loss",
]
