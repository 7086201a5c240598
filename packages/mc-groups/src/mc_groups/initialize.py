"""``initialize_model_parallel``: build every process group of a layout once.

The layout (Megatron-Core's)::

    world = tp · gtp_remat · cp · dp · pp                    (dense generator)
          = etp · egtp_remat · ep · edp · pp                 (expert generator)

Both generators share ``pp`` and the ``order`` string; the dense one has ``ep = 1``, the
expert one ``cp = 1``. All sizes are validated before any group is created, so a bad layout
fails with a ``ValueError`` on every rank instead of a hang inside ``new_group``. Then the
ranks compare their layouts in one all-gather of ten int64 per rank over the world (the
sizes and a digest of ``order``): ranks that pass different layouts would otherwise create
different groups (a hang inside ``new_group``, or groups that silently mix the wrong ranks),
so every rank raises the same ``ValueError`` naming the fields and the ranks that differ.

Every rank calls ``torch.distributed.new_group`` for every distinct rank list, in the same
order (a collective requirement of ``new_group``); a rank list needed by several roles
(e.g. ``tp`` and ``mp`` when ``pp = 1``) becomes one process group.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from mc_groups._core import key_device
from mc_groups.argcheck import check_flag, check_int, check_optional_int
from mc_groups.collection import ProcessGroupCollection, is_group_live
from mc_groups.collectives import all_gather, all_gather_objects, barrier
from mc_groups.default_collection import (
    clear_default_collection,
    get_default_collection,
    set_default_collection,
)
from mc_groups.rank_generator import MAX_WORLD_SIZE, RankGenerator

__all__ = [
    "DistributedNotInitializedError",
    "ParallelSizes",
    "destroy_model_parallel",
    "initialize_model_parallel",
    "validate_sizes",
]


class DistributedNotInitializedError(RuntimeError, ValueError):
    """``torch.distributed`` has no default process group yet."""


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
        raise ValueError(
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
        raise ValueError(
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
        raise ValueError(
            f"num_distributed_optimizer_instances={inst} must divide the data-parallel × "
            f"context-parallel size {dp} × {cp} = {dp * cp}"
        )
    if inst > 1 and (gtp > 1 or egtp > 1):
        raise ValueError(
            f"gtp_remat_size={gtp} / expert_gtp_remat_size={egtp} cannot be combined with "
            f"num_distributed_optimizer_instances={inst} > 1; use one instance with gtp_remat"
        )
    return ParallelSizes(world, tp, pp, vpp, cp, ep, etp, gtp, egtp, dp, edp, inst)


def _within_world(world: int, **sizes: int) -> None:
    for name, size in sizes.items():
        if size > world:
            raise ValueError(
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


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: int | None = None,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    expert_tensor_parallel_size: int | None = None,
    gtp_remat_size: int = 1,
    expert_gtp_remat_size: int = 1,
    num_distributed_optimizer_instances: int = 1,
    order: str = "tp-cp-ep-dp-pp",
    timeout: timedelta | None = None,
    *,
    set_default: bool = False,
) -> ProcessGroupCollection:
    """Create every process group of the layout and return this rank's collection.

    Must be called by every rank with the same arguments (group creation is collective).
    Sizes are validated before any group exists; then the ranks compare their layouts (one
    all-gather of ten int64 over the world) and every rank raises the same ``ValueError``
    naming the fields and ranks that differ (a rank whose own arguments are invalid raises
    at once, before any collective; its peers then wait in that all-gather until the world
    group's timeout and raise ``CollectiveError``). ``timeout`` bounds every collective on the
    new groups (default: the default group's timeout, set by ``init_process_group``; torch
    itself would give new groups 30 minutes). With ``set_default=True`` the
    collection is also registered as the process default (see
    :func:`get_default_collection`); nothing in mc requires that.

    Returns a collection holding: tp, pp, mp (tp·gtp_remat·pp), embd (first and last
    pipeline rank; ``None`` on middle stages), pos_embd (first pipeline rank; ``None``
    elsewhere), cp, tp_cp, tp_dp_cp, dp, dp_cp, dp_cp_gtp_remat, gtp_remat, ep, expt_tp,
    tp_ep, tp_ep_pp, expt_gtp_remat, expt_dp, expt_dp_gtp_remat, intra_dp_cp,
    intra_expt_dp, inter_dist_opt and inter_expt_dp (only with several optimizer instances),
    intra_dist_opt, world.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise DistributedNotInitializedError(
            "initialize_model_parallel needs torch.distributed to be initialised first: call "
            "torch.distributed.init_process_group(backend='gloo' or 'nccl', ...) (torchrun "
            "sets the environment for init_method='env://'), or use mc_groups.testing.RankPool"
        )
    sizes = validate_sizes(
        dist.get_world_size(),
        tensor_model_parallel_size,
        pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size,
        context_parallel_size,
        expert_model_parallel_size,
        expert_tensor_parallel_size,
        gtp_remat_size,
        expert_gtp_remat_size,
        num_distributed_optimizer_instances,
    )
    roles = _role_rank_lists(sizes, order)  # checks order: pure arithmetic
    group_timeout = _check_timeout(timeout)
    check_flag("set_default", set_default)
    _agree_on_layout(sizes, order)
    groups = _create_groups(roles, _default_group_timeout() if timeout is None else group_timeout)
    me = dist.get_rank()
    mine: dict[str, dist.ProcessGroup | None] = {}
    for role, lists in roles.items():
        member = next((tuple(r) for r in lists if me in r), None)
        mine[role] = None if member is None else groups[member]
    collection = ProcessGroupCollection(**mine)
    _world_barrier("initialize_model_parallel")
    if set_default:
        set_default_collection(collection)
    return collection


def _check_timeout(timeout: object) -> timedelta | None:
    if timeout is None:
        return None
    if not isinstance(timeout, timedelta):
        raise TypeError(
            f"timeout={timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=5)) or "
            "None (the default group's timeout)"
        )
    if timeout <= timedelta(0):
        raise ValueError(f"timeout={timeout!r} must be positive")
    return timeout


_LAYOUT_FIELDS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "gtp_remat_size",
    "expert_gtp_remat_size",
    "num_distributed_optimizer_instances",
    "order",
)


