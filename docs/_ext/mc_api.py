"""mc's API reference, generated from the packages at each build (a Sphinx extension).

What it does, in build order:

1. **Pages** (``builder-inited``): a page per package, its README as a page of its own (the
   package's guide, as PyPI shows it), and a page per
   public module (a module whose name has no leading underscore), written into
   ``docs/api/`` (not committed). A package's ``__all__`` names are documented once, under
   the name users import (``mc_ddp.DistributedDataParallel``), on the page of the public
   module that defines them (in a public subpackage too: ``mc_groups.all_reduce`` on the
   page of ``mc_groups.comm.collectives``), or on the package's page when a private module
   does; a public
   module's own ``__all__`` names that the package does not export are documented under the
   module (``mc_groups.argcheck.check_int``); re-exports are listed as links.
2. **Megatron names** (``autodoc-process-docstring``): every documented object that is a
   row of ``docs/compatibility.md`` gets a line with the Megatron-Core name and its status,
   linked to the row (the rows' HTML ids are the Megatron names, written by
   ``scripts/gen_compatibility.py``); one of :data:`MEGATRON_ELSEWHERE` (outside the spec
   modules) gets its Megatron-Core name without a link.
3. **Checks**: a documented public name without a docstring is a warning (an error under
   ``-W``); a cross-reference to an mc object by another of its names (the defining
   module's, ``mc_ddp.distributed_data_parallel.DistributedDataParallel``, or a short name
   inside a docstring) resolves to where it is documented, and one to an mc name that is
   documented nowhere stays a warning; after the build every link to a compatibility row
   must find its id in ``compatibility.html``.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.errors import ExtensionError
from sphinx.util import logging

ROOT = Path(__file__).resolve().parents[2]
API_DIR = ROOT / "docs" / "api"
PACKAGES = (
    "mc_groups",
    "mc_buffers",
    "mc_ddp",
    "mc_tp_layers",
    "mc_finalize",
    "mc_moe",
    "mc_train",
)
DISTRIBUTIONS = {
    "mc_groups": "mc-groups",
    "mc_buffers": "mc-buffers",
    "mc_ddp": "mc-ddp",
    "mc_tp_layers": "mc-tp-layers",
    "mc_finalize": "mc-finalize",
    "mc_moe": "mc-moe",
    "mc_train": "mc-train",
}
COMPATIBILITY_PAGE = "compatibility"
_PG = "megatron.core.distributed.param_and_grad_buffer"
_LAYOUT = "megatron.core.optimizer.param_layout"
_TP = "megatron.core.tensor_parallel"
# Megatron-Core names outside the three spec modules of the compatibility table (so without
# a row to link to), each found in Megatron-LM's megatron/core (main branch, 2026-08-22):
# mc name -> Megatron-Core name. Every mc name must import (the build fails otherwise).
MEGATRON_ELSEWHERE = {
    "mc_groups.rank_generator.RankGenerator": "megatron.core.parallel_state.RankGenerator",
    "mc_groups.initialize_model_parallel": "megatron.core.parallel_state.initialize_model_parallel",
    "mc_groups.destroy_model_parallel": "megatron.core.parallel_state.destroy_model_parallel",
    "mc_groups.ProcessGroupCollection": (
        "megatron.core.process_groups_config.ProcessGroupCollection"
    ),
    "mc_groups.ModelParallelConfig": "megatron.core.model_parallel_config.ModelParallelConfig",
    "mc_buffers.BufferKey": f"{_LAYOUT}.BufferKey",
    "mc_buffers.PerBufferParamLayout": f"{_LAYOUT}.PerBufferParamLayout",
    "mc_buffers.FullParamLayout": f"{_LAYOUT}.FullParamLayout",
    "mc_buffers.pad_to_divisor": f"{_LAYOUT}.pad_to_divisor",
    "mc_buffers.pad_param_start": f"{_LAYOUT}.pad_param_start",
    "mc_buffers.pad_bucket_end": f"{_LAYOUT}.pad_bucket_end",
    "mc_buffers.bucket_end_divisor": f"{_LAYOUT}.bucket_end_divisor",
    "mc_buffers.compute_default_per_buffer_param_layout": (
        f"{_PG}._compute_default_per_buffer_param_layout"
    ),
    "mc_buffers.group_params_for_buffers": f"{_PG}.group_params_for_buffers",
    "mc_buffers.shard_buffer": f"{_PG}.shard_buffer",
    "mc_buffers.ParamAndGradBuffer": f"{_PG}._ParamAndGradBuffer",
    "mc_buffers.buffer.ParamAndGradBucket": f"{_PG}._ParamAndGradBucket",
    "mc_ddp.bucket_group.ParamAndGradBucketGroup": f"{_PG}._ParamAndGradBucketGroup",
    "mc_ddp.partition_buckets": f"{_PG}.partition_buckets",
    "mc_ddp.reduce_scatter_with_fp32_accumulation": (
        "megatron.core.distributed.reduce_scatter_with_fp32_accumulation."
        "reduce_scatter_with_fp32_accumulation"
    ),
    "mc_ddp.ensure_params_ready": "megatron.core.utils.ensure_params_ready",
    "mc_finalize.reset_model_temporary_tensors": (
        "megatron.core.distributed.finalize_model_grads.reset_model_temporary_tensors"
    ),
    **{  # every public mapping keeps Megatron's name in Megatron's mappings module
        f"mc_tp_layers.mappings.{name}": f"{_TP}.mappings.{name}"
        for name in importlib.import_module("mc_tp_layers.mappings").__all__
    },
    **{
        f"mc_tp_layers.random.{name}": f"{_TP}.random.{name}"
        for name in (
            "CudaRNGStatesTracker",
            "get_cuda_rng_tracker",
            "get_data_parallel_rng_tracker_name",
            "get_expert_parallel_rng_tracker_name",
            "model_parallel_cuda_manual_seed",
        )
    },
    "mc_tp_layers.utils.VocabUtility": f"{_TP}.utils.VocabUtility",
    "mc_tp_layers.utils.split_tensor_along_last_dim": f"{_TP}.utils.split_tensor_along_last_dim",
    "mc_tp_layers.utils.divide": "megatron.core.utils.divide",
    "mc_tp_layers.vocab_parallel_cross_entropy": (
        f"{_TP}.cross_entropy.vocab_parallel_cross_entropy"
    ),
}
_LOG = logging.getLogger(__name__)


@dataclass
class _Entry:
    """One documented public name."""

    name: str  # the documented (canonical) dotted name
    obj: Any
    page: str  # the page that documents it


@dataclass
class _Reference:
    """Everything the build needs to know about the public API."""

    entries: dict[str, _Entry] = field(default_factory=dict)
    by_id: dict[int, str] = field(default_factory=dict)  # id(obj) -> canonical name
    aliases: dict[str, str] = field(default_factory=dict)  # package name -> module's (data)
    megatron: dict[int, tuple[str, str]] = field(default_factory=dict)  # -> (name, status)
    elsewhere: dict[int, str] = field(default_factory=dict)  # -> Megatron name, no row
    anchors_linked: set[str] = field(default_factory=set)


def _is_package(module: ModuleType) -> bool:
    return hasattr(module, "__path__")


def _public_modules(package: ModuleType) -> list[ModuleType]:
    found = pkgutil.iter_modules(package.__path__, package.__name__ + ".")
    names = sorted(m.name for m in found if not m.name.rsplit(".", 1)[1].startswith("_"))
    return [importlib.import_module(name) for name in names]


def _public_tree(package: ModuleType) -> list[ModuleType]:
    """The public modules of ``package`` and of its public subpackages, the package's own
    first (where a package's exported names are looked for)."""
    modules = _public_modules(package)
    found = [m for m in modules if not _is_package(m)]
    for sub in modules:
        if _is_package(sub):
            found += _public_tree(sub)
    return found


def _defines(module: ModuleType, name: str, obj: Any) -> bool:
    """Whether ``module`` is where ``name`` is defined (classes and functions by their
    ``__module__``; data by an assignment in the module's source)."""
    if inspect.isclass(obj) or inspect.isfunction(obj):
        return getattr(obj, "__module__", None) == module.__name__
    source = inspect.getsource(module)
    return re.search(rf"^{re.escape(name)}\s*[:=]", source, re.MULTILINE) is not None


def _directive(obj: Any) -> str:
    if inspect.isclass(obj):
        return "autoexception" if issubclass(obj, BaseException) else "autoclass"
    if inspect.isfunction(obj) or inspect.isbuiltin(obj):
        return "autofunction"
    return "autodata"


def _autodoc(name: str, obj: Any) -> list[str]:
    lines = [f".. {_directive(obj)}:: {name}"]
    if inspect.isclass(obj):
        lines.append("   :members:")
    return [*lines, ""]


def _title(text: str, mark: str = "=") -> list[str]:
    return [text, mark * len(text), ""]


def _all(module: ModuleType) -> list[str]:
    return list(getattr(module, "__all__", []))


class _Writer:
    """Plans and writes the API pages, recording what is documented where."""

    def __init__(self, reference: _Reference) -> None:
        self.reference = reference
        self.pages: dict[str, list[str]] = {}
        self.readmes: dict[str, Path] = {}  # page -> the package README it shows

    def _document(self, name: str, obj: Any, page: str) -> list[str]:
        self.reference.entries[name] = _Entry(name, obj, page)
        if inspect.isclass(obj) or inspect.isfunction(obj):
            self.reference.by_id.setdefault(id(obj), name)
        return _autodoc(name, obj)

    def package(self, package: ModuleType, outer: dict[str, dict[str, str]] | None = None) -> str:
        """Write the package's page and its modules' pages; the package page's name.

        ``outer``: the enclosing package's exports whose home is a module of this
        subpackage (module name -> {export: the package that exports it}).
        """
        name = package.__name__
        modules = _public_modules(package)
        exported = {n: getattr(package, n) for n in _all(package)}
        homes: dict[str, dict[str, str]] = {} if outer is None else outer
        orphans, reexports = [], []
        top = importlib.import_module(name.split(".")[0])
        for export, obj in exported.items():
            home = next((m for m in _public_tree(package) if _defines(m, export, obj)), None)
            if home is not None:
                homes.setdefault(home.__name__, {})[export] = name
            elif top is not package and getattr(top, export, None) is obj:
                reexports.append(f"{top.__name__}.{export}")  # a deprecated alias package
            else:
                orphans.append(export)
        subpages = []
        for module in modules:
            if _is_package(module):
                subpages.append(self.package(module, homes))
            else:
                subpages.append(self.module(module, package, homes.get(module.__name__, {})))
        lines = [*_title(f"``{name}``"), f".. automodule:: {name}", "   :no-members:", ""]
        if name in DISTRIBUTIONS:
            lines += [f"Install: ``pip install ./packages/{DISTRIBUTIONS[name]}``.", ""]
        callables = [
            n
            for n, obj in exported.items()
            if _directive(obj) != "autodata" and f"{top.__name__}.{n}" not in reexports
        ]
        if callables:
            lines += [*_title("Public names", "-"), ".. autosummary::", ""]
            lines += [f"   {export}" for export in callables]
            lines.append("")
        constants = {
            n: home
            for home, names in homes.items()
            for n, owner in names.items()
            if owner == name and n not in callables
        }
        if constants:
            lines += [*_title("Constants", "-")]
            lines += [
                f"- :py:data:`{name}.{n}` (in :py:mod:`{home}`)" for n, home in constants.items()
            ]
            lines.append("")
        if subpages or name in DISTRIBUTIONS:
            lines += [*_title("Modules", "-"), ".. toctree::", "   :maxdepth: 1", ""]
        if name in DISTRIBUTIONS:  # the package's README: its guide, as PyPI shows it
            readme = Path(str(package.__file__)).resolve().parents[2] / "README.md"
            self.readmes[f"{name}.readme"] = readme
            lines.append(f"   The package's README <{name}.readme>")
        lines += [f"   {page}" for page in subpages]
        lines.append("")
        if reexports:
            lines += [*_title("Also importable from here", "-")]
            lines += [f"- :py:obj:`{target}`" for target in reexports]
            lines.append("")
        if orphans:
            lines += [*_title(f"Defined in ``{name}``'s private modules", "-")]
            lines += [".. currentmodule:: " + name, ""]
            for export in orphans:
                lines += self._document(f"{name}.{export}", exported[export], name)
        self.pages[name] = lines
        return name

    def module(self, module: ModuleType, package: ModuleType, exports: dict[str, str]) -> str:
        """Write a public module's page; its name. ``exports``: the names it defines that a
        package exports, each with that package's name (``package`` or one enclosing it)."""
        name = module.__name__
        lines = [*_title(f"``{name}``"), f".. automodule:: {name}", "   :no-members:", ""]
        package_all = set(_all(package))
        reexports = []
        documented = []
        for export in _all(module):
            obj = getattr(module, export)
            if export in exports and _directive(obj) == "autodata":
                # autodoc finds a constant's docstring only under the module that assigns it
                documented.append((f"{name}.{export}", obj))
                self.reference.aliases[f"{exports[export]}.{export}"] = f"{name}.{export}"
            elif export in exports:
                documented.append((f"{exports[export]}.{export}", obj))
            elif export in package_all and getattr(package, export) is obj:
                if not _defines(module, export, obj):
                    reexports.append(f"{package.__name__}.{export}")
            elif _defines(module, export, obj):
                documented.append((f"{name}.{export}", obj))
            else:
                reexports.append(f"{name}.{export}")
        for export, owner in exports.items():  # exported by a package, absent from __all__
            names = (f"{owner}.{export}", f"{name}.{export}")
            if all(n not in names for n, _ in documented):
                documented.append((f"{owner}.{export}", getattr(module, export)))
        for doc_name, obj in documented:
            lines += self._document(doc_name, obj, name)
        if reexports:
            lines += [*_title("Also importable from here", "-")]
            lines += [f"- :py:obj:`{target}`" for target in reexports]
            lines.append("")
        self.pages[name] = lines
        return name

    def write(self, folder: Path) -> None:
        """Write the pages into ``folder``; stale ones go, unchanged ones keep their mtime."""
        folder.mkdir(parents=True, exist_ok=True)
        wanted = {f"{page}.rst": "\n".join(lines) for page, lines in self.pages.items()}
        for page, readme in self.readmes.items():  # MyST's include reads relative paths
            wanted[f"{page}.md"] = f"```{{include}} {os.path.relpath(readme, folder)}\n```\n"
        for stale in [*folder.glob("*.rst"), *folder.glob("*.md")]:
            if stale.name not in wanted:
                stale.unlink()
        for filename, text in wanted.items():
            path = folder / filename
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                path.write_text(text, encoding="utf-8")


def _load_gen_compatibility() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "gen_compatibility", ROOT / "scripts" / "gen_compatibility.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_compatibility"] = module
    spec.loader.exec_module(module)
    return module


