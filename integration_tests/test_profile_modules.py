"""``scripts/profile_modules.py``: its line classifier and its module tracer, against hand
counts, and the 2-rank routes it measures held to issue 38's targets (a route that grew
went unnoticed once: finalize's reached 7 modules when the FSDP2 check moved to
``mc_groups.dtensors``)."""

from __future__ import annotations

import textwrap

import torch

from integration_tests._scripts import load_script
from mc_groups.testing import RankPools
from mc_tp_layers.utils import divide

profile = load_script("profile_modules")

SOURCE = textwrap.dedent(
    '''\
    """Module docstring,
    two lines."""

    import os  # a trailing comment: a code line

    # a comment line


    def f(x: int) -> int:
        """One-line docstring."""
        text = """not a docstring:
        an assigned string is code"""
        return x + len(text)
    '''
)


def test_doc_lines_by_hand() -> None:
    """Lines 1-2 (module docstring), 6 (comment) and 10 (function docstring) are doc
    lines; the assigned triple-quoted string (11-12) and the line with a trailing comment
    (4) are code."""
    assert profile._doc_lines(SOURCE) == {1, 2, 6, 10}


def test_tracer_names_mc_modules_only() -> None:
    """A function of ``mc_tp_layers/utils.py`` counts as that module; torch's do not."""
    tracer = profile._Tracer(profile._roots())
    with tracer.active():
        divide(6, 3)
        torch.nn.functional.relu(torch.ones(1))
    assert "mc_tp_layers/utils.py" in tracer.modules
    assert all(module.split("/")[0].startswith("mc_") for module in tracer.modules)


def _routes() -> dict[str, list[str]]:
    return dict(profile._measure(list(profile.PARTS)))


def test_every_step_part_stays_within_its_module_target(rank_pools: RankPools) -> None:
    """The mc modules each step part runs through on rank 0 of 2 (Column → Row MLP, DDP's
    backward, ``finalize_model_grads`` on a DDP chunk, ``ShardedOptimizer.step``) are at
    most issue 38's targets (7 / 8 / 6 / 10) and never touch a check module meant for the
    boundary only (``argcheck``)."""
    found = rank_pools.get(2).run(_routes)[0]
    counts = {part: len(found[part]) for part in profile.PARTS}
    assert all(counts[part] <= target for part, target in profile.TARGETS.items()), (
        counts,
        found,
    )
    assert not any("argcheck" in m for modules in found.values() for m in modules), found
