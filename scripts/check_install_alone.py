"""Prove each package installs alone: only torch plus the siblings it declares.

For every package under ``packages/``: in one fresh virtual environment that holds only
torch (pinned to the test version) and hatchling, ``pip install`` the package together with
the closure of the mc siblings it *declares*, import it from outside the repository, check
every name in its ``__all__`` resolves and that no undeclared mc package was installed,
then uninstall the mc packages before the next one. Exits non-zero on the first failure.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
TORCH = "torch==2.13.0"


def _declared_mc_deps(package: str) -> list[str]:
    meta = tomllib.loads((PACKAGES / package / "pyproject.toml").read_text())["project"]
    names = [d.split(">")[0].split("=")[0].split("<")[0].strip() for d in meta["dependencies"]]
    return [n for n in names if n.startswith("mc-")]


def _closure(package: str) -> list[str]:
    seen: list[str] = []
    todo = [package]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.append(name)
            todo.extend(_declared_mc_deps(name))
    return sorted(seen)


def _run(*cmd: str, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"FAILED: {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _installed_mc(python: str) -> list[str]:
    listed = json.loads(_run(python, "-m", "pip", "list", "--format", "json"))
    return sorted(p["name"] for p in listed if p["name"].startswith("mc-"))


def _check(python: str, package: str, workdir: Path) -> None:
    closure = _closure(package)
    _run(
        python,
        "-m",
        "pip",
        "install",
        "-q",
        "--no-build-isolation",
        *[str(PACKAGES / n) for n in closure],
    )
    installed = _installed_mc(python)
    if installed != closure:
        raise SystemExit(f"{package}: installed {installed}, declared closure {closure}")
    module = package.replace("-", "_")
    probe = (
        f"import {module} as m, torch; "
        f"assert all(hasattr(m, n) for n in m.__all__), 'missing public names'; "
        f"assert torch.__version__.startswith('2.13.0'), torch.__version__; "
        f"assert 'site-packages' in m.__file__, m.__file__; print(len(m.__all__))"
    )
    count = _run(python, "-c", probe, cwd=workdir).strip()
    siblings = [n for n in closure if n != package] or "no siblings"
    print(f"  {package:<14} with {siblings} + torch: import ok, {count} public names")
    _run(python, "-m", "pip", "uninstall", "-y", "-q", *closure)


def main() -> None:
    started = time.monotonic()
    packages = sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists())
    with tempfile.TemporaryDirectory(prefix="mc-install-") as tmp:
        venv = Path(tmp) / "venv"
        _run(sys.executable, "-m", "venv", str(venv))
        python = str(venv / "bin" / "python")
        _run(python, "-m", "pip", "install", "-q", TORCH, "numpy", "hatchling")
        print(f"install check: fresh venv with {TORCH} in {time.monotonic() - started:.0f} s")
        for package in packages:
            _check(python, package, Path(tmp))
    print(
        f"install check passed for {len(packages)} packages in {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