def _megatron_rows() -> dict[int, tuple[str, str]]:
    """``id(mc object) -> (Megatron name, status)`` for every row of the compatibility table
    whose mc object is a class, function or method."""
    gen = _load_gen_compatibility()
    found: dict[int, tuple[str, str]] = {}
    tables = [
        (importlib.import_module(mc_name), gen.module_rows(spec_module))
        for spec_module, (_, mc_name) in gen.MODULES.items()
    ]
    tables.append((importlib.import_module(gen.FSDP2_MC), gen.fsdp2_rows()))
    for mc_module, rows in tables:
        for row in rows:
            obj = gen._resolve(mc_module, row.name)
            if callable(obj):
                found.setdefault(id(obj), (gen.megatron_name(row), row.status))
    config = importlib.import_module("mc_ddp").DistributedDataParallelConfig
    name = f"megatron.{gen.CONFIG_MODULE}.DistributedDataParallelConfig"
    found[id(config)] = (name, "see the fields")
    return found


def _generate(app: Sphinx) -> None:
    reference = _Reference()
    writer = _Writer(reference)
    for package in PACKAGES:
        writer.package(importlib.import_module(package))
    writer.write(API_DIR)
    reference.megatron = _megatron_rows()
    for mc_name, megatron_name in MEGATRON_ELSEWHERE.items():
        obj = _import(mc_name)
        if obj is None:
            raise ExtensionError(f"MEGATRON_ELSEWHERE names {mc_name}, which does not import")
        reference.elsewhere[id(obj)] = megatron_name
    app.mc_reference = reference  # type: ignore[attr-defined]


