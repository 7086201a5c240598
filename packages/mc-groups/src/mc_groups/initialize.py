"""``initialize_model_parallel``: build every process group of a layout once.

The layout (Megatron-Core's; its sizes and rank lists are computed in
:mod:`mc_groups.rank_generator`): a dense and an expert rank generator that share ``pp`` and the
``order`` string; the dense one has ``ep = 1``, the expert one ``cp = 1``. All sizes are
validated before any group is created, so a bad layout fails with a ``ValueError`` on
every rank instead of a hang inside ``new_group``. Then the ranks compare their layouts in
one all-gather of ten int64 per rank over the world (the sizes and a digest of ``order``):
ranks that pass different layouts would otherwise create different groups (a hang inside
``new_group``, or groups that silently mix the wrong ranks), so every rank raises the same
``ValueError`` naming the fields and the ranks that differ.

Every rank calls ``torch.distributed.new_group`` for every distinct rank list, in the same
order (a collective requirement of ``new_group``); a rank list needed by several roles
(e.g. ``tp`` and ``mp`` when ``pp = 1``) becomes one process group.
"""

from __future__ import annotations

import hashlib
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from mc_groups.argcheck import check_flag
from mc_groups.collection import (
    ProcessGroupCollection,
    clear_default_collection,
    get_default_collection,
    is_group_live,
    set_default_collection,
)
from mc_groups.comm.collectives import all_gather, all_gather_objects, barrier
from mc_groups.comm.cross_rank import fail_together, key_device
from mc_groups.errors import InputTypeError, InputValueError
from mc_groups.rank_generator import ParallelSizes, _role_rank_lists, validate_sizes

__all__ = [
    "DistributedNotInitializedError",
    "destroy_model_parallel",
    "initialize_model_parallel",
]


class DistributedNotInitializedError(RuntimeError, InputValueError):
    """``torch.distributed`` has no default process group yet."""


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
    naming the fields and ranks that differ. A rank whose own arguments are invalid raises
    its error after one status exchange over the world (:func:`mc_groups.fail_together`),
    in which its peers learn it and raise :class:`mc_groups.PeerCheckError` naming it.
    ``timeout`` bounds every collective on the
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
    with fail_together(None, "initialize_model_parallel"):  # a bad rank stops every rank
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
        raise InputTypeError(
            f"timeout={timeout!r} must be a datetime.timedelta (e.g. timedelta(minutes=5)) or "
            "None (the default group's timeout)"
        )
    if timeout <= timedelta(0):
        raise InputValueError(f"timeout={timeout!r} must be positive")
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
    raise InputValueError(
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
    on its groups raises a ``RuntimeError`` naming the destroyed group. DTensor's cached
    device meshes of these groups are forgotten (a DTensor built on groups made afterwards
    gets their mesh).
    """
    if not isinstance(collection, ProcessGroupCollection):
        raise InputTypeError(
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
    _forget_dtensor_meshes()


def _forget_dtensor_meshes() -> None:
    """Empty DTensor's sharding-propagation cache once DTensor is loaded: torch 2.13 caches
    output specs by device-mesh layout, so after these groups are destroyed and built again
    in this process a new DTensor (an FSDP2 param) would get a cached mesh of the destroyed
    groups ("Could not resolve the process group registered under the name N")."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache  # noqa: PLC0415

    _clear_sharding_prop_cache()  # type: ignore[no-untyped-call]
