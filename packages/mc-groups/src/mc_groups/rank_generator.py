"""Which global ranks form each parallel group: pure arithmetic, no processes.

A world of ``tp · gtp_remat · cp · ep · dp · pp`` ranks is a mixed-radix number whose
digits are the parallel axes. The ``order`` string lists the axes from the fastest-varying
digit to the slowest, so with the default ``tp-cp-ep-dp-pp`` neighbouring ranks share
everything but their tensor-parallel index::

    world 8, tp=2 dp=2 pp=2, order tp-cp-ep-dp-pp      rank = tp + 2·dp + 4·pp

        pp=0: dp=0 → [0 1]   dp=1 → [2 3]      pp=1: dp=0 → [4 5]   dp=1 → [6 7]

A group "over" some axes (``get_ranks("tp-pp")``) is the set of ranks that agree on every
*other* axis; members are listed with the leftmost masked axis varying fastest, groups are
listed with the leftmost unmasked axis varying fastest.

``gtp_remat`` (generalised tensor parallelism with weight rematerialisation: weights are
sharded over it and all-gathered before each GEMM, data differs across it) is injected
right after ``tp`` in the dense generator and right after ``ep`` in the expert one when the
order string does not place it explicitly.

A parallel layout's sizes and the rank lists of its groups: pure arithmetic.

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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mc_groups.argcheck import check_flag, check_int, check_optional_int
from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "AXES",
    "MAX_WORLD_SIZE",
    "ParallelSizes",
    "RankGenerator",
    "validate_sizes",
]

AXES: tuple[str, ...] = ("tp", "gtp_remat", "cp", "ep", "dp", "pp")
"""Axis names an ``order`` string may contain."""

MAX_WORLD_SIZE = 2**20
"""The most ranks a layout may have, about ten times the largest clusters. A generator
enumerates every rank, so an absurd size (``tp = 2**40``) is refused before anything is
allocated instead of filling memory."""


class RankGenerator:
    """Enumerates the rank groups of a parallel layout.

    Args:
        tp, ep, dp, pp, cp: axis sizes (each ``>= 1``).
        order: axes joined by ``-``, fastest-varying first. Size-1 axes missing from it are
            appended; a missing axis of size > 1 is a ``ValueError``.
        rank_offset: added to every rank (for layouts that start after other ranks).
        gtp_remat: size of the gtp_remat axis.
        is_expert: where ``gtp_remat`` is injected when ``order`` does not name it:
            after ``tp`` (dense) or after ``ep`` (expert).

    ``ep > 1`` together with ``cp > 1`` is a ``ValueError``: context parallelism lives in
    the dense generator and expert parallelism in the expert one; so is a layout of more
    than :data:`MAX_WORLD_SIZE` ranks.
    """

    def __init__(
        self,
        tp: int,
        ep: int,
        dp: int,
        pp: int,
        cp: int,
        order: str = "tp-cp-ep-dp-pp",
        rank_offset: int = 0,
        gtp_remat: int = 1,
        *,
        is_expert: bool = False,
    ) -> None:
        given = {"tp": tp, "gtp_remat": gtp_remat, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        sizes = {name: check_int(name, size) for name, size in given.items()}
        rank_offset = check_int("rank_offset", rank_offset, minimum=0)
        check_flag("is_expert", is_expert)
        world = math.prod(sizes.values())
        if world > MAX_WORLD_SIZE:
            shown = " × ".join(f"{k}={v}" for k, v in sizes.items() if v > 1)
            raise InputValueError(
                f"{shown} = {world} ranks exceeds MAX_WORLD_SIZE={MAX_WORLD_SIZE}; the sizes "
                "multiply to the world size: check for a misplaced or mistyped size"
            )
        if ep > 1 and cp > 1:
            raise InputValueError(
                f"ep={ep} and cp={cp}: one RankGenerator cannot have both expert and context "
                "parallelism > 1; use cp in the dense generator and ep in the expert generator"
            )
        self.tp, self.ep, self.dp = sizes["tp"], sizes["ep"], sizes["dp"]
        self.pp, self.cp, self.gtp_remat = sizes["pp"], sizes["cp"], sizes["gtp_remat"]
        self.rank_offset = rank_offset
        self.is_expert = is_expert
        self.world_size = world
        self.order = _complete_order(order, sizes, anchor="ep" if is_expert else "tp")
        self._axes = self.order.split("-")
        self._sizes = [sizes[a] for a in self._axes]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group over the axes named in ``token`` (e.g. ``"tp-pp"``), as rank lists."""
        masked = _parse_token(token, self._axes)
        strides = _strides(self._sizes)
        inner = [i for i, a in enumerate(self._axes) if a in masked]
        outer = [i for i, a in enumerate(self._axes) if a not in masked]
        groups = []
        for group_digits in _counting([self._sizes[i] for i in outer]):
            base = sum(d * strides[i] for d, i in zip(group_digits, outer, strict=True))
            members = [
                self.rank_offset + base + sum(d * strides[i] for d, i in zip(m, inner, strict=True))
                for m in _counting([self._sizes[i] for i in inner])
            ]
            groups.append(members)
        return groups

    def __repr__(self) -> str:
        sizes = ", ".join(f"{a}={s}" for a, s in zip(self._axes, self._sizes, strict=True))
        return f"RankGenerator({sizes}, order={self.order!r}, rank_offset={self.rank_offset})"


