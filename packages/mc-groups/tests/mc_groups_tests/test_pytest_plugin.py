"""The pytest plugin registered by mc-groups does not import torch when pytest starts.

Users install mc-groups into environments whose other test suites never ask for
``rank_pools``: the entry point (:mod:`mc_groups_pytest`) must cost them nothing. Checked
in a fresh interpreter running pytest on a throw-away test file outside the repository,
with plugin autoloading on (the entry point loads); the fixture itself still works (it is
used by every multi-process test of this repository).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_plugin_entry_point_leaves_torch_unimported(tmp_path: Path) -> None:
    (tmp_path / "test_probe.py").write_text(
        "import sys\n\n\n"
        "def test_probe(pytestconfig):\n"
        "    assert pytestconfig.pluginmanager.has_plugin('mc_groups')\n"
        "    assert 'torch' not in sys.modules\n"
        "    assert 'mc_groups' not in sys.modules\n",
        encoding="utf-8",
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_DISABLE_PLUGIN_AUTOLOAD"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
