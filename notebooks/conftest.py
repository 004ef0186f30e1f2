"""Each notebook here is one test: it runs top to bottom, and every cell that draws shows it.

``pytest notebooks`` collects ``*.ipynb`` (one file, one test, so ``--dist loadfile`` spreads
notebooks over workers); the work is in ``execute.py`` next to this file.
"""
import sys
from pathlib import Path

import pytest

from execute import check

# The kernels inherit the suite's environment (tests/suite_env.py), also when run alone.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from suite_env import apply  # noqa: E402

apply(devices=False)


def pytest_collect_file(file_path: Path, parent):
    if file_path.suffix == ".ipynb" and not file_path.name.startswith("."):
        return NotebookFile.from_parent(parent, path=file_path)
    return None


class NotebookFile(pytest.File):
    def collect(self):
        yield NotebookItem.from_parent(self, name=self.path.name)


class NotebookItem(pytest.Item):
    def runtest(self):
        check(self.path)

    def reportinfo(self):
        return self.path, 0, f"notebook {self.path.name}"