def _layout_row(sizes: ParallelSizes, order: str) -> list[int]:
    """This rank's layout as ten int64: the sizes (virtual pipeline None as 0, the expert
    tensor-parallel size resolved) and a 63-bit digest of ``order``."""
    digest = int.from_bytes(hashlib.blake2b(order.encode(), digest_size=8).digest(), "little")
    return [
        sizes.tp,
        sizes.pp,
        sizes.vpp or 0,
        sizes.cp,
        sizes.ep,
        sizes.etp,
        sizes.gtp_remat,
        sizes.expert_gtp_remat,
        sizes.dist_opt_instances,
        digest >> 1,
    ]


def _agree_on_layout(sizes: ParallelSizes, order: str) -> None:
    """Every rank raises the same ``ValueError`` when the ranks' layouts differ.

    One all-gather of ten int64 per rank over the world (nothing on a world of one rank);
    only when they differ, an all-gather of the ``order`` strings to show them. Group
    creation is collective: ranks with different layouts would call ``new_group`` with
    different rank lists (a hang until the timeout, or groups that mix the wrong ranks).
    """
    world = dist.group.WORLD
    if world is None or dist.get_world_size() == 1:
        return
    device = key_device(world, None)
    row = torch.tensor(_layout_row(sizes, order), dtype=torch.int64, device=device)
    table = torch.empty(dist.get_world_size() * row.numel(), dtype=torch.int64, device=device)
    all_gather(table, row, world, label="initialize_model_parallel layout")
    rows = [[int(v) for v in r] for r in table.view(-1, row.numel()).tolist()]
    differing = [i for i in range(row.numel()) if len({r[i] for r in rows}) > 1]
    if not differing:
        return
    orders = all_gather_objects(order, world, label="initialize_model_parallel layout")
    parts = []
    for i in differing:
        values: dict[object, list[int]] = {}
        for rank, r in enumerate(rows):
            shown: object = orders[rank] if _LAYOUT_FIELDS[i] == "order" else r[i]
            values.setdefault(shown, []).append(rank)
        listed = "; ".join(f"rank(s) {ranks}: {value!r}" for value, ranks in values.items())
        parts.append(f"{_LAYOUT_FIELDS[i]} ({listed})")
    raise ValueError(
        "initialize_model_parallel: the ranks passed different layouts: "
        + ", ".join(parts)
        + ". Every rank must pass the same sizes and order (group creation is collective); "
        "no group was created"
    )


