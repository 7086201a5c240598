"""``scripts/profile_modules.py``: its line classifier and its module tracer, against hand
counts (the 2-rank profile itself is a measurement, run by hand: issue 38)."""

from __future__ import annotations

import textwrap

import torch

from integration_tests._scripts import load_script
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