def _reference(app: Sphinx) -> _Reference:
    found: _Reference = app.mc_reference  # type: ignore[attr-defined]
    return found


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n", 1)[0].strip()


def _described_by_module(name: str) -> bool:
    """Whether the docstring of the module that defines the constant ``name`` describes it:
    names it in a list in parentheses or, for a string constant, shows its value as a
    literal (``mc_groups.param_attrs`` describes each parameter attribute so)."""
    module_name, _, short = name.rpartition(".")
    module = sys.modules.get(module_name)
    doc = getattr(module, "__doc__", None) or ""
    value = getattr(module, short, None)
    if isinstance(value, str) and f"``{value}``" in doc:
        return True
    return re.search(rf"[(, ]{re.escape(short)}[,) ]", doc) is not None


def _process_docstring(
    app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: list[str]
) -> None:
    reference = _reference(app)
    own = [line for line in lines if line.strip()]
    if own and what == "data" and own[0].strip() == _first_line(type(obj).__doc__):
        own = []  # autodoc fell back to the docstring of the value's type (int, str, ...)
    if not own and what == "data" and _described_by_module(name):
        module = name.rpartition(".")[0]
        lines[:] = [f"What it holds: its entry in the :py:mod:`{module}` description above."]
        own = lines
    if name in reference.entries and not own:
        _LOG.warning("public name %s has no docstring", name, location=app.env.docname)
    megatron = reference.megatron.get(id(obj)) if callable(obj) else None
    if megatron is None:
        if callable(obj) and id(obj) in reference.elsewhere:
            elsewhere = reference.elsewhere[id(obj)]
            lines += ["", f"**Megatron-Core:** ``{elsewhere}`` (no row in the table)", ""]
        return
    megatron_name, status = megatron
    reference.anchors_linked.add(megatron_name)
    depth = "../" if app.env.docname.startswith("api/") else ""
    link = f"{depth}{COMPATIBILITY_PAGE}.html#{megatron_name}"
    lines += ["", f"**Megatron-Core:** `{megatron_name} <{link}>`__ ({status})", ""]


