"""mc-finalize: Megatron-Core's ``finalize_model_grads`` and each of its steps.

:func:`finalize_model_grads` runs after the last backward of a global batch and before the
optimizer step: the data-parallel reduction of every chunk, then every reduction DDP does
not do (pipeline-replicated params, non-tensor-parallel grads, the gtp_remat axis, tied
embeddings), the MoE router balancing updates, and the per-token normalisation. All of it
is one module, :mod:`mc_finalize.finalize`, whose notes list the steps in order.

The steps keep Megatron's (underscored) names and signatures so code that imports them from
``megatron.core.distributed.finalize_model_grads`` ports by changing the import; they are
importable from this package but are not part of ``__all__``. A model chunk is a
structural type (:class:`ModelChunk`); its config any object with Megatron's field names
(:class:`mc_groups.TransformerConfigLike`).
"""

from __future__ import annotations

from mc_finalize.finalize import (
    ModelChunk,
    finalize_model_grads,
    reset_model_temporary_tensors,
)
from mc_finalize.finalize import (
    _allreduce_conditional_embedding_grads as _allreduce_conditional_embedding_grads,
)
from mc_finalize.finalize import _allreduce_embedding_grad as _allreduce_embedding_grad
from mc_finalize.finalize import _allreduce_layernorm_grads as _allreduce_layernorm_grads
from mc_finalize.finalize import (
    _allreduce_non_tensor_model_parallel_grads as _allreduce_non_tensor_model_parallel_grads,
)
from mc_finalize.finalize import (
    _allreduce_position_embedding_grads as _allreduce_position_embedding_grads,
)
from mc_finalize.finalize import (
    _allreduce_replicated_grads_over_gtp_remat_group as _allreduce_replicated_grads_over_gtp_remat_group,  # noqa: E501
)
from mc_finalize.finalize import _allreduce_router_grads as _allreduce_router_grads
from mc_finalize.finalize import _allreduce_word_embedding_grads as _allreduce_word_embedding_grads
from mc_finalize.finalize import _get_main_grad_attr as _get_main_grad_attr
from mc_finalize.finalize import _get_position_embedding_weight as _get_position_embedding_weight
from mc_finalize.finalize import (
    _get_shared_word_embedding_weight as _get_shared_word_embedding_weight,
)
from mc_finalize.finalize import _reshard_if_dtensor as _reshard_if_dtensor
from mc_finalize.finalize import _unshard_if_dtensor as _unshard_if_dtensor
from mc_finalize.finalize import _update_router_expert_bias as _update_router_expert_bias
from mc_finalize.finalize import _update_router_qb_beta as _update_router_qb_beta
from mc_groups import package_version

__version__ = package_version("mc-finalize")

__all__ = ["ModelChunk", "finalize_model_grads", "reset_model_temporary_tensors"]
