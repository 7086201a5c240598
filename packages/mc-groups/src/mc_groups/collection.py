"""``ProcessGroupCollection``: the process groups one rank belongs to, passed explicitly;
:func:`is_group_live`: whether one of them still exists; :func:`check_collection`: an
argument checked to be one; and the optional process default collection with the one
fallback to it (:func:`collection_or_default`).

Every mc function that communicates takes its groups from a collection (or a single group
argument) instead of reading global state. Field names follow Megatron-Core so code
written against ``megatron.core.process_groups_config`` ports by changing the import.

For code ported from Megatron-Core, which reads its groups from ``parallel_state``, one
collection may be registered as the process default (:func:`set_default_collection`, or
``initialize_model_parallel(..., set_default=True)``); nothing in mc requires it. Every mc
function that accepts ``pg_collection=None`` (or a group argument that may be None)
resolves it through :func:`collection_or_default`, so the fallback behaves, and fails, the
same everywhere:

- a ``ProcessGroupCollection``: returned as is (a destroyed one is a ``RuntimeError``);
- ``None``: the registered default, or :class:`NoDefaultCollectionError` (a
  :class:`MissingGroupError`, so a ``ValueError``) saying how to pass groups or register a
  default; with ``required=False`` None is returned instead;
- anything else: ``TypeError``.

Messages share one shape: ``"<what> got no process group and no default
ProcessGroupCollection is registered: pass <explicit>, or register a default with ..."``,
``"<what>: pg_collection=<value> must be a ProcessGroupCollection (...)"`` and
``"<what>: pg_collection was destroyed by destroy_model_parallel() ..."``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal, overload

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from mc_groups.errors import InputTypeError, InputValueError

__all__ = [
    "GROUP_FIELDS",
    "MissingGroupError",
    "NoDefaultCollectionError",
    "ProcessGroupCollection",
    "check_collection",
    "clear_default_collection",
    "collection_or_default",
    "get_default_collection",
    "is_group_live",
    "set_default_collection",
]

GROUP_FIELDS: tuple[str, ...] = (
    "tp",  # tensor parallel
    "pp",  # pipeline parallel
    "mp",  # model parallel = tp × pp
    "embd",  # first and last pipeline stage (tied word embedding)
    "pos_embd",  # first pipeline stage (position embedding)
    "cp",  # context parallel
    "tp_cp",
    "hcp",  # hierarchical context parallel (not built by initialize_model_parallel)
    "ep",  # expert parallel
    "expt_tp",  # expert tensor parallel
    "tp_ep",
    "tp_ep_pp",
    "tp_dp_cp",  # tp × gtp_remat × dp × cp (router token counts; gtp_remat peers: other data)
    "dp",  # data parallel (the replicate axis; excludes gtp_remat)
    "dp_cp",
    "dp_cp_gtp_remat",  # every rank that sees different data: dp × cp × gtp_remat
    "gtp_remat",
    "expt_gtp_remat",
    "expt_dp",
    "expt_dp_gtp_remat",
    "intra_dp_cp",  # dp_cp inside one distributed-optimizer instance
    "intra_expt_dp",
    "inter_dist_opt",  # same shard position across distributed-optimizer instances
    "inter_expt_dp",  # the same for expert params (same intra_expt_dp position)
    "intra_dist_opt",  # every rank of one distributed-optimizer instance
    "world",
)
"""Names a collection may hold; every other name is rejected."""


class MissingGroupError(InputValueError):
    """A function needs a group that its ``ProcessGroupCollection`` does not hold."""


class ProcessGroupCollection:
    """A typed bag of optional process groups.

    ``ProcessGroupCollection(tp=g1, dp=g2)`` sets two fields; every other field in
    :data:`GROUP_FIELDS` reads ``None``. An unknown name raises ``ValueError`` and a value
    that is not a ``torch.distributed.ProcessGroup`` (or ``None``) raises ``TypeError``, on
    construction and on assignment.
    """

    tp: dist.ProcessGroup | None
    pp: dist.ProcessGroup | None
    mp: dist.ProcessGroup | None
    embd: dist.ProcessGroup | None
    pos_embd: dist.ProcessGroup | None
    cp: dist.ProcessGroup | None
    tp_cp: dist.ProcessGroup | None
    hcp: dist.ProcessGroup | None
    ep: dist.ProcessGroup | None
    expt_tp: dist.ProcessGroup | None
    tp_ep: dist.ProcessGroup | None
    tp_ep_pp: dist.ProcessGroup | None
    tp_dp_cp: dist.ProcessGroup | None
    dp: dist.ProcessGroup | None
    dp_cp: dist.ProcessGroup | None
    dp_cp_gtp_remat: dist.ProcessGroup | None
    gtp_remat: dist.ProcessGroup | None
    expt_gtp_remat: dist.ProcessGroup | None
    expt_dp: dist.ProcessGroup | None
    expt_dp_gtp_remat: dist.ProcessGroup | None
    intra_dp_cp: dist.ProcessGroup | None
    intra_expt_dp: dist.ProcessGroup | None
    inter_dist_opt: dist.ProcessGroup | None
    inter_expt_dp: dist.ProcessGroup | None
    intra_dist_opt: dist.ProcessGroup | None
    world: dist.ProcessGroup | None
    _destroyed: bool = False

    def __init__(self, **groups: dist.ProcessGroup | None) -> None:
        unknown = sorted(set(groups) - set(GROUP_FIELDS))
        if unknown:
            raise InputValueError(
                f"ProcessGroupCollection got unknown group name(s) {unknown}; "
                f"known names are {list(GROUP_FIELDS)}"
            )
        for name in GROUP_FIELDS:
            setattr(self, name, groups.get(name))

    def __setattr__(self, name: str, value: object) -> None:
        if name not in GROUP_FIELDS:
            raise InputValueError(
                f"ProcessGroupCollection has no group named {name!r}; "
                f"known names are {list(GROUP_FIELDS)}"
            )
        if value is not None and not isinstance(value, dist.ProcessGroup):
            raise InputTypeError(
                f"ProcessGroupCollection.{name}={value!r} must be a "
                "torch.distributed.ProcessGroup or None"
            )
        object.__setattr__(self, name, value)

    @classmethod
    def adopt(cls, value: object) -> ProcessGroupCollection | None:
        """``value`` itself when it is an mc collection; for another object with group
        attributes (Megatron-Core's ``ProcessGroupCollection``: every declared field reads
        None when unset) a new mc collection holding those of :data:`GROUP_FIELDS` that are
        ``ProcessGroup`` objects; None when ``value`` has none of the names (not a
        collection). Reads attributes only: nothing is created or communicated."""
        if isinstance(value, ProcessGroupCollection):
            return value
        if value is None or isinstance(value, dist.ProcessGroup):
            return None
        if not any(hasattr(value, name) for name in GROUP_FIELDS):
            return None
        found = {name: getattr(value, name, None) for name in GROUP_FIELDS}
        return cls(**{k: v for k, v in found.items() if isinstance(v, dist.ProcessGroup)})

    @property
    def destroyed(self) -> bool:
        """True once :func:`~mc_groups.destroy_model_parallel` destroyed this collection."""
        return self._destroyed

    def _mark_destroyed(self) -> None:
        object.__setattr__(self, "_destroyed", True)

    def require(self, name: str, needed_for: str) -> dist.ProcessGroup:
        """Return group ``name``, or raise :class:`MissingGroupError` naming the caller's need.

        Call it before issuing any collective so a missing group fails fast on every rank.
        A destroyed collection is a ``RuntimeError``.
        """
        if not isinstance(name, str):
            raise InputTypeError(f"name={name!r} must be a str: a ProcessGroupCollection field")
        if not isinstance(needed_for, str):
            raise InputTypeError(
                f"needed_for={needed_for!r} must be a str saying what needs the group"
            )
        if name not in GROUP_FIELDS:
            raise InputValueError(f"name={name!r} is not a ProcessGroupCollection field")
        if self._destroyed:
            raise RuntimeError(
                f"{needed_for} needs pg_collection.{name}, but this ProcessGroupCollection was "
                "destroyed by destroy_model_parallel(); build a new one with "
                "initialize_model_parallel()"
            )
        group: dist.ProcessGroup | None = getattr(self, name)
        if group is None:
            raise MissingGroupError(
                f"{needed_for} needs pg_collection.{name}, but this ProcessGroupCollection "
                f"does not hold it ({self!r}); build the collection with "
                f"initialize_model_parallel() or pass {name}=<ProcessGroup>"
            )
        return group

    def items(self) -> Iterator[tuple[str, dist.ProcessGroup]]:
        """The set fields as ``(name, group)`` pairs, in :data:`GROUP_FIELDS` order."""
        for name in GROUP_FIELDS:
            group = getattr(self, name)
            if group is not None:
                yield name, group

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in GROUP_FIELDS and getattr(self, name) is not None

    def __repr__(self) -> str:
        parts = [f"{name}({group.size()})" for name, group in self.items()]
        destroyed = ", destroyed" if self._destroyed else ""
        return f"ProcessGroupCollection({', '.join(parts) or 'empty'}{destroyed})"


def is_group_live(group: dist.ProcessGroup) -> bool:
    """False once ``group`` was destroyed (:func:`~mc_groups.destroy_model_parallel`,
    ``torch.distributed.destroy_process_group``) or when ``torch.distributed`` is not
    initialised: a dictionary lookup in torch's group registry, no communication."""
    # torch's map of live process groups (``_world.pg_map``: every group leaves it when
    # destroyed), read per call: it is replaced when torch.distributed is re-initialised.
    try:
        return group in _c10d._world.pg_map
    except AttributeError:  # torch without the registry attribute: its public lookup
        pass
    try:
        dist.get_backend(group)
    except (ValueError, RuntimeError):
        return False
    return True


