"""The documentation site builds without a warning and a browser shows it as a reader would.

Localizes: the site build (Sphinx with ``-W -n`` on a copy of ``docs/``, so it does not race
``hatch run all``'s own build of the real folder; built only for the browser), what headless
Chromium renders
of the front page and an API page (``scripts/screenshot_docs.py``: title, expected text, a
signature, no error page, a non-blank screenshot of the window's size), and the build's
own checks on hand-made inputs: a public name without a docstring is a warning, a
reference to an mc object outside every ``__all__`` stays text while one to a name that
exists nowhere is left to Sphinx (which warns), and the checker of rendered pages refuses a
browser error page and a blank screenshot. The browser test skips, saying so, where no
Chromium is installed.
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from integration_tests._scripts import load_script

ROOT = Path(__file__).resolve().parents[1]
shots = load_script("screenshot_docs")


def _load_extension() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mc_api", ROOT / "docs" / "_ext" / "mc_api.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["mc_api"] = module
    spec.loader.exec_module(module)
    return module


mc_api = _load_extension()


def _png(width: int, height: int, rows: list[bytes]) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", 0)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    raw = b"".join(b"\x00" + row for row in rows)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw))


def _app(entries: dict[str, object]) -> SimpleNamespace:
    reference = mc_api._Reference()
    for name, obj in entries.items():
        reference.entries[name] = mc_api._Entry(name, obj, "api/x")
    return SimpleNamespace(env=SimpleNamespace(docname="api/x"), mc_reference=reference)


def test_a_public_name_without_a_docstring_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    def undocumented() -> None:
        pass

    app = _app({"mc_x.undocumented": undocumented, "mc_x.documented": len})
    with caplog.at_level(logging.WARNING):
        mc_api._process_docstring(app, "function", "mc_x.documented", len, None, ["Doc."])
        assert not caplog.records
        mc_api._process_docstring(app, "function", "mc_x.undocumented", undocumented, None, [])
        # a constant whose only text is its type's docstring (autodoc's fallback) has none
        int_doc = (int.__doc__ or "").splitlines()
        app.mc_reference.entries["mc_x.LIMIT"] = mc_api._Entry("mc_x.LIMIT", 5, "api/x")
        mc_api._process_docstring(app, "data", "mc_x.LIMIT", 5, None, int_doc)
    assert [r.getMessage() for r in caplog.records] == [
        "public name mc_x.undocumented has no docstring",
        "public name mc_x.LIMIT has no docstring",
    ]


def test_references_to_mc_objects_resolve_or_stay_text_and_unknown_names_are_left() -> None:
    import mc_ddp

    reference = mc_api._Reference()
    reference.entries["mc_ddp.DistributedDataParallel"] = mc_api._Entry(
        "mc_ddp.DistributedDataParallel", mc_ddp.DistributedDataParallel, "api/x"
    )
    reference.by_id[id(mc_ddp.DistributedDataParallel)] = "mc_ddp.DistributedDataParallel"
    # the defining module's name and a method through it lead to the documented name
    full = "mc_ddp.distributed_data_parallel.DistributedDataParallel"
    assert mc_api._canonical(reference, full) == "mc_ddp.DistributedDataParallel"
    assert (
        mc_api._canonical(reference, full + ".start_grad_sync")
        == "mc_ddp.DistributedDataParallel.start_grad_sync"
    )
    assert mc_api._canonical(reference, "mc_ddp.no_such_name") is None
    assert mc_api._import("mc_ddp.distributed_data_parallel.ConfigT_co") is not None
    assert mc_api._import("mc_ddp.no_such_name") is None


def test_the_page_checker_refuses_an_error_page_and_a_blank_screenshot(tmp_path: Path) -> None:
    width, height = shots.WINDOW
    blank = tmp_path / "blank.png"
    blank.write_bytes(_png(width, height, [b"\xff" * (3 * width)] * height))
    error_dom = "<html><body>This site can’t be reached ERR_CONNECTION_REFUSED</body></html>"
    problems = shots.check_page(shots.PAGES[1], error_dom, blank)
    assert f"title {shots.PAGES[1].title!r} missing" in problems
    assert "error page: 'ERR_'" in problems
    assert "the screenshot is blank" in problems
    varied = [bytes((i + j) % 256 for j in range(3 * width)) for i in range(height)]
    assert shots.png_problems(_png(width, height, varied)) == []
    small = shots.png_problems(_png(640, 480, varied[:480]))
    assert small[0] == f"640×480, not {shots.WINDOW}"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site built from a copy of docs/ and the README (scripts/ linked: the build reads
    gen_compatibility.py), with warnings as errors."""
    work = tmp_path_factory.mktemp("docs-site")
    shutil.copytree(ROOT / "docs", work / "docs", ignore=shutil.ignore_patterns("_build", "api"))
    shutil.copy(ROOT / "README.md", work / "README.md")  # the front page's links resolve here
    (work / "scripts").symlink_to(ROOT / "scripts")
    out = work / "html"
    build = subprocess.run(
        [*load_script("run_all").DOCS, str(work / "docs"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert build.returncode == 0, build.stdout + build.stderr
    return out


@pytest.mark.skipif(
    shots.find_browser() is None,
    reason="no Chromium on PATH (Debian: apt-get install chromium), so no page can be rendered",
)
def test_a_browser_shows_the_front_page_and_an_api_page(site: Path, tmp_path: Path) -> None:
    pages = {p.name for p in (site / "api").glob("*.html")}
    for package in ("mc_groups", "mc_groups.testing", "mc_ddp", "mc_tp_layers", "mc_finalize"):
        assert f"{package}.html" in pages
    browser = shots.find_browser()
    assert browser is not None
    results = shots.screenshot(site, tmp_path, browser)
    assert results == {"front": [], "api": []}, results