def _complete_order(order: str, sizes: dict[str, int], anchor: str) -> str:
    """Validate ``order``, inject ``gtp_remat`` after ``anchor`` and append size-1 axes."""
    if not isinstance(order, str):
        raise InputTypeError(f"order={order!r} must be a string such as 'tp-cp-ep-dp-pp'")
    axes = [a for a in order.lower().split("-") if a]
    if not axes:
        raise InputValueError(f"order={order!r} names no axis; use e.g. 'tp-cp-ep-dp-pp'")
    unknown = [a for a in axes if a not in sizes]
    if unknown or len(set(axes)) != len(axes):
        raise InputValueError(
            f"order={order!r}: axes must be distinct names from {list(AXES)} joined by '-'"
        )
    if "gtp_remat" not in axes and anchor in axes:
        axes.insert(axes.index(anchor) + 1, "gtp_remat")
    for name in AXES:
        if name in axes:
            continue
        if sizes[name] != 1:
            raise InputValueError(
                f"order={order!r} does not name axis {name!r} of size {sizes[name]}; "
                "every axis of size > 1 must appear in the order"
            )
        axes.append(name)
    return "-".join(axes)


def _parse_token(token: object, axes: Sequence[str]) -> set[str]:
    if not isinstance(token, str):
        raise InputTypeError(
            f"token={token!r} must be a str of axis names from {list(axes)} joined by '-'"
        )
    names = token.lower().split("-")
    bad = [n for n in names if n not in axes]
    if bad or not token:
        raise InputValueError(
            f"token={token!r}: expected axis names from {list(axes)} joined by '-'"
        )
    return set(names)


def _strides(sizes: Sequence[int]) -> list[int]:
    """Place value of each digit of the mixed-radix rank (first digit fastest)."""
    out, acc = [], 1
    for s in sizes:
        out.append(acc)
        acc *= s
    return out


def _counting(sizes: Sequence[int]) -> list[tuple[int, ...]]:
    """All digit tuples for ``sizes``, counting with the first digit fastest."""
    total = math.prod(sizes)
    strides = _strides(sizes)
    return [
        tuple((n // st) % s for s, st in zip(sizes, strides, strict=True)) for n in range(total)
    ]


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
    world (``world_size`` itself is at most :data:`~mc_groups.rank_generator.MAX_WORLD_SIZE`), and
    the
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
