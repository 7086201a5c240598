"""``ProcessGroupCollection``: the process groups one rank belongs to, passed explicitly;
:func:`is_group_live`: whether one of them still exists.

Every mc function that communicates takes its groups from a collection (or a single group
argument) instead of reading global state. Field names follow Megatron-Core so code
written against ``megatron.core.process_groups_config`` ports by changing the import.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch.distributed as dist
from torch.distributed import distributed_c10d as _c10d

from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["GROUP_FIELDS", "MissingGroupError", "ProcessGroupCollection", "is_group_live"]

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
