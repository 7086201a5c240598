"""Every command the README and the guides show is one the project can run (no processes).

Localizes drift between the documentation and the command lines it prints: each line of a
```bash block in README.md and docs/*.md is read as the shell would (continuations joined,
``&&`` split, comments and variable assignments dropped) and checked against what runs it
— a ``hatch run NAME`` names a script of hatch.toml or a program of the environment; the
demo's flags go through the trainer's own parser and ``plan`` for the world size the line
starts (torchrun's ``--nnodes`` × ``--nproc-per-node``, or ``MC_DEMO_NPROC``), and
``examples.hf_3d``'s through its ``parse_args`` for that world size; the dry
run's through its parser and ``spec_from_args``; a script path exists. A command of a kind
this file does not know fails, so a new kind of documented command gets a check here.
Running them end to end is the job of the tests each guide names (test_demo*.py,
test_dry_run.py, test_gpu_check.py, test_quickstart.py). The README's test command is also
read the way ``.ci/run`` reads it.
"""

from __future__ import annotations

import importlib
import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from examples import hf_3d, train_gpt
from examples.dry_run import cli as dry_run_cli
from mc_train.check import Layout
from mc_train.check import __main__ as check_cli

ROOT = Path(__file__).resolve().parents[1]
# Generated pages (tables of cases, not guides) and the API pages hold no commands to run.
GUIDES = sorted(
    p
    for p in (ROOT / "docs").glob("*.md")
    if p.name not in {"bad_inputs.md", "bad_inputs_sweep.md", "compatibility.md"}
)
SETUP = {
    "python3 -m venv .venv",
    ". .venv/bin/activate",
    "python -m pip install hatch==1.18.2",
}
_BLOCK = re.compile(r"^( *)```bash\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _scripts() -> set[str]:
    config = tomllib.loads((ROOT / "hatch.toml").read_text(encoding="utf-8"))
    return set(config["envs"]["default"]["scripts"])


def _commands(path: Path) -> list[tuple[str, str]]:
    """``(command, the block's text)`` for every command of the file's bash blocks."""
    found = []
    for match in _BLOCK.finditer(path.read_text(encoding="utf-8")):
        block = match[2]
        text = re.sub(r"\\\n\s*", " ", block)
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            for part in line.split("&&"):
                found.append((part.strip(), block))
    return found


def _all_commands() -> list[tuple[str, str, str]]:
    return [
        (str(p.relative_to(ROOT)), command, block)
        for p in [ROOT / "README.md", *GUIDES]
        for command, block in _commands(p)
    ]


def _words(command: str) -> tuple[dict[str, str], list[str]]:
    """The environment assignments in front of the command, and its words."""
    words = shlex.split(command, comments=True)
    env = {}
    while words and (_ASSIGNMENT.match(words[0]) or words[0] in ("export", "srun", "env")):
        word = words.pop(0)
        if "=" in word:
            name, value = word.split("=", 1)
            env[name] = value
    return env, words


def _option(words: list[str], name: str) -> str | None:
    return words[words.index(name) + 1] if name in words else None


def _check_demo(argv: list[str], world_size: int | None) -> None:
    args = train_gpt.parse_args(argv)
    if world_size is not None:
        train_gpt.plan(args, world_size)  # ValueError names the flag


def _check_torchrun(words: list[str], block: str) -> None:
    module = words.index("-m")
    assert words[module + 1] in ("examples.train_gpt", "examples.hf_3d"), words
    launcher, argv = words[:module], words[module + 2 :]
    nodes = _option(launcher, "--nnodes") or "1"
    per_node = _option(launcher, "--nproc-per-node")
    if nodes.startswith("$"):  # under SLURM: the allocation's --nodes
        sbatch = re.search(r"#SBATCH --nodes (\d+)", block)
        nodes = sbatch[1] if sbatch else "?"
    world = int(nodes) * int(per_node) if nodes.isdigit() and per_node else None
    assert world is not None, f"no world size in {' '.join(words)}"
    if words[module + 1] == "examples.hf_3d":
        hf_3d.parse_args(argv, world)  # exits 2 naming the flag
    else:
        _check_demo(argv, world)


def _check_layout_check(argv: list[str]) -> None:
    """``python -m mc_train.check``: its flags parse and its layout is one ``Layout``
    accepts; the model builder imports."""
    args = check_cli.parse_args(argv)
    Layout(tp=args.tp, pp=args.pp, dp=args.dp, sequence_parallel=args.sp)
    module, _, function = args.model.partition(":")
    assert callable(getattr(importlib.import_module(module), function)), args.model


def _check(command: str, block: str, scripts: set[str]) -> None:
    if command in SETUP:
        return
    env, words = _words(command)
    if not words:
        return  # only assignments (`export A=1 B=2`): what they set is read by the next line
    if words[:2] == ["hatch", "run"]:
        name, argv = words[2], words[3:]
        if name == "torchrun":
            _check_torchrun(words[2:], block)
        elif name == "demo":
            _check_demo(argv, int(env.get("MC_DEMO_NPROC", "4")))
        elif name == "dry-run":
            dry_run_cli.spec_from_args(dry_run_cli.parse_args(argv))
        elif name == "python" and argv[:2] == ["-m", "mc_train.check"]:
            _check_layout_check(argv[2:])
        else:
            assert name in scripts, f"`hatch run {name}`: no such script in hatch.toml"
    elif words[0] == "torchrun":
        _check_torchrun(words, block)
    elif words[:3] == ["python", "-m", "mc_train.check"]:
        _check_layout_check(words[3:])
    elif words[:3] == ["python", "-m", "examples.dry_run"]:
        dry_run_cli.spec_from_args(dry_run_cli.parse_args(words[3:]))
    elif words[0] in ("python", "python3") and words[1].endswith(".py"):
        assert (ROOT / words[1]).is_file(), f"{words[1]} does not exist"
    elif words[0].startswith("nodes=("):
        pass  # shell setup of the SLURM script (its torchrun line is checked)
    else:
        pytest.fail(f"a documented command no check here knows: {command!r}")


def test_the_guides_show_commands() -> None:
    pages = {page for page, _, _ in _all_commands()}
    assert {"README.md", "docs/checkpoint.md", "docs/multi_node.md", "docs/dry_run.md"} <= pages


@pytest.mark.parametrize(
    ("page", "command", "block"),
    _all_commands(),
    ids=[f"{page}:{i}" for i, (page, _, _) in enumerate(_all_commands())],
)
def test_documented_command_is_runnable(page: str, command: str, block: str) -> None:
    _check(command, block, _scripts())


def test_every_inline_hatch_run_names_a_script() -> None:
    scripts = _scripts() | {"torchrun", "python", "ruff", "pytest"}
    missing = []
    for path in [ROOT / "README.md", *GUIDES]:
        for name in re.findall(r"`hatch run ([\w-]+)", path.read_text(encoding="utf-8")):
            if name not in scripts:
                missing.append(f"{path.name}: hatch run {name}")
    assert not missing, missing


def test_a_bad_documented_command_would_fail() -> None:
    with pytest.raises(ValueError, match="--tp 3"):
        _check("hatch run demo --tp 3", "", _scripts())
    with pytest.raises(AssertionError, match="no such script"):
        _check("hatch run no-such-script", "", _scripts())
    with pytest.raises(ValueError):
        _check("python -m examples.dry_run --world-size 4000 --tp 8 --pp 8", "", _scripts())
    with pytest.raises(ValueError, match="sequence_parallel=True with tp=1"):
        _check("python -m mc_train.check examples.hf_3d:build_model --sp", "", set())
    with pytest.raises(ImportError):
        _check("python -m mc_train.check no_such_module:build --tp 2", "", set())
    with pytest.raises(SystemExit):  # 4 ranks started for TP=2 × PP=2 × DP=2
        _check("torchrun --nproc-per-node 4 -m examples.hf_3d --tp 2 --pp 2 --dp 2", "", set())


@pytest.mark.skipif(shutil.which("awk") is None, reason="awk is not installed (.ci/run uses it)")
def test_ci_reads_the_readme_test_command() -> None:
    awk = re.search(r"awk '([^']+)' README.md", (ROOT / ".ci" / "run").read_text())
    assert awk is not None, ".ci/run no longer reads the README with awk: update this test"
    read = subprocess.run(
        ["awk", awk[1], str(ROOT / "README.md")], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert read.endswith("hatch run all"), read
    assert read in {line.strip() for _, _, block in _all_commands() for line in block.split("\n")}


def test_readme_stays_a_front_page() -> None:
    """The front page says what mc is, how to run it and where to read on; the rest lives in
    docs/ (issue 38: it had grown to 16.2 kB). 12 kB is about three screens."""
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12_000, f"README.md is {size} bytes: move detail to its docs/ page (≤ 12,000)"
