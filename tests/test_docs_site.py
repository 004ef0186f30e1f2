"""The documentation site builds with warnings as errors, shows every notebook's figures, and
has no broken internal link.

One Sphinx build (the README's command, into a temporary folder) is shared by the checks.
Notebooks are not executed by the build: it renders the outputs committed with them, so the
last check holds those outputs to being complete.
"""
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
IMAGE_TYPES = ("image/png", "image/svg+xml")


class _Page(HTMLParser):
    """Collects the ids a page defines and the local links and images it uses."""

    def __init__(self):
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []
        self.images: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and not urlsplit(a[key]).scheme and not a[key].startswith("//"):
                self.links.append(a[key])
        if tag == "img" and a.get("src"):
            self.images.append(a["src"])


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> dict[Path, _Page]:
    out = tmp_path_factory.mktemp("site") / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-c", "docs", ".", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, f"docs build failed:\n{build.stdout}\n{build.stderr}"
    pages = {}
    for path in out.rglob("*.html"):
        page = _Page()
        page.feed(path.read_text(encoding="utf-8"))
        pages[path.resolve()] = page
    return pages


def _page(site, rel: str) -> tuple[Path, _Page]:
    hits = [(p, page) for p, page in site.items() if p.parent.name + "/" + p.name == rel
            or (p.name == rel and "/" not in rel and (p.parent / "_static").is_dir())]
    assert len(hits) == 1, f"{rel}: {len(hits)} built pages"
    return hits[0]


def test_every_page_and_the_reference_are_built(site):
    for rel in ["index.html", "docs/api.html"] + [
            f"docs/{p.stem}.html" for p in sorted((ROOT / "docs").glob("*.md"))] + [
            f"notebooks/{p.stem}.html" for p in NOTEBOOKS]:
        _page(site, rel)
    _, api = _page(site, "docs/api.html")
    import triax
    for name in triax.__all__:                 # every public name has its entry
        assert {f"triax.{name}", f"module-triax.{name}"} & api.ids, \
            f"triax.{name} is missing from the API reference"
    assert "triax.pipeline.build" in api.ids


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_pages_show_their_figures(site, nb_path):
    nb = nbformat.read(nb_path, as_version=4)
    want = sum(any(t in o.get("data", {}) for t in IMAGE_TYPES)
               for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    path, page = _page(site, f"notebooks/{nb_path.stem}.html")
    shown = [src for src in page.images if (path.parent / unquote(src)).is_file()
             or src.startswith("data:image/")]
    assert len(shown) == want, (f"{nb_path.name}: the page shows {len(shown)} images, the "
                                f"notebook's outputs hold {want}")


def test_every_internal_link_resolves(site):
    broken = []
    for path, page in site.items():
        for link in page.links:
            parts = urlsplit(link)
            if link.startswith("data:") or parts.scheme:
                continue
            target = (path.parent / unquote(parts.path)).resolve() if parts.path else path
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{path.name}: {link} (no file)")
            elif parts.fragment and target.suffix == ".html" and \
                    unquote(parts.fragment) not in site[target].ids:
                broken.append(f"{path.name}: {link} (no anchor)")
    assert not broken, "broken links:\n" + "\n".join(sorted(set(broken))[:40])


@pytest.mark.parametrize("nb_path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebooks_are_committed_executed(nb_path):
    """The site renders committed outputs: refresh them with ``notebooks/execute.py``."""
    nb = nbformat.read(nb_path, as_version=4)
    unrun = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()
             and c.execution_count is None]
    failed = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"
              and any(o.output_type == "error" for o in c.outputs)]
    assert not unrun and not failed, (
        f"{nb_path.name}: cells {unrun} have no outputs committed, cells {failed} an error; "
        f"run `python notebooks/execute.py {nb_path.relative_to(ROOT)}`")
