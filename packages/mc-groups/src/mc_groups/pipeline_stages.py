"""Pipeline-stage helpers: where this rank sits in its pipeline, from the collection's pp group.

Stage ``s`` of ``P`` is this rank's rank in ``pg_collection.pp``; the next stage is
``(s + 1) mod P`` and the previous one ``(s − 1) mod P`` (returned as global ranks, for
point-to-point calls). With virtual pipelining, a model chunk ``vp_stage`` of ``V`` is the
first stage only when ``s = 0`` and ``vp_stage = 0``, the last only when ``s = P − 1`` and
``vp_stage = V − 1``.
"""

from __future__ import annotations

import torch.distributed as dist

from mc_groups.argcheck import check_optional_int
from mc_groups.collection import ProcessGroupCollection, check_collection
from mc_groups.comm.collectives import group_rank, group_ranks
from mc_groups.errors import InputValueError

__all__ = [
    "get_pipeline_next_rank",
    "get_pipeline_prev_rank",
    "is_pipeline_first_stage",
    "is_pipeline_last_stage",
    "pipeline_rank",
    "pipeline_size",
]


def _pp(pg_collection: object, what: str) -> dist.ProcessGroup:
    """The pp group of a checked collection (``what`` names the caller in errors)."""
    return check_collection("pg_collection", pg_collection, what=what).require("pp", what)


def pipeline_rank(pg_collection: ProcessGroupCollection) -> int:
    """This rank's pipeline stage."""
    return int(_pp(pg_collection, "pipeline_rank").rank())


def pipeline_size(pg_collection: ProcessGroupCollection) -> int:
    """Number of pipeline stages."""
    return int(_pp(pg_collection, "pipeline_size").size())


def _check_vp(vp_stage: object, vp_size: object) -> None:
    vp_stage = check_optional_int("vp_stage", vp_stage, minimum=0)
    vp_size = check_optional_int("vp_size", vp_size)
    if vp_stage is None:
        return
    if vp_size is None or not 0 <= vp_stage < vp_size:
        raise InputValueError(
            f"vp_stage={vp_stage} needs vp_size (got {vp_size}) with 0 <= vp_stage < vp_size"
        )


def is_pipeline_first_stage(
    pg_collection: ProcessGroupCollection,
    vp_stage: int | None = None,
    vp_size: int | None = None,
) -> bool:
    """True on pipeline stage 0 (and, with virtual stages, for chunk 0 only)."""
    check_collection("pg_collection", pg_collection, what="is_pipeline_first_stage")
    _check_vp(vp_stage, vp_size)
    return pipeline_rank(pg_collection) == 0 and (vp_stage is None or vp_stage == 0)


def is_pipeline_last_stage(
    pg_collection: ProcessGroupCollection,
    vp_stage: int | None = None,
    vp_size: int | None = None,
) -> bool:
    """True on the last pipeline stage (and, with virtual stages, for the last chunk only)."""
    check_collection("pg_collection", pg_collection, what="is_pipeline_last_stage")
    _check_vp(vp_stage, vp_size)
    last = pipeline_rank(pg_collection) == pipeline_size(pg_collection) - 1
    return last and (vp_stage is None or vp_size is None or vp_stage == vp_size - 1)


def get_pipeline_next_rank(pg_collection: ProcessGroupCollection) -> int:
    """Global rank of the next pipeline stage (wrapping around)."""
    return _neighbour(_pp(pg_collection, "get_pipeline_next_rank"), +1)


def get_pipeline_prev_rank(pg_collection: ProcessGroupCollection) -> int:
    """Global rank of the previous pipeline stage (wrapping around)."""
    return _neighbour(_pp(pg_collection, "get_pipeline_prev_rank"), -1)


def _neighbour(pp: dist.ProcessGroup, step: int) -> int:
    ranks = group_ranks(pp)
    return ranks[(group_rank(pp) + step) % len(ranks)]
