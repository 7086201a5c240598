"""mc's call into Transformer Engine, checked on CPU against the pinned TE release.

Localizes the break issue 13 found: mc called ``general_gemm(weight, input,
get_workspace(), ...)`` long after TE 2.x dropped the workspace argument, and a stand-in
written by hand kept the old signature, so nothing failed. Here the stand-in is built
from the installed TE sources: ``transformer_engine/pytorch/cpp_extensions/gemm.py`` is
parsed with ``ast`` (importing it needs CUDA libraries) and ``general_gemm``'s parameter
list (names, kinds, defaults) is compiled into a Python function with an empty body, so
Python itself rejects any call the real function would reject. mc's TE path
(:func:`_te_linear_forward`) then runs through it: if mc's call stops matching the pinned
release's signature, these tests fail.

Also: the loader falls back (with one warning naming the supported versions) for a TE
whose API mc does not support, and treats any import failure as "not available";
:func:`mc_tp_layers.backends` reports what was found; the ``te`` extra, the hatch pin and
:data:`TE_SUPPORTED_VERSIONS` agree.

Exact comparisons: integer-valued operands make every product and sum exact in fp32.
"""

from __future__ import annotations

import ast
import copy
import importlib.metadata
import importlib.util
import re
import tomllib
import warnings
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

import mc_tp_layers as tpl
from mc_tp_layers import _gemm

_TE_DIST = "transformer-engine"
_GEMM_SOURCE = ("pytorch", "cpp_extensions", "gemm.py")
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # packages/mc-tp-layers
_REPO_ROOT = _PACKAGE_ROOT.parents[1]
_MC_ARGUMENTS = ("A", "B", "out_dtype", "layout")  # what mc sets; the rest stay TE's defaults


def _te_gemm_path() -> Path | None:
    """TE's ``gemm.py`` in the installed package, found without importing TE."""
    spec = importlib.util.find_spec("transformer_engine")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_GEMM_SOURCE)
    return path if path.is_file() else None