def _default_group_timeout() -> timedelta | None:
    """The default group's timeout, for groups created without one.

    torch's ``new_group(timeout=None)`` does not inherit it: it falls back to the backend's
    default (30 minutes for gloo and NCCL on torch 2.13), so a peer that hangs
    inside a tensor-parallel or data-parallel collective would hold its survivors for
    30 minutes whatever ``init_process_group(timeout=...)`` said. ``None`` when torch does
    not expose it (then torch's default applies).
    """
    world = dist.group.WORLD
    if world is None:
        return None
    for device in ("cpu", "cuda"):
        try:
            backend = world._get_backend(torch.device(device))
        except (RuntimeError, AttributeError):
            continue
        found = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(found, timedelta):
            return found
    return None


def _create_groups(
    roles: dict[str, list[list[int]]], timeout: timedelta | None
) -> dict[tuple[int, ...], dist.ProcessGroup]:
    """One ``new_group`` per distinct rank list, in the same order on every rank."""
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    world = dist.group.WORLD
    for role, lists in roles.items():
        for ranks in lists:
            key = tuple(ranks)
            if key in groups:
                continue
            if role == "world" and world is not None:
                groups[key] = world
                continue
            # Non-members receive a placeholder from new_group and never look it up.
            groups[key] = dist.new_group(list(key), timeout=timeout, group_desc=role)
    return groups


def _world_barrier(label: str) -> None:
    """Every rank reaches this point before any goes on.

    Gloo finishes ``connectFullMesh`` on one rank before its peers have read the last
    handshake; a fast rank that then destroys (or reuses sockets of) a fresh group made a
    slow peer fail with "Connection closed by peer" (intermittently, on loaded machines).
    Synchronising after creation and before destruction removes the race.
    """
    world = dist.group.WORLD
    if world is not None:
        barrier(world, label=label)


def destroy_model_parallel(collection: ProcessGroupCollection) -> None:
    """Destroy the groups of ``collection`` (each once) and unregister it as default.

    Collective: every rank calls it (a world barrier first lets peers finish using the
    groups). Checked first, before the barrier: ``collection`` must be a
    ``ProcessGroupCollection`` not destroyed yet whose groups are all alive (a second call,
    ``None`` or a dict is an error on the calling rank, not a failure after its peers
    entered the barrier). The world group is never destroyed. Afterwards the collection is
    marked destroyed: :meth:`ProcessGroupCollection.require` refuses it and every collective
    on its groups raises a ``RuntimeError`` naming the destroyed group.
    """
    if not isinstance(collection, ProcessGroupCollection):
        raise TypeError(
            f"collection={collection!r} must be the ProcessGroupCollection that "
            "initialize_model_parallel() returned"
        )
    if collection.destroyed:
        raise RuntimeError(
            "destroy_model_parallel(): this ProcessGroupCollection was already destroyed; "
            "call it once per initialize_model_parallel()"
        )
    world = dist.group.WORLD
    dead = [n for n, g in collection.items() if g is not world and not is_group_live(g)]
    if dead:
        raise RuntimeError(
            f"destroy_model_parallel(): the collection's group(s) {dead} were already "
            "destroyed (by another collection holding them, or "
            "torch.distributed.destroy_process_group()); nothing was destroyed"
        )
    _world_barrier("destroy_model_parallel")
    seen: set[int] = set()
    for _, group in collection.items():
        if id(group) in seen or group is world:
            continue
        seen.add(id(group))
        dist.destroy_process_group(group)
    collection._mark_destroyed()
    if get_default_collection() is collection:
        clear_default_collection()
