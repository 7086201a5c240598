"""mc-moe: expert parallelism for mixture-of-experts models on mc's groups, layers and DDP.

The package root holds what a training script calls:

- :func:`parallelize`: a ``transformers`` MoE model (Mixtral, Qwen3-MoE, OLMoE,
  DeepSeek-V3, gpt-oss) split by its own ``tp_plan`` and ``ep_plan``: dense layers through
  :func:`mc_tp_layers.parallelize`, experts over the ``ep`` and ``expt_tp`` groups
  (:class:`MoEPlanWarning`: dense plan entries that matched no module, the layers they
  name being MoE layers), or a torchtitan MoE model (``GroupedExperts``) named by an
  ``ep_plan``; :func:`sequence_parallel_plan`: the plan under tensor parallelism.
- :func:`full_state_dict` / :func:`load_full_state_dict`: one piece (the unsplit model's
  names and shapes) and back; :func:`model_sharded_state_dict`: full-shape DCP views.

The rest lives in the module of its mechanism:

- :mod:`mc_moe.dispatcher`: :class:`~mc_moe.dispatcher.TokenDispatcher`, Megatron-Core's
  all-to-all token dispatch (dropless) over ``ep`` and ``expt_tp``.
- :mod:`mc_moe.experts`: a ``transformers`` experts module (3-D expert weights) or
  torchtitan's ``GroupedExperts`` converted in place: its experts and expert-TP shards,
  tagged for mc DDP's expert buffers.
- :mod:`mc_moe.router`: Megatron's aux-loss-free expert bias for routers that have one
  (updated by ``mc_finalize.finalize_model_grads``) and ``transformers``' load-balancing
  loss on the global batch.
- :mod:`mc_moe.permutation`: Megatron's ``permute`` / ``unpermute`` (tokens grouped by
  expert and back).
- :mod:`mc_moe.plan` (the styles of the models' plans) and :mod:`mc_moe.state` (which
  params are experts: :func:`~mc_moe.state.expert_params`).

Groups are passed explicitly (``pg_collection=``); every collective goes through
:mod:`mc_groups`, so :func:`mc_groups.record_collectives` sees it.
"""

from __future__ import annotations

from mc_groups import package_version
from mc_moe.plan import MoEPlanWarning, parallelize, sequence_parallel_plan
from mc_moe.state import full_state_dict, load_full_state_dict, model_sharded_state_dict

__version__ = package_version("mc-moe")

__all__ = [
    "MoEPlanWarning",
    "full_state_dict",
    "load_full_state_dict",
    "model_sharded_state_dict",
    "parallelize",
    "sequence_parallel_plan",
]
