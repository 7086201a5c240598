"""The parameter-attribute contract has one home: ``mc_groups.param_attrs``.

The attributes mc's packages hang on parameters (``allreduce``, ``main_grad``,
``grad_added_to_main_grad``, ...) couple the packages; this test reads every module under
``packages/*/src`` (AST, no imports) and fails where one reads or writes such an attribute
by its literal name (``getattr(p, "allreduce", True)``, ``p.main_grad``,
``weight.allreduce = ...``) instead of through the accessors and constants of
``mc_groups.param_attrs``. Names shared with config fields (``sequence_parallel``,
``gtp_remat_size``) or too generic (``group``) are left to review: the AST cannot tell a
param from a config.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mc_groups.param_attrs as pa

ROOT = Path(__file__).resolve().parents[1]
HOME = ROOT / "packages" / "mc-groups" / "src" / "mc_groups" / "param_attrs.py"
_AMBIGUOUS = {pa.SEQUENCE_PARALLEL, pa.GTP_REMAT_SIZE, pa.GTP_GROUP}
NAMES = {
    value
    for key, value in vars(pa).items()
    if key.isupper() and isinstance(value, str) and value not in _AMBIGUOUS
}
_GETATTR_FAMILY = {"getattr", "setattr", "hasattr", "delattr"}
# A layer's or an autograd context's own fields, the accessors themselves, and the
# checks module of mc-tp-layers (``_validate.partition_dim(...)``, ``_validate.main_grad``).
_NOT_PARAMS = {"self", "ctx", "param_attrs", "_validate"}


def _on_a_param(owner: ast.expr) -> bool:
    """False for an owner in :data:`_NOT_PARAMS` (``self.x``, ``mg.param_attrs.x``, ...)."""
    name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
    return name not in _NOT_PARAMS


def _offences(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in _GETATTR_FAMILY
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in NAMES
        ):
            found.append(f"{node.func.id}(..., {node.args[1].value!r})")
        elif isinstance(node, ast.Attribute) and node.attr in NAMES and _on_a_param(node.value):
            found.append(f".{node.attr}")
    rel = path.relative_to(ROOT)
    return [f"{rel}:{what}" for what in found]


def test_contract_names_are_the_module_constants() -> None:
    """The scanned names are Megatron's, one constant each."""
    assert {"allreduce", "main_grad", "grad_added_to_main_grad", "shared_embedding"} <= NAMES
    assert len(NAMES) == len(
        [k for k, v in vars(pa).items() if k.isupper() and isinstance(v, str)]
    ) - len(_AMBIGUOUS)


def test_packages_read_and_write_param_attributes_through_param_attrs() -> None:
    sources = sorted(ROOT.glob("packages/*/src/**/*.py"))
    assert len(sources) > 50
    offences = [o for path in sources if path != HOME for o in _offences(path)]
    assert offences == []