def check_collection(name: str, value: object, *, what: str = "") -> ProcessGroupCollection:
    """``value`` as a :class:`~mc_groups.ProcessGroupCollection` that
    ``destroy_model_parallel()`` has not destroyed (``TypeError`` / ``RuntimeError``).

    Another library's collection (Megatron-Core's ``ProcessGroupCollection``, kept by a user
    who keeps Megatron's ``parallel_state`` or model code) is accepted by what it has: its
    attributes named in :data:`~mc_groups.collection.GROUP_FIELDS` that hold a ``ProcessGroup`` are
    copied into a new mc collection (:meth:`ProcessGroupCollection.adopt`; other values,
    e.g. Megatron's list of ``hcp`` groups, are left out).
    """
    caller = f"{what}: " if what else ""
    collection = ProcessGroupCollection.adopt(value)
    if collection is None:
        kind = type(value)  # with its module (builtins bare), as argcheck.type_name names it
        got = f"{kind.__module__}.".removeprefix("builtins.") + kind.__qualname__
        raise InputTypeError(
            f"{caller}{name}={value!r} must be a ProcessGroupCollection (e.g. from "
            "initialize_model_parallel()) or an object with its group attributes (tp, dp, "
            f"dp_cp, ...), such as Megatron-Core's; got {got}"
        )
    if collection.destroyed:
        raise RuntimeError(
            f"{caller}{name} was destroyed by destroy_model_parallel(); its groups can no "
            "longer communicate: build a new collection with initialize_model_parallel() and "
            "new objects on it"
        )
    return collection


