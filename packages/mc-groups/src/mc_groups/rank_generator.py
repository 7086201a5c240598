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
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from mc_groups.argcheck import check_flag, check_int
from mc_groups.errors import InputTypeError, InputValueError

__all__ = ["AXES", "MAX_WORLD_SIZE", "RankGenerator"]

AXES: tuple[str, ...] = ("tp", "gtp_remat", "cp", "ep", "dp", "pp")
"""Axis names an ``order`` string may contain."""

MAX_WORLD_SIZE = 2**20
"""The most ranks a layout may have (about ten times the largest clusters): a generator
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
