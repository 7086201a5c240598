"""mc-moe: expert parallelism for mixture-of-experts models on mc's groups, layers and DDP.

- :func:`parallelize`: a ``transformers`` MoE model (Mixtral, Qwen3-MoE, OLMoE,
  DeepSeek-V3, gpt-oss) split by its own ``tp_plan`` and ``ep_plan``: dense layers through
  :func:`mc_tp_layers.parallelize`, experts over the ``ep`` and ``expt_tp`` groups.
- :mod:`mc_moe.dispatcher`: :class:`TokenDispatcher`, Megatron-Core's all-to-all token
  dispatch (dropless) over ``ep`` and ``expt_tp``.
- :mod:`mc_moe.experts`: a ``transformers`` experts module (3-D expert weights) converted
  in place: its experts and expert-TP shards, tagged for mc DDP's expert buffers.
- :mod:`mc_moe.router`: Megatron's aux-loss-free expert bias for routers that have one
  (updated by ``mc_finalize.finalize_model_grads``) and ``transformers``' load-balancing
  loss on the global batch.
- :func:`full_state_dict` / :func:`load_full_state_dict`: one piece (the unsplit model's
  names and shapes) and back.
- :mod:`mc_moe.permutation`: Megatron's ``permute`` / ``unpermute`` (tokens grouped by
  expert and back).

Groups are passed explicitly (``pg_collection=``); every collective goes through
:mod:`mc_groups`, so :func:`mc_groups.record_collectives` sees it.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mc_moe.dispatcher import TokenDispatcher
from mc_moe.experts import ExpertWeights, is_converted, read_experts, shard_experts
from mc_moe.permutation import (
    Permuted,
    permute,
    routing_map_from_top_k,
    sort_chunks_by_idxs,
    unpermute,
)
from mc_moe.plan import MoEPlanWarning, moe_entries, parallelize, sequence_parallel_plan
from mc_moe.router import (
    enable_expert_bias,
    global_load_balancing_loss,
    routers_with_bias,
    use_global_aux_loss,
)
from mc_moe.state import (
    expert_params,
    full_state_dict,
    load_full_state_dict,
    model_sharded_state_dict,
)

try:  # one source of the version: the distribution's pyproject.toml
    __version__ = version("mc-moe")
except PackageNotFoundError:  # a checkout on sys.path, not installed
    __version__ = "0+unknown"

__all__ = [
    "ExpertWeights",
    "MoEPlanWarning",
    "Permuted",
    "TokenDispatcher",
    "enable_expert_bias",
    "expert_params",
    "full_state_dict",
    "global_load_balancing_loss",
    "is_converted",
    "load_full_state_dict",
    "model_sharded_state_dict",
    "moe_entries",
    "parallelize",
    "permute",
    "read_experts",
    "routers_with_bias",
    "routing_map_from_top_k",
    "sequence_parallel_plan",
    "shard_experts",
    "sort_chunks_by_idxs",
    "unpermute",
    "use_global_aux_loss",
]