# ---------------------------------------------------------------- the optional default collection

_PASS_COLLECTION = "pg_collection=initialize_model_parallel(...)"


class NoDefaultCollectionError(MissingGroupError):
    """A caller passed no groups and no default collection is registered."""


class _DefaultSlot:
    """Holds the optional process default collection (the one permitted global)."""

    collection: ProcessGroupCollection | None = None


def set_default_collection(collection: ProcessGroupCollection) -> None:
    """Register ``collection`` for callers that pass ``pg_collection=None``."""
    _DefaultSlot.collection = check_collection(
        "collection", collection, what="set_default_collection()"
    )


def get_default_collection() -> ProcessGroupCollection | None:
    """The registered default collection, or ``None`` when none was registered."""
    return _DefaultSlot.collection


def clear_default_collection() -> None:
    """Forget the registered default collection."""
    _DefaultSlot.collection = None


@overload
def collection_or_default(
    pg_collection: object,
    what: str,
    *,
    explicit: str = ...,
    required: Literal[True] = ...,
) -> ProcessGroupCollection: ...


@overload
def collection_or_default(
    pg_collection: object,
    what: str,
    *,
    explicit: str = ...,
    required: bool,
) -> ProcessGroupCollection | None: ...


def collection_or_default(
    pg_collection: object,
    what: str,
    *,
    explicit: str = _PASS_COLLECTION,
    required: bool = True,
) -> ProcessGroupCollection | None:
    """``pg_collection``, or the registered default when it is None.

    Args:
        pg_collection: the caller's argument: a ``ProcessGroupCollection`` (mc's, or another
            library's such as Megatron-Core's, adopted by its group attributes) or None.
        what: the caller, as its errors name it (``"DistributedDataParallel"``).
        explicit: how the caller's user passes groups explicitly, for the error without a
            default (``"tp_group=<ProcessGroup> or pg_collection=<ProcessGroupCollection>"``,
            ``"pp_group=pg_collection.pp"``).
        required: with False, None and no default registered returns None (callers that
            fall back further, e.g. to rank 0 of a single process).

    Raises:
        TypeError: ``pg_collection`` is neither None nor a collection.
        RuntimeError: the collection was destroyed by ``destroy_model_parallel()``.
        NoDefaultCollectionError: None, no default registered, and ``required``.
    """
    collection = _DefaultSlot.collection if pg_collection is None else pg_collection
    if collection is None:
        if not required:
            return None
        raise NoDefaultCollectionError(
            f"{what} got no process group and no default ProcessGroupCollection is "
            f"registered: pass {explicit}, or register a default with "
            "initialize_model_parallel(..., set_default=True) or "
            "mc_groups.collection.set_default_collection(collection)"
        )
    return check_collection("pg_collection", collection, what=what)