def _process_signature(
    app: Sphinx,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None] | None:
    """A dataclass field with a ``default_factory`` shows its default as ``<factory>``, which
    is no Python expression: Sphinx then cannot parse the signature and would link its
    pieces as broken references. Show ``...`` instead (the field's docs say what it is)."""
    if signature is None or "<factory>" not in signature:
        return None
    return re.sub(r"=\s*<factory>", "= ...", signature), return_annotation


def _import(dotted: str) -> Any:
    """The object a dotted name denotes, or None."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            value = getattr(value, part, None)
            if value is None:
                return None
        return value
    return None


def _canonical(reference: _Reference, target: str) -> str | None:
    """Where the object ``target`` names is documented (methods and attributes through their
    class), or None."""
    if target in reference.entries:
        return target
    if target in reference.aliases:
        return reference.aliases[target]
    obj = _import(target)
    if obj is not None and id(obj) in reference.by_id:
        return reference.by_id[id(obj)]
    owner, _, member = target.rpartition(".")
    if owner and member:
        documented_owner = _canonical(reference, owner)
        if documented_owner is not None and documented_owner != owner:
            return f"{documented_owner}.{member}"
    return None


def _homes_of_short_name(reference: _Reference, name: str) -> list[str]:
    """The one mc object called ``name`` in a loaded mc module or as a member of a
    documented class, as a dotted name; nothing when there are none or several."""
    found: dict[int, str] = {}
    for module_name, module in list(sys.modules.items()):
        if module_name.startswith("mc_") and module is not None and hasattr(module, name):
            found.setdefault(id(getattr(module, name)), f"{module_name}.{name}")
    for entry in reference.entries.values():
        if inspect.isclass(entry.obj) and name in vars(entry.obj):
            found.setdefault(id(vars(entry.obj)[name]), f"{entry.name}.{name}")
    return list(found.values()) if len(found) == 1 else []


def _missing_reference(app: Sphinx, env: BuildEnvironment, node: Any, contnode: Any) -> Any:
    if node.get("refdomain") != "py":
        return None
    target = str(node["reftarget"])
    module = node.get("py:module")
    klass = node.get("py:class")
    candidates = [target]
    for cut in range(len(module.split(".")) if module else 0, 0, -1):
        scope = ".".join(module.split(".")[:cut])
        if klass:
            candidates.append(f"{scope}.{klass}.{target}")
        candidates.append(f"{scope}.{target}")
    if "." not in target:  # a short name out of its context (an autosummary line)
        candidates += _homes_of_short_name(_reference(app), target)
    domain: Any = env.get_domain("py")
    for candidate in candidates:
        canonical = _canonical(_reference(app), candidate)
        if canonical is None or canonical == target:
            continue
        resolved = domain.resolve_xref(
            env, node["refdoc"], app.builder, "obj", canonical, node, contnode
        )
        if resolved is not None:
            return resolved
    # An mc object that exists but is in no __all__ (a private helper, a TypeVar, a base
    # class from a private module) is not part of the API: its name stays text. A name
    # that exists nowhere is left to Sphinx, which reports it.
    exists = any(c.startswith("mc_") and _import(c) is not None for c in candidates)
    return contnode if exists else None


def _check_anchors(app: Sphinx, exception: BaseException | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    page = Path(app.outdir) / f"{COMPATIBILITY_PAGE}.html"
    html = page.read_text(encoding="utf-8")
    ids = set(re.findall(r'id="([^"]+)"', html))
    missing = sorted(_reference(app).anchors_linked - ids)
    if missing:
        raise ExtensionError(
            f"the API reference links to compatibility rows that {page.name} lacks: {missing}"
            " (regenerate docs/compatibility.md with scripts/gen_compatibility.py)"
        )


def setup(app: Sphinx) -> dict[str, Any]:
    """Register the page generator, the docstring hook, the resolver and the checks."""
    app.connect("builder-inited", _generate)
    app.connect("autodoc-process-docstring", _process_docstring)
    app.connect("autodoc-process-signature", _process_signature)
    app.connect("missing-reference", _missing_reference)
    app.connect("build-finished", _check_anchors)
    return {"parallel_read_safe": False, "env_version": 1}
