"""mc-buffers must not communicate: no module imports torch.distributed or mc_groups'
collective layer (only ``mc_groups.device``, the argument checks ``mc_groups.argcheck``,
the parameter-attribute contract ``mc_groups.param_attrs``, the error types
``mc_groups.errors`` and the root's ``package_version``, which reads the installed
distribution's metadata, are allowed), and a full buffer
lifecycle records no collective. Static and exact: no tolerance involved."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

import mc_buffers
from mc_buffers.build import build_param_and_grad_buffers
from mc_buffers_tests._params import linears
from mc_groups import record_collectives

_ALLOWED = {
    "mc_groups.device",
    "mc_groups.argcheck",
    "mc_groups.param_attrs",
    "mc_groups.errors",
    "mc_groups.package_version",
}


def _imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            # each name on its own: ``from mc_groups import all_reduce`` is
            # ``mc_groups.all_reduce``, whose home (``mc_groups``) is not allowed
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_module_imports_a_communication_layer() -> None:
    package = Path(mc_buffers.__file__).parent
    sources = sorted(package.rglob("*.py"))
    assert len(sources) >= 8
    for path in sources:
        text = path.read_text()
        assert "torch.distributed" not in text, path.name
        assert "dist." not in text, path.name
        for module in _imported_modules(path):
            if module.startswith("mc_groups"):
                home = module if module in _ALLOWED else module.rpartition(".")[0]
                assert home in _ALLOWED, f"{path.name} imports {module}"


def test_buffer_lifecycle_records_nothing() -> None:
    ps = linears(4, width=16, bias=True)
    with record_collectives() as log:
        buffers = build_param_and_grad_buffers(
            ps, bucket_size=300, data_parallel_size=4, use_distributed_optimizer=True
        )
        for buf in buffers.values():
            buf.grad_data.fill_(1.0)
            buf.scale_gradients(0.5)
            buf.offload_to_cpu()
            buf.reload_from_cpu()
            buf.reset()
            assert torch.count_nonzero(buf.grad_data).item() == 0
    assert log == []
