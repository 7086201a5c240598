"""Which of mc's modules one training step passes through, and how big each package is.

Issue 38's measure of how traceable the hot path is: with ``sys.setprofile`` (and
``threading.setprofile``) on rank 0 of a 2-rank gloo world (CPU, ``mc_groups.testing``),
the distinct mc modules (files under ``packages/*/src``) whose Python functions are
entered during one steady-state step (one untimed warm-up step first, so lazy imports and
first-call checks are not counted), per part:

``tp-mlp``  (a) forward + backward of ``ColumnParallelLinear(h → 4h) → GELU →
            RowParallelLinear(4h → h)`` at TP = 2 (``input_is_parallel=True``, bias on,
            ``use_cpu_initialization``), loss ``mean(y²)``.
``ddp``     (b) mc DDP's backward hooks and bucket reduction: ``loss.backward()`` of a
            plain torch model (``Linear(8 → 8) → ReLU → Linear(8 → 8)``) wrapped in mc's
            ``DistributedDataParallel`` at DP = 2 (``use_distributed_optimizer=True``,
            ``overlap_grad_reduce=True``: the hooks issue the bucket's reduce-scatter).
            The model's own layers are torch's, so nothing of (a) is entered: the modules
            counted are those DDP's hooks and bucket reduction reach (the "minus (a)" of
            the issue, done by construction rather than by subtracting sets, which would
            also drop the collective layer both parts share).
``finalize``(c) ``finalize_model_grads([ddp], pg_collection=pgc)`` after that backward
            (it waits for the bucket's reduce-scatter: ``finish_grad_sync``).
``optimizer``(d) ``ShardedOptimizer(AdamW).step()`` after (c) (the masters' step and
            the params' all-gather).

Every part runs on both ranks; the profile is rank 0's (the ranks run the same code).
Modules are counted by file, ``package/path.py`` (e.g. ``mc_tp_layers/column.py``); a
package ``__init__`` counts as a module when one of its functions runs.

``--lines``: per package, lines of ``src`` split into code, docstring + comment, and blank
lines (a line holding any code is code; a docstring is a string statement, as ``ast``
reads it), plus the number of files and the names exported at the package root
(``__all__``).

Run from the repository root::

    python scripts/profile_modules.py [--parts tp-mlp,ddp,finalize,optimizer] [--lines] [--json]
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import io
import json
import sys
import threading
import tokenize
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import mc_groups as mg
from mc_ddp import DistributedDataParallel, DistributedDataParallelConfig, ShardedOptimizer
from mc_finalize import finalize_model_grads
from mc_groups.testing import RankPool
from mc_tp_layers import ColumnParallelLinear, RowParallelLinear

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("tp-mlp", "ddp", "finalize", "optimizer")
TARGETS = {"tp-mlp": 7, "ddp": 8, "finalize": 6, "optimizer": 10}  # issue 38, item 4
H, SEQ, BATCH = 16, 8, 2


def _top_level_names() -> list[str]:
    """The importable names ``packages/*/src`` holds (packages and single modules)."""
    names = []
    for src in sorted(ROOT.glob("packages/*/src")):
        for entry in sorted(src.iterdir()):
            if entry.is_dir() and (entry / "__init__.py").exists():
                names.append(entry.name)
            elif entry.suffix == ".py":
                names.append(entry.stem)
    return names


def _roots() -> dict[str, str]:
    """Where each mc top-level name is imported from (a directory, or a module file)."""
    roots = {}
    for name in _top_level_names():
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            continue
        origin = Path(spec.origin).resolve()
        roots[name] = str(origin.parent if origin.name == "__init__.py" else origin)
    return roots


class _Tracer:
    """Collects the mc modules whose Python functions are entered while active."""

    def __init__(self, roots: dict[str, str]) -> None:
        self._roots = roots
        self._known: dict[str, str | None] = {}
        self.modules: set[str] = set()

    def _module_of(self, filename: str) -> str | None:
        if filename in self._known:
            return self._known[filename]
        found = None
        resolved = str(Path(filename).resolve()) if not filename.startswith("<") else filename
        for name, root in self._roots.items():
            if resolved == root:
                found = Path(root).name
            elif resolved.startswith(root + "/"):
                found = f"{name}/{resolved[len(root) + 1 :]}"
            if found:
                break
        self._known[filename] = found
        return found

    def __call__(self, frame: FrameType, event: str, _arg: object) -> None:
        if event == "call":
            module = self._module_of(frame.f_code.co_filename)
            if module is not None:
                self.modules.add(module)

    @contextmanager
    def active(self) -> Iterator[None]:
        threading.setprofile(self)  # autograd or a hook on another thread, if any
        sys.setprofile(self)
        try:
            yield
        finally:
            sys.setprofile(None)
            threading.setprofile(None)


def _profile(step: Callable[[], object], roots: dict[str, str]) -> list[str]:
    tracer = _Tracer(roots)
    with tracer.active():
        step()
    return sorted(tracer.modules)


def _tp_mlp(roots: dict[str, str]) -> list[str]:
    pgc = mg.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        cfg = mg.ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
        init = torch.nn.init.xavier_normal_
        up = ColumnParallelLinear(H, 4 * H, config=cfg, init_method=init, pg_collection=pgc)
        down = RowParallelLinear(
            4 * H,
            H,
            config=cfg,
            init_method=init,
            bias=True,
            input_is_parallel=True,
            skip_bias_add=False,
            pg_collection=pgc,
        )
        x = torch.randn(SEQ, BATCH, H)

        def step() -> None:
            hidden, _ = up(x)
            out, _ = down(F.gelu(hidden))
            out.pow(2).mean().backward()

        step()  # warm-up: lazy imports
        return _profile(step, roots)
    finally:
        mg.destroy_model_parallel(pgc)