def _installed_te_version() -> str | None:
    try:
        return importlib.metadata.version(_TE_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


_TE_SOURCE = _te_gemm_path()
_NO_TE = (
    None
    if _TE_SOURCE is not None
    else "transformer-engine is not installed: the CPU check reads general_gemm's signature "
    "from its sources (hatch's default environment pins transformer-engine==2.20.2, the "
    "meta package: Python sources only, no dependencies)"
)
needs_te_sources = pytest.mark.skipif(_NO_TE is not None, reason=_NO_TE or "")


class _NonLiteralDefault:
    """Stands for a default that is an expression, not a literal (none in TE 2.20.2)."""

    def __init__(self, source: str) -> None:
        self.source = source

    def __repr__(self) -> str:
        return f"<default {self.source}>"


def _general_gemm_node(source: Path) -> ast.FunctionDef:
    tree = ast.parse(source.read_text(encoding="utf-8"), filename=str(source))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name == "general_gemm":
            return node
    raise AssertionError(f"{source} defines no top-level general_gemm")


def _literal(node: ast.expr) -> object:
    try:
        return ast.literal_eval(node)
    except ValueError:
        return _NonLiteralDefault(ast.unparse(node))


def _defaults(args: ast.arguments) -> dict[str, object]:
    positional = args.posonlyargs + args.args
    out = {
        a.arg: _literal(d)
        for a, d in zip(
            positional[len(positional) - len(args.defaults) :], args.defaults, strict=True
        )
    }
    out |= {a.arg: _literal(d) for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if d}
    return out


def _stand_in(
    source: Path, impl: Callable[[dict[str, Any]], Any]
) -> tuple[Callable[..., Any], dict[str, object]]:
    """A function with exactly ``general_gemm``'s parameters (names, kinds, defaults) whose
    body hands the bound arguments to ``impl``; and the defaults, by name."""
    node = copy.deepcopy(_general_gemm_node(source))
    args = node.args
    every = [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]
    for arg in every:
        if arg is not None:
            arg.annotation = None  # TE's annotations name TE types: not importable here
    defaults = _defaults(args)
    constants = {name: ast.Name(id=f"_default_{name}", ctx=ast.Load()) for name in defaults}
    positional = args.posonlyargs + args.args
    args.defaults = [constants[a.arg] for a in positional[len(positional) - len(args.defaults) :]]
    args.kw_defaults = [constants.get(a.arg) for a in args.kwonlyargs]
    node.decorator_list, node.returns = [], None
    call_impl = ast.Call(
        func=ast.Name(id="_impl", ctx=ast.Load()),
        args=[ast.Call(func=ast.Name(id="locals", ctx=ast.Load()), args=[], keywords=[])],
        keywords=[],
    )
    node.body = [ast.Return(value=call_impl)]
    module = ast.fix_missing_locations(ast.Module(body=[node], type_ignores=[]))
    namespace: dict[str, Any] = {"_impl": impl}
    namespace |= {f"_default_{name}": value for name, value in defaults.items()}
    exec(compile(module, f"<general_gemm signature from {source}>", "exec"), namespace)
    return namespace["general_gemm"], defaults


def _same(a: object, b: object) -> bool:
    return a is b or (type(a) is type(b) and not isinstance(a, torch.Tensor) and a == b)


class _TNGemm:
    """TE's documented contract for the layout mc uses: ``layout="TN"`` computes
    ``B · Aᵀ`` in ``out_dtype`` and returns ``(out, bias_grad, gelu_input, extra_output)``.
    Records each call's bound arguments; checks every argument mc does not set is left at
    the release's default."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.defaults: dict[str, object] = {}

    def __call__(self, bound: dict[str, Any]) -> tuple[torch.Tensor, None, None, None]:
        self.calls.append(dict(bound))
        changed = {
            k: v
            for k, v in bound.items()
            if k not in _MC_ARGUMENTS and k in self.defaults and not _same(v, self.defaults[k])
        }
        assert changed == {}, f"mc passed non-default values for {sorted(changed)}"
        assert bound["layout"] == "TN"
        a, b = bound["A"], bound["B"]
        return b.double().matmul(a.double().t()).to(bound["out_dtype"]), None, None, None


def _operands(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-8, 9, (3, 2, 16), generator=g).bfloat16()
    w = torch.randint(-8, 9, (5, 16), generator=g).bfloat16()
    bias = torch.randint(-8, 9, (5,), generator=g).bfloat16()
    return x, w, bias


@needs_te_sources
def test_installed_te_is_the_supported_release() -> None:
    version = _installed_te_version()
    assert version is not None
    assert _version_in(version, _gemm.TE_SUPPORTED_VERSIONS), version


@needs_te_sources
def test_mc_accepts_the_pinned_signature() -> None:
    assert _TE_SOURCE is not None
    general_gemm, _ = _stand_in(_TE_SOURCE, _TNGemm())
    assert _gemm._te_gemm_signature_problem(general_gemm) is None


@needs_te_sources
def test_te_path_calls_the_pinned_general_gemm() -> None:
    """mc's ``output_dtype`` GEMM through a function with TE 2.20.2's exact signature: the
    call binds, only A, B, out_dtype and layout differ from TE's defaults, the 2-D input
    comes back in its leading dims with the bias added in fp32, equal to the torch path."""
    assert _TE_SOURCE is not None
    impl = _TNGemm()
    general_gemm, impl.defaults = _stand_in(_TE_SOURCE, impl)
    x, w, bias = _operands(3)
    for b in (None, bias):
        y = _gemm._te_linear_forward(general_gemm, x, w, b, torch.float32)
        assert y.dtype == torch.float32
        assert y.shape == (3, 2, 5)
        reference = x.double().matmul(w.double().t())
        if b is not None:
            reference = reference + b.double()
        assert torch.equal(y, reference.float())
    assert [(tuple(c["A"].shape), tuple(c["B"].shape)) for c in impl.calls] == [
        ((5, 16), (6, 16))
    ] * 2
    assert all(c["A"] is w for c in impl.calls)


@needs_te_sources
def test_stand_in_rejects_the_old_call() -> None:
    """The stand-in is strict: mc's former call (a workspace as third positional argument)
    fails on it, as it does on the real TE 2.20.2, so the tests above would catch it."""
    assert _TE_SOURCE is not None
    general_gemm, _ = _stand_in(_TE_SOURCE, _TNGemm())
    x, w, _ = _operands(4)
    with pytest.raises(TypeError, match="multiple values for argument 'out_dtype'"):
        general_gemm(w, x.reshape(6, 16), torch.empty(0), out_dtype=torch.float32, layout="TN")
    with pytest.raises(TypeError, match="unexpected keyword argument 'workspace'"):
        general_gemm(w, x, workspace=torch.empty(0))


# -- the loader: supported API, unsupported API, import failures --------------------------


def _new_api(
    A: torch.Tensor,  # noqa: N803 - TE's parameter names
    B: torch.Tensor,  # noqa: N803
    out_dtype: torch.dtype | None = None,
    quantization_params: object = None,
    gelu: bool = False,
    gelu_in: torch.Tensor | None = None,
    alpha: float = 1.0,
    beta: float | None = None,
    accumulate: bool = False,
    layout: str = "TN",
) -> tuple[torch.Tensor, None, None, None]:
    raise AssertionError("not called by the loader")


def _old_api(
    A: torch.Tensor,  # noqa: N803
    B: torch.Tensor,  # noqa: N803
    workspace: torch.Tensor,
    out_dtype: torch.dtype | None = None,
    layout: str = "TN",
) -> tuple[torch.Tensor, None, None, None]:
    raise AssertionError("not called by the loader")


def _module_with(general_gemm: object | None) -> Callable[[str], ModuleType]:
    def import_module(name: str) -> ModuleType:
        assert name == "transformer_engine.pytorch.cpp_extensions"
        module = ModuleType(name)
        if general_gemm is not None:
            module.general_gemm = general_gemm  # type: ignore[attr-defined]
        return module

    return import_module


def _failing_import(error: BaseException) -> Callable[[str], ModuleType]:
    def import_module(name: str) -> ModuleType:
        raise error

    return import_module


def test_loader_takes_a_supported_general_gemm() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _gemm._load_te_gemm(_module_with(_new_api)) is _new_api


@pytest.mark.parametrize(
    ("general_gemm", "why"),
    [
        (_old_api, "missing a required argument: 'workspace'"),
        (None, "it has no general_gemm function"),
    ],
    ids=["workspace-api", "no-general_gemm"],
)
def test_loader_warns_and_falls_back_on_an_unsupported_api(general_gemm: object, why: str) -> None:
    with pytest.warns(RuntimeWarning) as record:
        assert _gemm._load_te_gemm(_module_with(general_gemm)) is None
    (warning,) = record
    message = str(warning.message)
    assert why in message
    assert "mc supports transformer-engine>=2.20.2,<2.21" in message
    assert 'pip install "mc-tp-layers[te]"' in message


@pytest.mark.parametrize(
    "error",
    [
        ImportError("No module named 'transformer_engine'"),
        OSError("libcudart.so.12: cannot open shared object file"),
        RuntimeError("Found empty `transformer-engine` meta package installed."),
        AssertionError("Could not find `transformer-engine`."),
    ],
    ids=["absent", "no-cuda-libraries", "meta-package-only", "failed-sanity-check"],
)
def test_loader_treats_any_import_failure_as_absent(error: BaseException) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _gemm._load_te_gemm(_failing_import(error)) is None


def test_signature_problem_names_the_mismatch() -> None:
    assert _gemm._te_gemm_signature_problem(_new_api) is None
    problem = _gemm._te_gemm_signature_problem(_old_api)
    assert problem is not None
    assert "missing a required argument: 'workspace'" in problem

    def renamed(A: torch.Tensor, B: torch.Tensor, dtype: torch.dtype) -> None:  # noqa: N803
        raise AssertionError

    problem = _gemm._te_gemm_signature_problem(renamed)
    assert problem is not None
    assert "out_dtype" in problem


# -- backends() ------------------------------------------------------------------------------


def _imports(name: str) -> bool:
    try:
        importlib.import_module(name)
    except Exception:
        return False
    return True


def test_backends_reports_what_this_machine_can_load() -> None:
    """Independent reference: try the imports here. On this CPU machine TE's meta package
    is installed but cannot load (no CUDA build), and apex is absent: both False."""
    found = tpl.backends()
    assert "backends" in tpl.__all__
    assert set(found) == {"transformer_engine_gemm", "apex_fused_wgrad"}
    assert all(isinstance(v, bool) for v in found.values())
    te_loads = _imports("transformer_engine.pytorch.cpp_extensions")
    assert found["transformer_engine_gemm"] == te_loads
    assert found["apex_fused_wgrad"] == _imports("fused_weight_gradient_mlp_cuda")
    found["apex_fused_wgrad"] = not found["apex_fused_wgrad"]  # a copy: callers cannot flip it
    assert tpl.backends() != found


# -- the te extra, the pin and the supported range agree -----------------------------------


def _version_in(version: str, spec: str) -> bool:
    """``version`` within a ``>=a,<b`` range (release numbers only)."""
    bounds = dict(re.findall(r"(>=|<)([\d.]+)", spec))

    def key(v: str) -> tuple[int, ...]:
        return tuple(int(p) for p in re.findall(r"\d+", v.split("+", maxsplit=1)[0])[:3])

    return key(bounds[">="]) <= key(version) < key(bounds["<"])


def test_te_extra_pin_and_supported_range_agree() -> None:
    project = tomllib.loads((_PACKAGE_ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    extras = project["project"]["optional-dependencies"]
    assert "apex" not in extras  # PyPI's `apex` is an unrelated project; apex builds from source
    assert extras["te"] == [f"transformer-engine[pytorch]{_gemm.TE_SUPPORTED_VERSIONS}"]
    hatch = tomllib.loads((_REPO_ROOT / "hatch.toml").read_text(encoding="utf-8"))
    pins = [d for d in hatch["envs"]["default"]["dependencies"] if d.startswith(_TE_DIST)]
    assert len(pins) == 1
    pinned = pins[0].split("==")[1]
    assert _version_in(pinned, _gemm.TE_SUPPORTED_VERSIONS)
    assert not _version_in("2.21.0", _gemm.TE_SUPPORTED_VERSIONS)
    assert not _version_in("2.19.0", _gemm.TE_SUPPORTED_VERSIONS)
