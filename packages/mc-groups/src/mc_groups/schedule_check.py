"""Deprecated alias of :mod:`mc_groups.comm.schedule_check`, where issue 31 moved it with the
rest of the collective layer (:mod:`mc_groups.comm`). It re-exports that module's public
names for one release and will then be removed: import them from :mod:`mc_groups` or
:mod:`mc_groups.comm.schedule_check`."""

from __future__ import annotations

from mc_groups.comm.schedule_check import (
    SCHEDULE_CHECK_ENV,
    CollectiveScheduleError,
    PlannedCollective,
    RankPlan,
    ScheduleVariant,
    check_collective_schedule,
    exchange_plans,
    schedule_check_enabled,
    verify_schedule,
)

__all__ = [
    "SCHEDULE_CHECK_ENV",
    "CollectiveScheduleError",
    "PlannedCollective",
    "RankPlan",
    "ScheduleVariant",
    "check_collective_schedule",
    "exchange_plans",
    "schedule_check_enabled",
    "verify_schedule",
]
