"""Execute a notebook with nbclient and check that every cell that draws shows its figure.

A cell *draws* when it creates a pyplot figure. To know which cells do, the notebook runs with
two kinds of hidden cells: one before everything that counts ``pyplot.figure`` calls (every
pyplot constructor goes through it), and a probe after each code cell that prints the count
and resets it. The probes are removed again, so the notebook returned is the notebook as a
reader runs it, outputs included. A cell that drew but has no ``image/png`` or
``image/svg+xml`` output is what ``matplotlib.use("Agg")`` (or a closed figure) causes: the
reader opens the notebook and sees no picture.

Used by ``notebooks/conftest.py`` (each notebook is one test) and, to refresh the outputs
committed with the notebooks (so the repository and the docs site show the pictures)::

    python notebooks/execute.py notebooks/02_pipeline_schedules.ipynb   # rewrites it in place
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

IMAGE_TYPES = ("image/png", "image/svg+xml")
# A notebook may ask for more time per cell, as nbmake reads it: metadata.execution.timeout.
DEFAULT_TIMEOUT_S = 600
_TAG = "triax-notebook-probe"
_SETUP = f"""\
import matplotlib.pyplot as _triax_plt
_triax_made = [0]
def _triax_counting(figure):
    def counted(*args, **kwargs):
        _triax_made[0] += 1
        return figure(*args, **kwargs)
    return counted
_triax_plt.figure = _triax_counting(_triax_plt.figure)
"""
_PROBE = f"print('{_TAG}', _triax_made[0]); _triax_made[0] = 0"
_PROBE_RE = re.compile(rf"{_TAG} (\d+)")


def execute(path: "str | Path") -> tuple[nbformat.NotebookNode, dict[int, int]]:
    """Run the notebook from its own folder; return it executed and {cell index: figures made}.

    Raises nbclient's ``CellExecutionError`` (naming the cell) when a cell fails.
    """
    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    timeout = nb.metadata.get("execution", {}).get("timeout", DEFAULT_TIMEOUT_S)
    probed = copy.deepcopy(nb)
    cells, origin = [nbformat.v4.new_code_cell(_SETUP)], [None]
    for i, cell in enumerate(nb.cells):
        cells.append(cell), origin.append(i)
        if cell.cell_type == "code":
            cells.append(nbformat.v4.new_code_cell(_PROBE)), origin.append(("probe", i))
    probed.cells = cells
    NotebookClient(probed, timeout=timeout, kernel_name="python3", coalesce_streams=True,
                   resources={"metadata": {"path": str(path.parent)}}).execute()

    figures, count = {}, 0
    for cell, where in zip(probed.cells, origin):
        if isinstance(where, tuple):
            text = "".join(o.get("text", "") for o in cell.outputs)
            figures[where[1]] = int(_PROBE_RE.search(text).group(1))
        elif where is not None:
            if cell.cell_type == "code":            # number cells as a reader's run would
                count += 1
                cell.execution_count = count
                for out in cell.outputs:
                    if "execution_count" in out:
                        out.execution_count = count
            nb.cells[where] = cell
    return nb, figures


def missing_images(nb: nbformat.NotebookNode, figures: dict[int, int]) -> list[int]:
    """Indices of cells that made a figure but show no image output."""
    return [i for i, made in sorted(figures.items())
            if made and not any(t in out.get("data", {}) for out in nb.cells[i].outputs
                                for t in IMAGE_TYPES)]


def check(path: "str | Path") -> nbformat.NotebookNode:
    """Execute ``path``; raise AssertionError naming every drawing cell without an image."""
    nb, figures = execute(path)
    missing = missing_images(nb, figures)
    if missing:
        raise AssertionError(
            f"{path}: cells {missing} (0-based) draw a figure but show no image output; "
            "remove matplotlib.use('Agg') and let the figure reach the notebook "
            "(plt.show(), or leave it open at the end of the cell)")
    return nb


if __name__ == "__main__":
    for name in sys.argv[1:]:
        nbformat.write(check(name), name)
        print(f"{name}: executed, outputs written")
