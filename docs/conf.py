"""Sphinx configuration for the triax documentation site (Sphinx + MyST-NB, like JAX and Flax).

The source folder is the repository root, so the links between README.md, docs/*.md and
notebooks/*.ipynb are the same on GitHub and on the site. Build (warnings are errors)::

    sphinx-build -W --keep-going -c docs . docs/_build/html

Notebooks are not executed here: their committed outputs (refreshed by
``notebooks/execute.py``, and checked by the notebook tests) are rendered as they are.
"""
import os

from sphinx.util import logging

# The reference imports triax (installed, or on PYTHONPATH); keep JAX on the CPU here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

project = "triax"
author = "triax authors"
copyright = "triax authors"

extensions = ["myst_nb", "sphinx.ext.autodoc"]
root_doc = "index"
include_patterns = ["index.md", "docs/*.md", "notebooks/*.ipynb"]
# Hidden folders (.venv, .git, .pytest_cache) are not walked: Sphinx lists every file below
# the source folder to match it against include_patterns, a virtual environment's too.
exclude_patterns = ["docs/_build", ".*"]

html_theme = "furo"
html_title = "triax"

myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3
# Committed outputs: CI executes each notebook once, in pytest (notebooks/conftest.py), and
# tests/test_docs_site.py rejects a notebook committed unexecuted or with an error output.
nb_execution_mode = "off"
nb_merge_streams = True

nitpicky = True                     # every unresolved cross-reference is an error
# Types from other libraries (no network at build time, so no intersphinx inventories).
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jaxlib|flax|nnx|optax|orbax|numpy|np|jnp|pathlib|collections|typing|"
               r"dataclasses|enum|argparse|concurrent)(\..*)?"),
    (r"py:.*", r"(Path|Mesh|Array|ArrayLike|NamedSharding|PartitionSpec|ShapeDtypeStruct|"
               r"Callable|Iterable|Iterator|Sequence|Mapping|Any|Optional|Literal)"),
    # A type annotation naming a triax class outside the reference renders as plain text;
    # explicit references (:func:, :class: in prose, Markdown links) must still resolve.
    (r"py:class", r"triax\..*"),
]
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": True}


def _require_docstrings(app, what, name, obj, options, lines):
    """Missing docstrings on the public API are errors (the build runs with -W)."""
    if what in ("function", "class", "method", "property") and not lines \
            and not name.split(".")[-1].startswith("_"):
        logging.getLogger(__name__).warning(f"public API {name} has no docstring")


def setup(app):
    app.connect("autodoc-process-docstring", _require_docstrings)
