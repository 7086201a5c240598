"""Importing mc's packages leaves DCP and DTensor unimported (one fresh interpreter).

``torch.distributed.checkpoint`` and ``torch.distributed.tensor`` take over a second to
import; mc imports them where they are used (checkpoints, DTensor grads, and
``torch.distributed.pipelining``, which imports DTensor, when a pipeline is built), so a user who
imports mc_ddp, mc_tp_layers, mc_finalize or mc_train does not pay for them up front. Localizes a
module-level import that brings them back. Exact: the modules are in ``sys.modules`` or
not.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from integration_tests import _prefetch

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor")
PACKAGES = (
    "mc_groups",
    "mc_buffers",
    "mc_ddp",
    "mc_tp_layers",
    "mc_finalize",
    "mc_moe",
    "mc_train",
)


def _fresh_interpreter(_folder: Path) -> subprocess.CompletedProcess[str]:
    """The modules of ``HEAVY`` that importing every package brought in, printed as JSON."""
    probe = (
        "import importlib, json, sys\n"
        f"for name in {PACKAGES!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))\n"
    )
    return subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )


# Started in the background when the session has collected this module (a fresh
# interpreter importing torch): integration_tests/_prefetch.py.
PREFETCH = {"fresh interpreter": _fresh_interpreter}


def test_importing_the_packages_leaves_dcp_and_dtensor_unimported(
    request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _, done = _prefetch.take(request, "fresh interpreter", tmp_path)
    assert json.loads(done.stdout.splitlines()[-1]) == []
