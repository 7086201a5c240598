"""A parallel layout's sizes and the rank lists of its groups: pure arithmetic.

:func:`validate_sizes` checks the sizes against the world and derives the data-parallel
sizes (:class:`ParallelSizes`)::

    world = tp · gtp_remat · cp · dp · pp                    (dense generator)
          = etp · egtp_remat · ep · edp · pp                 (expert generator)

``_role_rank_lists`` turns them, with the ``order`` string, into every role's rank lists
(all groups of the role, not only this rank's) through two :class:`RankGenerator` s.
Nothing here allocates or communicates: :func:`mc_groups.initialize_model_parallel` checks
a layout with these before any group exists, and a dry run can compute a layout of any
size.
"""

from __future__ import annotations

from dataclasses import dataclass

from mc_groups.argcheck import check_int, check_optional_int
from mc_groups.errors import InputValueError
from mc_groups.rank_generator import MAX_WORLD_SIZE, RankGenerator

__all__ = ["ParallelSizes", "validate_sizes"]


@dataclass(frozen=True)
class ParallelSizes:
    """Validated sizes of a layout (derived data-parallel sizes included)."""

    world: int
    tp: int
    pp: int
    vpp: int | None
    cp: int
    ep: int
    etp: int
    gtp_remat: int
    expert_gtp_remat: int
    dp: int
    expert_dp: int
    dist_opt_instances: int


def _divide(world: int, parts: dict[str, int], what: str) -> int:
    product = 1
    for v in parts.values():
        product *= v
    if world % product:
        shown = " × ".join(f"{k}={v}" for k, v in parts.items())
        raise InputValueError(
            f"world size {world} is not divisible by {shown} = {product}; {what} must be a "
            "whole number"
        )
    return world // product


def validate_sizes(
    world_size: int,
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
) -> ParallelSizes:
    """Check a layout against ``world_size`` and derive the data-parallel sizes.

    Every size is an int >= 1 (``TypeError`` / ``ValueError`` naming it), none exceeds the
    world (``world_size`` itself is at most :data:`~mc_groups.MAX_WORLD_SIZE`), and the
    products divide the world. Pure arithmetic: nothing is allocated or communicated.
    """
    world = check_int("world_size", world_size, maximum=MAX_WORLD_SIZE)
    tp = check_int("tensor_model_parallel_size", tensor_model_parallel_size)
    pp = check_int("pipeline_model_parallel_size", pipeline_model_parallel_size)
    cp = check_int("context_parallel_size", context_parallel_size)
    ep = check_int("expert_model_parallel_size", expert_model_parallel_size)
    etp_arg = check_optional_int("expert_tensor_parallel_size", expert_tensor_parallel_size)
    etp = tp if etp_arg is None else etp_arg
    gtp = check_int("gtp_remat_size", gtp_remat_size)
    egtp = check_int("expert_gtp_remat_size", expert_gtp_remat_size)
    inst = check_int("num_distributed_optimizer_instances", num_distributed_optimizer_instances)
    vpp = check_optional_int(
        "virtual_pipeline_model_parallel_size", virtual_pipeline_model_parallel_size
    )
    _within_world(
        world,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        gtp_remat_size=gtp,
        expert_gtp_remat_size=egtp,
        num_distributed_optimizer_instances=inst,
    )
    if vpp is not None and pp <= 1:
        raise InputValueError(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size"
            f" > 1 (got {pp}); drop the virtual size or use more pipeline stages"
        )
    dp = _divide(world, {"tp": tp, "gtp_remat": gtp, "cp": cp, "pp": pp}, "the data-parallel size")
    edp = _divide(
        world,
        {"etp": etp, "expert_gtp_remat": egtp, "ep": ep, "pp": pp},
        "the expert data-parallel size",
    )
    if (dp * cp) % inst:
        raise InputValueError(
            f"num_distributed_optimizer_instances={inst} must divide the data-parallel × "
            f"context-parallel size {dp} × {cp} = {dp * cp}"
        )
    if inst > 1 and (gtp > 1 or egtp > 1):
        raise InputValueError(
            f"gtp_remat_size={gtp} / expert_gtp_remat_size={egtp} cannot be combined with "
            f"num_distributed_optimizer_instances={inst} > 1; use one instance with gtp_remat"
        )
    return ParallelSizes(world, tp, pp, vpp, cp, ep, etp, gtp, egtp, dp, edp, inst)


