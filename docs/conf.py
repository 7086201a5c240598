"""Sphinx configuration of mc's documentation site (``hatch run docs`` → ``docs/_build/html``).

Why Sphinx: mc's docstrings are already written for it (``:class:``, ``:func:`` and
``:data:`` roles everywhere), it is what PyTorch and Megatron-Core build their references
with (a reader finds the same layout: a page per module, each signature with its
parameters), autodoc reads the signatures from the imported code, so they are the ones
Python sees, and its nitpicky mode turns every cross-reference that does not resolve into a
warning, which ``-W`` makes an error. The guides stay markdown (MyST), so the same files
read well on GitHub. MkDocs + mkdocstrings was the alternative: it has no equivalent of
nitpicky reference checking across the docstrings' existing reST roles.

The API pages are generated at each build from the packages' ``__all__``
(``docs/_ext/mc_api.py``); they are not committed.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "mc"
author = "the mc authors"
copyright = "the mc authors"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",  # the docstrings' Args: / Attributes: / Returns: sections
    "myst_parser",
    "mc_api",
]

source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
# spec/ is the Megatron-Core contract as text (read by scripts/gen_compatibility.py);
# bad_inputs_sweep.md is the sweep's full log, linked from the failures page.
exclude_patterns = ["_build", "spec", "_ext"]

# Every reference must resolve: an unknown name, page or anchor is a warning, and the build
# runs with -W (warnings are errors). References into torch and the standard library have
# no target here (the build is offline, no intersphinx), so those are the only ones ignored.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|typing|typing_extensions|collections|abc|enum|dataclasses|logging)\..*"),
    (r"py:.*", r"(types|contextlib|threading|pathlib|weakref|multiprocessing|concurrent)\..*"),
    (r"py:.*", r"(numpy|pytest|_pytest|datetime|os|re|io|inspect|functools)\..*"),
    (r"py:.*", r"(int|float|str|bool|bytes|object|None|type|list|dict|tuple|set|frozenset)"),
    (r"py:.*", r"(Ellipsis|NotImplemented|BaseException|Exception|ValueError|TypeError)"),
    (r"py:.*", r"(RuntimeError|NotImplementedError|KeyError|IndexError|TimeoutError)"),
    (r"py:.*", r"(Tensor|torch)"),
]

autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_class_signature = "mixed"
autodoc_default_options = {"show-inheritance": True}
autodoc_preserve_defaults = True
autosummary_generate = False
napoleon_numpy_docstring = False
# The types of "Attributes:" entries come from the class signature, shown above them
napoleon_attr_annotations = False

myst_heading_anchors = 3
# Literal blocks in docstrings are tables and diagrams, not Python
highlight_language = "none"
myst_enable_extensions = ["colon_fence"]
# bad_inputs_sweep.md (generated) steps from H2 to H4 in its per-case sections
suppress_warnings = ["myst.header"]

html_theme = "furo"
html_title = "mc documentation"
html_static_path: list[str] = []
html_show_sourcelink = False
