"""Every docstring example in the package runs, on the suite's 8 simulated CPU devices.

Modules are found with ``pkgutil.walk_packages`` (a new module is picked up without editing
this file); each one with a ``>>>`` example is one test, run by ``doctest`` against that
module's own globals, from an empty temporary directory so no example can write into the
repository. A line that needs files or the network carries ``# doctest: +SKIP``.
"""
import doctest
import importlib
import pkgutil
from pathlib import Path

import pytest

import triax

# Importing these runs a program, not a library module.
NOT_LIBRARY = {"triax.__main__"}
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules_with_examples() -> list[str]:
    root = Path(triax.__path__[0])
    names = []
    for m in pkgutil.walk_packages(triax.__path__, "triax."):
        if m.name in NOT_LIBRARY:
            continue
        rel = Path(*m.name.split(".")[1:])
        path = root / rel / "__init__.py" if m.ispkg else root / rel.with_suffix(".py")
        if ">>>" in path.read_text(encoding="utf-8"):
            names.append(m.name)
    return sorted(names)


MODULES = _modules_with_examples()


def test_examples_are_found():
    assert "triax.units" in MODULES and "triax.planner.recommend" in MODULES, MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    module = importlib.import_module(name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    out: list[str] = []
    tried = 0
    for t in finder.find(module, name):
        tried += runner.run(t, out=out.append).attempted
    failed = runner.summarize(verbose=False).failed
    assert tried, f"{name} has '>>>' in its source but doctest found no example to run"
    assert not failed, f"{failed} docstring example(s) of {name} failed:\n" + "".join(out)