def _within_world(world: int, **sizes: int) -> None:
    for name, size in sizes.items():
        if size > world:
            raise InputValueError(
                f"{name}={size} exceeds the world size {world}: a parallel axis cannot span "
                "more ranks than the world has"
            )


def _role_rank_lists(sizes: ParallelSizes, order: str) -> dict[str, list[list[int]]]:
    """Every role's rank lists (all groups of that role, not only this rank's)."""
    dense = RankGenerator(
        sizes.tp, 1, sizes.dp, sizes.pp, sizes.cp, order, gtp_remat=sizes.gtp_remat
    )
    expert = RankGenerator(
        sizes.etp,
        sizes.ep,
        sizes.expert_dp,
        sizes.pp,
        1,
        order,
        gtp_remat=sizes.expert_gtp_remat,
        is_expert=True,
    )
    pp_lists = dense.get_ranks("pp")
    roles = {
        "tp": dense.get_ranks("tp"),
        "pp": pp_lists,
        "mp": dense.get_ranks("tp-gtp_remat-pp"),
        "embd": [sorted({r[0], r[-1]}) for r in pp_lists],
        "pos_embd": [[r[0]] for r in pp_lists],
        "cp": dense.get_ranks("cp"),
        "tp_cp": dense.get_ranks("tp-cp"),
        # spans gtp_remat like dp (Megatron: "tp-gtp_remat-dp-cp"): its peers see other tokens
        "tp_dp_cp": dense.get_ranks("tp-gtp_remat-dp-cp"),
        "dp": dense.get_ranks("dp"),
        "dp_cp": dense.get_ranks("dp-cp"),
        "dp_cp_gtp_remat": dense.get_ranks("dp-cp-gtp_remat"),
        "gtp_remat": dense.get_ranks("gtp_remat"),
        "ep": expert.get_ranks("ep"),
        "expt_tp": expert.get_ranks("tp"),
        "tp_ep": expert.get_ranks("tp-ep"),
        "tp_ep_pp": expert.get_ranks("tp-ep-pp"),
        "expt_gtp_remat": expert.get_ranks("gtp_remat"),
        "expt_dp": expert.get_ranks("dp"),
        "expt_dp_gtp_remat": expert.get_ranks("dp-gtp_remat"),
        "world": [list(range(sizes.world))],
    }
    roles.update(_dist_opt_rank_lists(sizes, roles["dp_cp"], roles["expt_dp"]))
    return roles


def _dist_opt_rank_lists(
    sizes: ParallelSizes, dp_cp: list[list[int]], expt_dp: list[list[int]]
) -> dict[str, list[list[int]]]:
    """Distributed-optimizer instance groups.

    With k instances, each dp·cp group is cut into k contiguous chunks (one instance each:
    ``intra_dp_cp``); ``inter_dist_opt`` links the ranks holding the same shard position in
    every instance (stride = chunk length); ``intra_dist_opt`` is every rank of one instance:
    the world cut into k contiguous blocks. Expert params the same over ``expt_dp``:
    ``intra_expt_dp`` cuts each expt_dp group into k contiguous chunks, ``inter_expt_dp``
    links the same position of every chunk (so an expert gradient reduce-scattered inside
    its chunk is then all-reduced with the ranks that hold the same expert and shard).
    """
    k = sizes.dist_opt_instances
    if k == 1:
        return {
            "intra_dp_cp": dp_cp,
            "intra_expt_dp": expt_dp,
            "intra_dist_opt": [list(range(sizes.world))],
        }
    chunk = len(dp_cp[0]) // k
    e_chunk = max(len(expt_dp[0]) // k, 1)
    block = sizes.world // k
    return {
        "intra_dp_cp": [g[i * chunk : (i + 1) * chunk] for g in dp_cp for i in range(k)],
        "inter_dist_opt": [g[i::chunk] for g in dp_cp for i in range(chunk)],
        "intra_expt_dp": [
            g[i * e_chunk : (i + 1) * e_chunk] for g in expt_dp for i in range(len(g) // e_chunk)
        ],
        "inter_expt_dp": [g[i::e_chunk] for g in expt_dp for i in range(e_chunk)],
        "intra_dist_opt": [list(range(i * block, (i + 1) * block)) for i in range(k)],
    }
