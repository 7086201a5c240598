"""mc-groups: who talks to whom, and the one layer through which they talk.

- :class:`RankGenerator`: pure rank arithmetic for a parallel layout.
- :func:`validate_sizes` / :class:`ParallelSizes` (:mod:`mc_groups.layout`): a layout's
  sizes, checked by pure arithmetic.
- :class:`ProcessGroupCollection` and :func:`initialize_model_parallel`: the groups of a
  layout, built once and passed explicitly; :func:`collection_or_default`: the one fallback
  to the optional default collection (:func:`set_default_collection`).
- :mod:`mc_groups.comm.collectives`: typed, validated, recorded collectives
  (:func:`record_collectives` lists what ran); failures name op, group ranks and label;
  :class:`CollectiveHandle` is the one handle for work in flight (works, child handles,
  finishers).
- :mod:`mc_groups.comm.traceable`: the same collectives returning new tensors, which trace
  under ``torch.compile(fullgraph=True)`` (torch's functional collectives while compiling,
  recorded when the compiled graph runs them).
- :class:`Communicator`: one caller's batched collectives on one group, keeping their
  temporaries between calls (a DDP bucket group holds one).
- :mod:`mc_groups.comm.cross_rank`: cross-rank verification with one primitive,
  :func:`cross_check` (one 8-byte exchange: the ranks of a group are at the same point,
  passed their checks and hold the same values, else every rank raises the same error);
  :func:`fail_together` (an entry point's local checks, then the exchange),
  :class:`CarriedStatus` (the status riding in a reduction the entry point runs anyway) and
  the per-collective check behind ``MC_CHECK_COLLECTIVE_SCHEDULE``
  (:func:`check_collective_schedule`).
- :mod:`mc_groups.device`: stream/synchronise helpers that are no-ops on CPU.
- :class:`ModelParallelConfig`: the validated parallel config (Megatron field names);
  :class:`TransformerConfigLike`: what every package reads from a config (Megatron's
  configs qualify), with :mod:`mc_groups.config` the one home of the fields' types and
  Megatron's defaults.
- :mod:`mc_groups.argcheck`: the argument checks every mc package shares (bools are bools,
  ints >= a minimum, finite reals, float dtypes, strs, live process groups, collections
  not destroyed), one message shape.
- :mod:`mc_groups.param_attrs`: the attributes mc's packages (and Megatron-Core) hang on
  parameters (``allreduce``, ``main_grad``, ``sequence_parallel``, ...): names, who sets and
  who reads each, typed accessors.
- :func:`is_group_live`: False once a group was destroyed; every collective refuses a
  destroyed group, and :func:`destroy_model_parallel` marks its collection destroyed.
- :mod:`mc_groups.elastic`: :func:`~mc_groups.elastic.init_process_group` joins the world
  in a key space of the restart attempt's own, so ``torchrun --max-restarts`` restarts
  with torchrun's shared store.
- :mod:`mc_groups.errors`: the error types (bad input, :class:`CollectiveError`, and the
  errors of ranks that disagree: :class:`PeerCheckError`, :class:`AgreementError`,
  :class:`CollectiveScheduleError`).
- :mod:`mc_groups.testing`: a reusable multi-process CPU harness for tests.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mc_groups import argcheck as argcheck
from mc_groups import elastic as elastic
from mc_groups import param_attrs as param_attrs
from mc_groups.collection import GROUP_FIELDS, MissingGroupError, ProcessGroupCollection
from mc_groups.comm import traceable as traceable
from mc_groups.comm._coalesced import CoalescedBatch, coalesced
from mc_groups.comm._common import (
    SCHEDULE_CHECK_ENV,
    check_collective_schedule,
    schedule_check_enabled,
)
from mc_groups.comm.collectives import (
    CollectiveHandle,
    ReduceOp,
    all_gather,
    all_gather_objects,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    group_rank,
    group_ranks,
    group_size,
    is_group_live,
    record_p2p_ops,
    recv,
    reduce_scatter,
    send,
)
from mc_groups.comm.communicator import Communicator
from mc_groups.comm.cross_rank import CarriedStatus, cross_check, fail_together
from mc_groups.comm.recorder import CollectiveRecord, record_collectives
from mc_groups.config import ModelParallelConfig, TransformerConfigLike
from mc_groups.default_collection import (
    NoDefaultCollectionError,
    clear_default_collection,
    collection_or_default,
    get_default_collection,
    set_default_collection,
)
from mc_groups.errors import (
    AgreementError,
    CollectiveError,
    CollectiveScheduleError,
    InputStateError,
    InputTypeError,
    InputValueError,
    PeerCheckError,
)
from mc_groups.initialize import (
    DistributedNotInitializedError,
    destroy_model_parallel,
    initialize_model_parallel,
)
from mc_groups.layout import ParallelSizes, validate_sizes
from mc_groups.pipeline import (
    get_pipeline_next_rank,
    get_pipeline_prev_rank,
    is_pipeline_first_stage,
    is_pipeline_last_stage,
    pipeline_rank,
    pipeline_size,
)
from mc_groups.rank_generator import AXES, MAX_WORLD_SIZE, RankGenerator

try:  # one source of the version: the distribution's pyproject.toml
    __version__ = version("mc-groups")
except PackageNotFoundError:  # a checkout on sys.path, not installed (scripts/gpu_check.py)
    __version__ = "0+unknown"

__all__ = [
    "AXES",
    "GROUP_FIELDS",
    "MAX_WORLD_SIZE",
    "SCHEDULE_CHECK_ENV",
    "AgreementError",
    "CarriedStatus",
    "CoalescedBatch",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveRecord",
    "CollectiveScheduleError",
    "Communicator",
    "DistributedNotInitializedError",
    "InputStateError",
    "InputTypeError",
    "InputValueError",
    "MissingGroupError",
    "ModelParallelConfig",
    "NoDefaultCollectionError",
    "ParallelSizes",
    "PeerCheckError",
    "ProcessGroupCollection",
    "RankGenerator",
    "ReduceOp",
    "TransformerConfigLike",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "check_collective_schedule",
    "clear_default_collection",
    "coalesced",
    "collection_or_default",
    "cross_check",
    "destroy_model_parallel",
    "fail_together",
    "get_default_collection",
    "get_pipeline_next_rank",
    "get_pipeline_prev_rank",
    "group_rank",
    "group_ranks",
    "group_size",
    "initialize_model_parallel",
    "is_group_live",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "pipeline_rank",
    "pipeline_size",
    "record_collectives",
    "record_p2p_ops",
    "recv",
    "reduce_scatter",
    "schedule_check_enabled",
    "send",
    "set_default_collection",
    "validate_sizes",
]
