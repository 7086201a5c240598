"""The process groups DDP communicates over, taken from a ``ProcessGroupCollection`` and
checked before anything is built or communicated."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch.distributed as dist

import mc_groups as mg
from mc_ddp.distributed_data_parallel_config import DistributedDataParallelConfig
from mc_groups.collection import is_group_live
from mc_groups.errors import InputValueError

_WHAT = "DistributedDataParallel"


@dataclass(frozen=True)
class DDPGroups:
    """Groups of one DDP wrapper.

    ``dp_cp``: every rank holding a replica of the dense params (scaling 1/|dp_cp|,
    ``broadcast_params``); ``intra_dp_cp``: the dense reduction group (one optimizer
    instance; equals ``dp_cp`` with one instance); ``inter_dist_opt``: same shard position
    across instances; ``expt_dp`` / ``intra_expt_dp`` / ``inter_expt_dp``: the same for
    expert params; ``pp``: None reads as pipeline stage 0; ``gtp_remat_active``: the
    collection's ``gtp_remat`` or ``expt_gtp_remat`` group spans more than one rank.
    """

    dp: dist.ProcessGroup
    dp_cp: dist.ProcessGroup
    intra_dp_cp: dist.ProcessGroup
    inter_dist_opt: dist.ProcessGroup | None
    expt_dp: dist.ProcessGroup | None
    intra_expt_dp: dist.ProcessGroup | None
    inter_expt_dp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    gtp_remat_active: bool = False

    @property
    def pipeline_rank(self) -> int:
        """This rank's pipeline stage (0 without a pp group)."""
        return 0 if self.pp is None else mg.group_rank(self.pp)

    def named(self) -> list[tuple[str, dist.ProcessGroup | None]]:
        """``(description, group)`` of every group DDP communicates over."""
        return [
            ("process group dp_cp", self.dp_cp),
            ("process group intra_dp_cp", self.intra_dp_cp),
            ("process group inter_dist_opt", self.inter_dist_opt),
            ("process group expt_dp", self.expt_dp),
            ("process group intra_expt_dp", self.intra_expt_dp),
            ("process group inter_expt_dp", self.inter_expt_dp),
        ]


def require_live(groups: Iterable[tuple[str, dist.ProcessGroup | None]], what: str) -> None:
    """``RuntimeError`` naming the first destroyed group (``(description, group)`` pairs),
    before anything is issued (a collective on a destroyed group fails inside the backend,
    far from the cause)."""
    for name, group in groups:
        if group is not None and not is_group_live(group):
            raise RuntimeError(
                f"{what}: {name} was destroyed (destroy_model_parallel() or "
                "torch.distributed.destroy_process_group()), so this DistributedDataParallel "
                "can no longer communicate; build a new one over live groups (e.g. after "
                "initialize_model_parallel())"
            )


def resolve_groups(
    pgc: mg.ProcessGroupCollection, ddp_config: DistributedDataParallelConfig, has_expert: bool
) -> DDPGroups:
    """The groups DDP needs, each required by name (``MissingGroupError`` names the field)."""
    dp = pgc.require("dp", f"{_WHAT} (the bucket size and the replicas)")
    dp_cp = pgc.require("dp_cp", f"{_WHAT} (gradient averaging over data × context parallel)")
    instances = ddp_config.num_distributed_optimizer_instances
    intra, inter = dp_cp, None
    if instances > 1:
        intra = pgc.require("intra_dp_cp", f"{_WHAT} with {instances} optimizer instances")
        inter = pgc.require("inter_dist_opt", f"{_WHAT} with {instances} optimizer instances")
        _check_instance_sizes(dp_cp, intra, inter, instances)
    expt_dp = intra_expt = inter_expt = None
    if has_expert:
        expt_dp = pgc.require("expt_dp", f"{_WHAT} for expert params (allreduce=False)")
        intra_expt = pgc.intra_expt_dp if pgc.intra_expt_dp is not None else expt_dp
        if instances > 1:
            what = f"{_WHAT} for expert params with {instances} optimizer instances"
            intra_expt = pgc.require("intra_expt_dp", what)
            inter_expt = pgc.require("inter_expt_dp", what)
            _check_split(expt_dp, intra_expt, inter_expt, instances, "expt_dp", "expt_dp")
    gtp_active = any(
        g is not None and mg.group_size(g) > 1 for g in (pgc.gtp_remat, pgc.expt_gtp_remat)
    )
    return DDPGroups(dp, dp_cp, intra, inter, expt_dp, intra_expt, inter_expt, pgc.pp, gtp_active)


def _check_instance_sizes(
    dp_cp: dist.ProcessGroup,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    instances: int,
) -> None:
    if inter.size() != instances:
        raise InputValueError(
            f"num_distributed_optimizer_instances={instances} but pg_collection has "
            f"inter_dist_opt of {inter.size()} ranks: build the collection with "
            f"initialize_model_parallel(num_distributed_optimizer_instances={instances})"
        )
    _check_split(dp_cp, intra, inter, instances, "dp_cp", "dist_opt")


def _check_split(
    whole: dist.ProcessGroup,
    intra: dist.ProcessGroup,
    inter: dist.ProcessGroup,
    instances: int,
    whole_name: str,
    inter_suffix: str,
) -> None:
    """``whole`` = one ``intra`` chunk per instance, linked position by position by
    ``inter``: |intra| · |inter| = |whole|."""
    if intra.size() * inter.size() != whole.size():
        intra_name = "intra_dp_cp" if whole_name == "dp_cp" else "intra_expt_dp"
        raise InputValueError(
            f"num_distributed_optimizer_instances={instances} but pg_collection has "
            f"{intra_name} of {intra.size()} ranks and inter_{inter_suffix} of {inter.size()} "
            f"ranks for {whole_name} of {whole.size()}: build the collection with "
            f"initialize_model_parallel(num_distributed_optimizer_instances={instances})"
        )
