"""The package's layers, named once (``LAYERS``), and the imports between them checked.

Every module of the package (not tests/, bench/, notebooks/, docs/) is parsed with ``ast``;
every import counts, function-level ones included (they run too, only later), except those
under ``if TYPE_CHECKING:``. Importing ``triax.a.b`` also runs ``triax/a/__init__.py``, so an
import reaches the packages above its target as well (those the importer is not itself
inside: they are already running). Two rules:

* no import circle (Tarjan's strongly connected components), function-level or not;
* no import from a lower layer to a higher one (within a layer, any acyclic import).

docs/architecture.md ("Layers") describes the table below; this file is its home.
"""
from __future__ import annotations

import ast

import pytest
from package_files import modules

# Lowest first. ``p`` names module p and those below it, ``p.*`` only those below it; a
# module belongs to the layer of its longest matching entry.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("triax", "triax.units", "triax.choices", "triax.text", "triax.mesh",
              "triax.private_jax", "triax.memo_on_disk")),
    ("models", ("triax.models",)),
    ("sharding and pipeline", ("triax.sharding", "triax.pipeline")),
    # The analytic model counts the KV pool the engine builds, so the pool's one home, its
    # settings and the error it raises sit with it; inference's package loads its names
    # lazily (importing nothing), and the rest of inference is above.
    ("checkpoints, Hugging Face, the analytic model",
     ("triax.checkpoint", "triax.hf", "triax.costs", "triax.inference",
      "triax.inference.kv_pool", "triax.inference.pool_settings", "triax.inference.errors")),
    # serve_config is serve's and generate's config (JAX-free, so the CLI parses with it),
    # which inference.build_server takes and whose sampling defaults are inference's.
    ("training and inference", ("triax.training", "triax.inference.*", "triax.serve_config")),
    ("the planner: search, --plan auto, verify, advice", ("triax.planner",)),
    ("serving", ("triax.serving",)),
    ("command line", ("triax.cli", "triax.__main__")),
)


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(tree: ast.AST):
    """Every import statement, at any depth, but not under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for other in node.orelse:
                yield from _import_nodes(ast.Module(body=[other], type_ignores=[]))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_nodes(node)


def _targets(name: str, is_pkg: bool, node, known: dict) -> set[str]:
    """The triax modules one import statement in module ``name`` runs."""
    if isinstance(node, ast.Import):
        wanted = [a.name for a in node.names]
    else:
        base = node.module or ""
        if node.level:
            here = name.split(".") if is_pkg else name.split(".")[:-1]
            here = here[:len(here) - node.level + 1]
            base = ".".join(here + ([node.module] if node.module else []))
        # `from triax.x import y`: y is a submodule, or a name of triax.x
        wanted = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                  for a in node.names]
    out = set()
    for mod in wanted:
        if not mod.startswith("triax"):
            continue
        while mod not in known and "." in mod:
            mod = mod.rsplit(".", 1)[0]
        parts = mod.split(".")
        # importing triax.a.b runs triax.a too, unless the importer is already inside it
        for i in range(1, len(parts) + 1):
            pkg = ".".join(parts[:i])
            if pkg in known and pkg != name and not name.startswith(pkg + "."):
                out.add(pkg)
    return out


def import_graph() -> dict[str, set[str]]:
    known = modules()
    graph = {name: set() for name in known}
    for name, path in known.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in _import_nodes(tree):
            graph[name] |= _targets(name, path.name == "__init__.py", node, known)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root), on_stack.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w), on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    found.append(sorted(scc))
    return found


def layer_of(name: str) -> int:
    best, layer = -1, None
    for i, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            below = entry.removesuffix(".*")
            if (name.startswith(below + ".") or (name == entry)) and len(entry) > best:
                best, layer = len(entry), i
    return layer


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in modules() if layer_of(m) is None)
    assert not unplaced, f"modules in no layer of tests/test_layering.py's LAYERS: {unplaced}"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    """The import graph, built once for the checks below (the sources do not change)."""
    return import_graph()


def test_the_walk_sees_function_level_imports(graph):
    """A sanity check of the walk itself: the CLI loads its commands' modules lazily."""
    assert "triax.training.loop" in graph["triax.cli.train_cmd"]
    assert "triax.planner" in graph["triax.cli.plan_cmd"] or any(
        m.startswith("triax.planner.") for m in graph["triax.cli.plan_cmd"])


def test_no_import_circles(graph):
    found = circles(graph)
    assert not found, "import circles (function-level imports included):\n" + "\n".join(
        f"  {len(c)} modules import each other: {', '.join(c)}" for c in found)


def test_no_import_from_a_lower_layer_to_a_higher_one(graph):
    upward = sorted(
        f"  {src} ({LAYERS[layer_of(src)][0]}) imports {dst} ({LAYERS[layer_of(dst)][0]})"
        for src, dsts in graph.items() for dst in dsts if layer_of(dst) > layer_of(src))
    assert not upward, "imports from a lower layer to a higher one:\n" + "\n".join(upward)
