"""Look at the built documentation site as a reader would: headless Chromium, real HTTP.

Usage: ``python scripts/screenshot_docs.py OUT_DIR [--site docs/_build/html]`` after
``hatch run docs``. Serves the site on a free localhost port, renders the front page and the
API page of ``mc_ddp.DistributedDataParallel`` in headless Chromium (one browser per page,
side by side, each with a fresh profile and every background network feature off), writes
``OUT_DIR/<page>.png`` and ``OUT_DIR/<page>.html`` (the DOM after rendering), and checks
each page: the DOM holds the page's title and its expected text (on the API page a
signature), holds no browser or server error, and the screenshot is a PNG of the window's
size whose pixels are not all one colour. Exit status 0 when every page passes; the
screenshots are for a person to look at and are not committed.
"""

from __future__ import annotations

import argparse
import functools
import html
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SITE = ROOT / "docs" / "_build" / "html"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WINDOW = (1280, 1600)
TIMEOUT_S = 120.0
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)
# What a browser or server error page says instead of the content
ERRORS = ("ERR_", "This site can’t be reached", "Error response", "404 Not Found")


@dataclass(frozen=True)
class Page:
    """A page to render and what a reader must see on it."""

    name: str
    path: str
    title: str
    expected: tuple[str, ...]


PAGES = (
    Page(
        "front",
        "index.html",
        "mc — Megatron-Core",
        ("The two commands", "hatch run all", "What is measured"),
    ),
    Page(
        "api",
        "api/mc_ddp.distributed_data_parallel.html",
        "mc_ddp.distributed_data_parallel",
        (
            "class mc_ddp.DistributedDataParallel(config: ConfigT_co, ddp_config: "
            "DistributedDataParallelConfig, module: Module",
            "Megatron-Core: megatron.core.distributed.distributed_data_parallel."
            "DistributedDataParallel",
        ),
    ),
)


def find_browser() -> str | None:
    """The first Chromium-family browser on PATH, or None."""
    return next((found for b in BROWSERS if (found := shutil.which(b))), None)


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def serve(site: Path) -> Iterator[str]:
    """Serve ``site`` on a free localhost port for the ``with`` block; yields the base URL."""
    handler = functools.partial(_QuietHandler, directory=str(site))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def _text(dom: str) -> str:
    """The DOM's visible text, whitespace collapsed (tags dropped, entities decoded)."""
    without = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.DOTALL)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", "", without)))


def png_problems(png: bytes) -> list[str]:
    """What makes ``png`` no screenshot of the window: not a PNG, another size, one colour."""
    if png[:8] != b"\x89PNG\r\n\x1a\n":
        return ["not a PNG file"]
    width, height = struct.unpack(">II", png[16:24])
    problems = [] if (width, height) == WINDOW else [f"{width}×{height}, not {WINDOW}"]
    chunks, at = [], 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        if png[at + 4 : at + 8] == b"IDAT":
            chunks.append(png[at + 8 : at + 8 + length])
        at += 12 + length
    pixels = zlib.decompress(b"".join(chunks))
    if len(set(pixels)) < 16:  # filter bytes and one colour's channels: an empty page
        problems.append("the screenshot is blank")
    return problems


def _render(browser: str, url: str, png: Path, profile: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [browser, *FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}", "--dump-dom", url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,  # dbus and GPU noise of a headless machine
        text=True,
    )


def check_page(page: Page, dom: str, png: Path) -> list[str]:
    """What is wrong with the rendered page (empty: it is what a reader should see)."""
    text = _text(dom)
    problems = [f"title {page.title!r} missing"] if page.title not in text else []
    problems += [f"{want!r} missing" for want in page.expected if want not in text]
    problems += [f"error page: {e!r}" for e in ERRORS if e in text]
    problems += png_problems(png.read_bytes()) if png.is_file() else ["no screenshot written"]
    return problems


def screenshot(site: Path, out: Path, browser: str) -> dict[str, list[str]]:
    """Render every page of :data:`PAGES` into ``out``; ``{page name: problems}``."""
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, list[str]] = {}
    with serve(site) as base, tempfile.TemporaryDirectory(prefix="mc-docs-chromium-") as tmp:
        runs = {
            page: _render(
                browser, base + page.path, out / f"{page.name}.png", Path(tmp) / page.name
            )
            for page in PAGES
        }
        for page, run in runs.items():
            try:
                dom, _ = run.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                run.kill()
                results[page.name] = [f"the browser did not finish in {TIMEOUT_S:.0f} s"]
                continue
            (out / f"{page.name}.html").write_text(dom, encoding="utf-8")
            results[page.name] = check_page(page, dom, out / f"{page.name}.png")
    return results


def main(argv: list[str] | None = None) -> int:
    """Render, check, report; exit status 1 on any problem, 2 when nothing can render."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("out", type=Path, help="folder for the screenshots and DOMs")
    parser.add_argument("--site", type=Path, default=SITE, help="the built site (index.html)")
    args = parser.parse_args(argv)
    browser = find_browser()
    if browser is None:
        print(f"no browser: none of {', '.join(BROWSERS)} is on PATH", file=sys.stderr)
        return 2
    if not (args.site / "index.html").is_file():
        print(f"{args.site} holds no built site: run `hatch run docs` first", file=sys.stderr)
        return 2
    results = screenshot(args.site, args.out, browser)
    for name, problems in results.items():
        verdict = "ok" if not problems else "; ".join(problems)
        print(f"{name:<6} {args.out / (name + '.png')}: {verdict}")
    return int(any(results.values()))


if __name__ == "__main__":
    sys.exit(main())
