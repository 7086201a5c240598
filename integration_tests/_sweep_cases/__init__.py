"""The bad inputs and misuse sequences of the sweep (``scripts/sweep_bad_inputs.py``) and of
the fuzz test (``integration_tests/test_fuzz_bad_inputs.py``).

A :class:`Slot` is one place a bad value can go: an argument of a public function or
method (``mc_groups.all_reduce(async_op=)``), or a misuse sequence (``finalize twice in
one iteration``). Its ``kind`` names the family of bad values that fits there (``flag``:
non-bool values for a bool; ``size``: ints < 1, floats, bools, strings for a size; ...):
the sweep takes every value of :data:`KINDS` for the kind (plus the slot's own ``values``),
the fuzz test draws values of the same kind with hypothesis. A slot's ``names`` are the
words a clear error must contain (the argument's name, or words naming the misuse).

Everything runs in a worker process (see :mod:`integration_tests._sweep_runner`) that has
joined a gloo world of one rank (two for the slots with ``world=2``, where the ranks
disagree). The callables get a :class:`Ctx` (the worker's world, a default
``ProcessGroupCollection``, small models) and the value; values that must be built in the
worker are :class:`Ref` s. Each slot may name a ``good`` value: the same call with it must
succeed (``scripts/sweep_bad_inputs.py --controls``), which proves a case fails for its
bad value and not for a broken call around it.

Calls go through ``Any``-typed module handles: wrong types are the point.

The slots live in one module per package (``groups_collectives``, ``groups_setup``,
``finalize``, ``buffers``, ``ddp``, ``ddp_optimizer``, ``tp_layers``, ``tp_functions``, ``moe``) and
``two_ranks``; the building blocks (kinds, :class:`Slot`, :class:`Case`, :class:`Ctx`, small
models, the registry) in ``base``. They register here, in one fixed order: the case list and
its ids (which the fuzz test draws from and the docs count) do not depend on import order.
"""

from __future__ import annotations

from integration_tests._sweep_cases.base import (
    GOOD,
    KINDS,
    SLOTS,
    Case,
    Ctx,
    Opaque,
    Ref,
    Slot,
    show,
)
from integration_tests._sweep_cases.buffers import _buffer_slots
from integration_tests._sweep_cases.ddp import _ddp_config_slots, _ddp_slots
from integration_tests._sweep_cases.ddp_optimizer import _fsdp2_slots, _optimizer_slots
from integration_tests._sweep_cases.finalize import _finalize_slots, _step_slots
from integration_tests._sweep_cases.groups_collectives import (
    _collective_slots,
    _other_collective_slots,
)
from integration_tests._sweep_cases.groups_setup import (
    _argcheck_slots,
    _config_slots,
    _device_slots,
    _generator_slots,
    _harness_slots,
    _layout_slots,
    _pipeline_slots,
)
from integration_tests._sweep_cases.moe import _moe_slots
from integration_tests._sweep_cases.tp_functions import _function_slots, _rng_slots
from integration_tests._sweep_cases.tp_layers import _layer_slots
from integration_tests._sweep_cases.two_ranks import _two_rank_slots

__all__ = [
    "GOOD",
    "KINDS",
    "SLOTS",
    "SLOT_BY_KEY",
    "Case",
    "Ctx",
    "Opaque",
    "Ref",
    "Slot",
    "all_cases",
    "case_by_id",
    "case_for",
    "control_cases",
    "show",
]

for _register in (
    _collective_slots,
    _other_collective_slots,
    _layout_slots,
    _generator_slots,
    _config_slots,
    _pipeline_slots,
    _device_slots,
    _harness_slots,
    _argcheck_slots,
    _finalize_slots,
    _step_slots,
    _buffer_slots,
    _ddp_config_slots,
    _ddp_slots,
    _optimizer_slots,
    _fsdp2_slots,
    _layer_slots,
    _function_slots,
    _rng_slots,
    _two_rank_slots,
    _moe_slots,
):
    _register()

SLOT_BY_KEY: dict[str, Slot] = {s.key: s for s in SLOTS}
if len(SLOT_BY_KEY) != len(SLOTS):  # a key names one slot (the fuzz test sends keys)
    raise RuntimeError(f"duplicate slot keys: {len(SLOTS) - len(SLOT_BY_KEY)}")


def all_cases() -> list[Case]:
    """Every case of the sweep, in a stable order."""
    cases = []
    for slot in SLOTS:
        for value in slot.sweep_values():
            cid = (
                slot.key
                if slot.kind == "misuse" and value is None and not slot.values
                else (f"{slot.key} <- {show(value)}")
            )
            cases.append(Case(cid, slot.package, slot, value))
    return cases


_BY_ID: dict[str, Case] = {}


def case_by_id(case_id: str) -> Case:
    """The case named ``case_id`` (ids are unique)."""
    if not _BY_ID:
        every = [*all_cases(), *control_cases()]
        _BY_ID.update({c.id: c for c in every})
        if len(_BY_ID) != len(every):
            raise RuntimeError(f"duplicate case ids: {len(every) - len(_BY_ID)}")
    return _BY_ID[case_id]


def case_for(slot_key: str, value: object) -> Case:
    """A case for a drawn value (the fuzz test)."""
    slot = SLOT_BY_KEY[slot_key]
    return Case(f"{slot_key} <- {show(value)}", slot.package, slot, value)


def control_cases() -> list[Case]:
    """Each slot with its good value: must succeed (checks the sweep itself)."""
    return [
        Case(f"{s.key} <- (good) {show(s.good)}", s.package, s, s.good)
        for s in SLOTS
        if s.has_good and s.world == 1
    ]
