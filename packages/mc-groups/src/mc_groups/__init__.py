"""mc-groups: who talks to whom, and the one layer through which they talk.

The package root holds what users call; the rest lives in its modules.

- :class:`ProcessGroupCollection`, :func:`initialize_model_parallel`,
  :func:`destroy_model_parallel`: the groups of a layout, built once and passed explicitly;
  :func:`get_default_collection`: the optional default collection that
  ``initialize_model_parallel(..., set_default=True)`` registers (set and cleared through
  :mod:`mc_groups.collection`). :func:`validate_sizes`: a layout's sizes checked by
  pure arithmetic (:mod:`mc_groups.rank_generator`, with Megatron's ``RankGenerator``).
  :func:`is_pipeline_first_stage` / :func:`is_pipeline_last_stage`: where a model chunk sits
  (:mod:`mc_groups.pipeline_stages`).
- The collectives (:mod:`mc_groups.comm.collectives`): :func:`all_reduce`,
  :func:`reduce_scatter`, :func:`all_gather`, :func:`broadcast`, :func:`all_to_all`,
  :func:`send` / :func:`recv`, :func:`barrier`, :func:`all_gather_objects`, group queries;
  typed, validated, recorded (:func:`record_collectives`, :class:`CollectiveRecord`),
  bounded, failures naming op, group ranks and label (:class:`CollectiveError`);
  :class:`CollectiveHandle` is the one handle for work in flight.
  :mod:`mc_groups.comm.traceable`: the same collectives returning new tensors, which trace
  under ``torch.compile(fullgraph=True)``; :mod:`mc_groups.comm.communicator`: batched
  collectives, :func:`coalesced` (:class:`CoalescedBatch`) and a caller's lists bound once.
- Cross-rank verification (:mod:`mc_groups.comm.cross_rank`), one primitive:
  :func:`cross_check` (one 8-byte exchange: the ranks of a group are at the same point,
  passed their checks and hold the same values, else every rank raises the same error:
  :class:`PeerCheckError`, :class:`AgreementError`, :class:`CollectiveScheduleError`);
  :func:`fail_together` (an entry point's local checks, then the exchange); the
  per-collective check behind the environment variable ``MC_CHECK_COLLECTIVE_SCHEDULE``
  (:func:`check_collective_schedule`, a debug switch).
- :class:`ModelParallelConfig`: the validated parallel config (Megatron field names);
  :class:`TransformerConfigLike`: what every package reads from a config (Megatron's
  configs qualify), with :mod:`mc_groups.config` the one home of the fields' types and
  Megatron's defaults.
- Modules every mc package shares: :mod:`mc_groups.argcheck` (argument checks, one message
  shape), :mod:`mc_groups.errors` (every error type), :mod:`mc_groups.param_attrs` (the
  attributes mc and Megatron-Core hang on parameters: who sets and who reads each),
  :mod:`mc_groups.device` (stream/synchronise helpers that are no-ops on CPU),
  :mod:`mc_groups.elastic` (:func:`~mc_groups.elastic.init_process_group` for torchrun
  restarts), :mod:`mc_groups.testing` (a reusable multi-process CPU harness for tests);
  :func:`package_version`, every mc package's ``__version__``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from mc_groups import argcheck as argcheck
from mc_groups import elastic as elastic
from mc_groups import param_attrs as param_attrs
from mc_groups.collection import ProcessGroupCollection, get_default_collection
from mc_groups.comm.collectives import (
    CollectiveHandle,
    ReduceOp,
    all_gather,
    all_gather_objects,
    all_reduce,
    all_to_all,
    barrier,
    broadcast,
    check_collective_schedule,
    group_rank,
    group_ranks,
    group_size,
    recv,
    reduce_scatter,
    send,
)
from mc_groups.comm.communicator import CoalescedBatch, coalesced
from mc_groups.comm.cross_rank import cross_check, fail_together
from mc_groups.comm.recorder import CollectiveRecord, record_collectives
from mc_groups.config import ModelParallelConfig, TransformerConfigLike
from mc_groups.errors import (
    AgreementError,
    CollectiveError,
    CollectiveScheduleError,
    PeerCheckError,
)
from mc_groups.initialize import (
    destroy_model_parallel,
    initialize_model_parallel,
)
from mc_groups.pipeline_stages import (
    is_pipeline_first_stage,
    is_pipeline_last_stage,
)
from mc_groups.rank_generator import (
    validate_sizes,
)


def package_version(distribution: str) -> str:
    """The version of the installed mc package ``distribution`` (``"mc-ddp"``): every mc
    package's ``__version__``, read from one source, its pyproject.toml; ``"0+unknown"``
    for a checkout put on ``sys.path`` without installing it (``scripts/gpu_check.py``)."""
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "0+unknown"


__version__ = package_version("mc-groups")

__all__ = [
    "AgreementError",
    "CoalescedBatch",
    "CollectiveError",
    "CollectiveHandle",
    "CollectiveRecord",
    "CollectiveScheduleError",
    "ModelParallelConfig",
    "PeerCheckError",
    "ProcessGroupCollection",
    "ReduceOp",
    "TransformerConfigLike",
    "all_gather",
    "all_gather_objects",
    "all_reduce",
    "all_to_all",
    "barrier",
    "broadcast",
    "check_collective_schedule",
    "coalesced",
    "cross_check",
    "destroy_model_parallel",
    "fail_together",
    "get_default_collection",
    "group_rank",
    "group_ranks",
    "group_size",
    "initialize_model_parallel",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "package_version",
    "record_collectives",
    "recv",
    "reduce_scatter",
    "send",
    "validate_sizes",
]