def _ddp_parts(roots: dict[str, str], parts: list[str]) -> dict[str, list[str]]:
    pgc = mg.initialize_model_parallel()  # DP = 2
    try:
        cfg = mg.ModelParallelConfig(use_cpu_initialization=True)
        torch.manual_seed(0)
        plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        ddp_cfg = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True
        )
        model = DistributedDataParallel(cfg, ddp_cfg, plain, pg_collection=pgc)
        opt = ShardedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-3), model, pg_collection=pgc
        )
        x = torch.randn(4, 8)
        found: dict[str, list[str]] = {}

        def run(part: str, fn: Callable[[], object], profiled: bool) -> None:
            if profiled and part in parts:
                found[part] = _profile(fn, roots)
            else:
                fn()

        for profiled in (False, True):  # a warm-up step, then the profiled one
            model.zero_grad_buffer()
            loss = model(x).pow(2).mean()
            run("ddp", loss.backward, profiled)
            run("finalize", lambda: finalize_model_grads([model], pg_collection=pgc), profiled)
            run("optimizer", opt.step, profiled)
        return found
    finally:
        mg.destroy_model_parallel(pgc)


def _measure(parts: list[str]) -> dict[str, list[str]]:
    """One rank's modules per part (run on every rank of the pool)."""
    torch.set_num_threads(1)
    roots = _roots()
    found: dict[str, list[str]] = {}
    if "tp-mlp" in parts:
        found["tp-mlp"] = _tp_mlp(roots)
    if any(part in parts for part in PARTS[1:]):
        found.update(_ddp_parts(roots, parts))
    dist.barrier()
    return found


def _modules_by_part(parts: list[str]) -> dict[str, list[str]]:
    here = importlib.import_module("profile_modules")  # ranks cannot import __main__
    with RankPool(2, call_deadline_s=600, pg_timeout_s=120) as pool:
        per_rank: list[dict[str, list[str]]] = pool.run(here._measure, parts)
    return per_rank[0]


def _doc_lines(source: str) -> set[int]:
    """Line numbers holding only docstrings (string statements) or comments."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            end = node.end_lineno or node.lineno
            lines.update(range(node.lineno, end + 1))
    code: set[int] = set()
    comments: set[int] = set()
    skip = {tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments.add(token.start[0])
        elif token.type not in skip and token.start[0] not in lines:
            code.update(range(token.start[0], token.end[0] + 1))
    return (lines | comments) - code


def _package_names(package_dir: Path) -> int | None:
    """How many names the package root's ``__all__`` lists (None: no package root)."""
    init = package_dir / "__init__.py"
    if not init.exists():
        return None
    for node in ast.parse(init.read_text()).body:
        names = node.targets if isinstance(node, ast.Assign) else []
        if isinstance(node, ast.AnnAssign):
            names = [node.target]
        value = getattr(node, "value", None)
        named_all = any(isinstance(n, ast.Name) and n.id == "__all__" for n in names)
        if named_all and isinstance(value, (ast.List, ast.Tuple)):
            return len(value.elts)
    return 0


def _lines() -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for src in sorted(ROOT.glob("packages/*/src")):
        row = {"files": 0, "lines": 0, "code": 0, "doc_comment": 0, "blank": 0, "root_names": 0}
        for path in sorted(src.rglob("*.py")):
            text = path.read_text()
            all_lines = text.splitlines()
            doc = _doc_lines(text)
            blank = sum(
                1 for n, line in enumerate(all_lines, start=1) if not line.strip() and n not in doc
            )
            row["files"] += 1
            row["lines"] += len(all_lines)
            row["doc_comment"] += len(doc)
            row["blank"] += blank
            row["code"] += len(all_lines) - len(doc) - blank
        for entry in src.iterdir():
            if entry.is_dir():
                row["root_names"] += _package_names(entry) or 0
        table[src.parent.name] = row
    total = {key: sum(row[key] for row in table.values()) for key in next(iter(table.values()))}
    table["total"] = total
    return table


def _print_modules(found: dict[str, list[str]]) -> None:
    for part in PARTS:
        if part not in found:
            continue
        modules = found[part]
        packages = sorted({module.split("/")[0] for module in modules})
        print(
            f"{part}: {len(modules)} modules in {len(packages)} packages "
            f"(issue 38 target ≤ {TARGETS[part]})"
        )
        for module in modules:
            print(f"    {module}")
    print("counts: " + " / ".join(f"{part} {len(found[part])}" for part in PARTS if part in found))


def _print_lines(table: dict[str, dict[str, int]]) -> None:
    header = ("package", "files", "lines", "code", "doc+comment", "blank", "doc/code", "root names")
    print(" | ".join(header))
    for name, row in table.items():
        ratio = row["doc_comment"] / row["code"] if row["code"] else 0.0
        cells = (
            name,
            row["files"],
            row["lines"],
            row["code"],
            row["doc_comment"],
            row["blank"],
            f"{ratio:.2f}",
            row["root_names"],
        )
        print(" | ".join(str(cell) for cell in cells))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help=f"comma-separated, of {', '.join(PARTS)} (default: all); 'none' for --lines only",
    )
    parser.add_argument("--lines", action="store_true", help="also the per-package line counts")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args(argv)
    parts = [] if args.parts == "none" else [p for p in args.parts.split(",") if p]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        parser.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    result: dict[str, Any] = {}
    if parts:
        found = _modules_by_part(parts)
        result["modules"] = found
        result["counts"] = {part: len(found[part]) for part in PARTS if part in found}
    if args.lines:
        result["lines"] = _lines()
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if parts:
        _print_modules(result["modules"])
    if args.lines:
        _print_lines(result["lines"])
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
