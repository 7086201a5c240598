"""Prove each package installs alone: only torch plus the siblings it declares.

For every package under ``packages/``: in one fresh virtual environment that holds only
torch (pinned to the test version) and hatchling, ``pip install`` the package together with
the closure of the mc siblings it *declares*, import it from outside the repository, check
every name in its ``__all__`` resolves and that no undeclared mc package was installed,
run ``mypy --strict`` on a short user snippet of the package's API in that environment (the
typed-API promise, checked as users get it: from the installed wheel's ``py.typed``, not
the repository's sources), then uninstall the mc packages before the next one. Exits
non-zero on the first failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ROOT / "packages"
TORCH = "torch==2.13.0"
MYPY = "mypy==2.4.1"

# What a user writes first with each package; mypy --strict must accept it against the
# installed package (a public name that lost its annotations, or py.typed missing from the
# wheel, fails here).
SNIPPETS = {
    "mc-groups": """
import torch
import mc_groups as mg
from mc_groups.rank_generator import RankGenerator

def reduce_over_dp(t: torch.Tensor, pgc: mg.ProcessGroupCollection) -> None:
    mg.all_reduce(t, pgc.require("dp", "my trainer"), op=mg.ReduceOp.SUM)

config: mg.ModelParallelConfig = mg.ModelParallelConfig(tensor_model_parallel_size=2)
ranks: list[list[int]] = RankGenerator(2, 1, 2, 1, 1).get_ranks("tp")
with mg.record_collectives() as log:
    pass
ops: list[str] = [record.op for record in log]
""",
    "mc-buffers": """
import torch
from mc_buffers import BufferKey

key = BufferKey(torch.bfloat16, torch.float32, False)
grad_dtype: torch.dtype = key.grad_dtype
""",
    "mc-ddp": """
import torch
import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer

def wrap(net: torch.nn.Module, pgc: mg.ProcessGroupCollection) -> ShardedOptimizer:
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True)
    model = DistributedDataParallel(mg.ModelParallelConfig(), ddp_config, net, pg_collection=pgc)
    model.zero_grad_buffer()
    return ShardedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), model)
""",
    "mc-tp-layers": """
import torch
import mc_groups as mg
from mc_tp_layers import ColumnParallelLinear, RowParallelLinear, vocab_parallel_cross_entropy

def mlp(h: int, pgc: mg.ProcessGroupCollection) -> tuple[torch.nn.Module, torch.nn.Module]:
    cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    init = torch.nn.init.xavier_normal_
    up = ColumnParallelLinear(h, 4 * h, config=cfg, init_method=init, pg_collection=pgc)
    down = RowParallelLinear(
        4 * h, h, config=cfg, init_method=init, bias=True, input_is_parallel=True,
        skip_bias_add=False, pg_collection=pgc,
    )
    return up, down

def loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return vocab_parallel_cross_entropy(logits, target).mean()
""",
    "mc-finalize": """
from collections.abc import Sequence
import torch
import mc_groups as mg
from mc_finalize import ModelChunk, finalize_model_grads

def after_backward(chunks: Sequence[ModelChunk], tokens: torch.Tensor,
                   pgc: mg.ProcessGroupCollection) -> None:
    finalize_model_grads(chunks, num_tokens=tokens, pg_collection=pgc)
""",
    "mc-moe": """
import torch
import mc_groups as mg
from mc_moe import full_state_dict, parallelize

def split(model: torch.nn.Module, pgc: mg.ProcessGroupCollection) -> dict[str, torch.Tensor]:
    cfg = mg.ModelParallelConfig(expert_model_parallel_size=2)
    parallelize(model, {}, ep_plan={"layers.*.experts": "ep_dispatch_experts"}, config=cfg,
                pg_collection=pgc)
    return full_state_dict(model, pgc)
""",
    "mc-train": """
import torch
import mc_groups as mg
import mc_train
from mc_ddp import DistributedDataParallelConfig
from mc_train.check import LayoutReport, check_layout
from mc_train.checkpoint import Checkpointer

def pipeline(model: torch.nn.Module, pgc: mg.ProcessGroupCollection) -> mc_train.Pipeline:
    chunks = mc_train.split_model(model, mc_train.decoder_stages(model, 2), pgc)
    return mc_train.build_pipeline(
        chunks, config=mg.ModelParallelConfig(), ddp_config=DistributedDataParallelConfig(),
        pg_collection=pgc, microbatches=4, loss_fn=mc_train.token_cross_entropy(),
        forward=mc_train.hf_causal_lm_forward,
    )

def resume(pipe: mc_train.Pipeline, pgc: mg.ProcessGroupCollection) -> int:
    ckpt = Checkpointer("ckpt", pipe.chunks, None, pg_collection=pgc, interval=10)
    step: int = ckpt.load("auto").step
    return step

def checked() -> bool:
    report: LayoutReport = check_layout("mypkg.model:build", tp=2, pp=2, dp=2)
    return report.ok and all(f.ok for f in report.params)
""",
}


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


# pip does not byte-compile what it installs (compiling all of torch takes longer than
# installing it); the probes write the bytecode of what they import instead, once, even
# where the shell sets PYTHONDONTWRITEBYTECODE.
_ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}


def _run(*cmd: str, cwd: Path | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=_ENV, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"FAILED: {' '.join(cmd)}\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _pip_install(python: str, *args: str) -> None:
    _run(python, "-m", "pip", "install", "-q", "--no-compile", *args)


def _installed_mc(python: str) -> list[str]:
    listed = json.loads(_run(python, "-m", "pip", "list", "--format", "json"))
    return sorted(p["name"] for p in listed if p["name"].startswith("mc-"))


def _check(python: str, package: str, workdir: Path) -> None:
    closure = _closure(package)
    _pip_install(python, "--no-build-isolation", *[str(PACKAGES / n) for n in closure])
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
    snippet = workdir / f"user_{module}.py"
    snippet.write_text(SNIPPETS[package].lstrip(), encoding="utf-8")
    # one cache for the runs: torch's stubs are analysed once, not per package
    cache = workdir / ".mypy_cache"
    _run(python, "-m", "mypy", "--strict", "--cache-dir", str(cache), str(snippet), cwd=workdir)
    siblings = [n for n in closure if n != package] or "no siblings"
    print(
        f"  {package:<14} with {siblings} + torch: import ok, {count} public names, "
        "mypy --strict on a user snippet ok"
    )
    _run(python, "-m", "pip", "uninstall", "-y", "-q", *closure)


def main() -> None:
    started = time.monotonic()
    packages = sorted(p.name for p in PACKAGES.iterdir() if (p / "pyproject.toml").exists())
    with tempfile.TemporaryDirectory(prefix="mc-install-") as tmp:
        venv = Path(tmp) / "venv"
        _run(sys.executable, "-m", "venv", str(venv))
        python = str(venv / "bin" / "python")
        _pip_install(python, TORCH, "numpy", "hatchling>=1.27", MYPY)
        print(f"install check: fresh venv with {TORCH} in {time.monotonic() - started:.0f} s")
        for package in packages:
            _check(python, package, Path(tmp))
    print(
        f"install check passed for {len(packages)} packages in {time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
