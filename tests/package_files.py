"""The repository's Python files, walked once here for the tests that read the sources
(``test_layering``, ``test_private_jax``). Hidden folders (``.venv``, ``.git``,
``.pytest_cache``) are not walked at all: a walk of the virtual environment's files cost
most of those tests' time."""
from __future__ import annotations

import os
from pathlib import Path

import triax

ROOT = Path(triax.__file__).parent
NOT_PACKAGE = {"tests", "bench", "notebooks", "docs"}


def python_files(skip: frozenset = frozenset()) -> list[Path]:
    """Every ``*.py`` under the repository root, but in hidden folders and the top-level
    folders named in ``skip``."""
    out = []
    for folder, subfolders, files in os.walk(ROOT):
        here = Path(folder)
        subfolders[:] = [d for d in subfolders if not d.startswith(".")
                         and not (here == ROOT and d in skip)]
        out += [here / f for f in files if f.endswith(".py") and not f.startswith(".")]
    return out


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name (a package by its ``__init__``)."""
    out = {}
    for path in python_files(NOT_PACKAGE):
        parts = ["triax", *path.relative_to(ROOT).with_suffix("").parts]
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out
