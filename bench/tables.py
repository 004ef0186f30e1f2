"""The one way a bench writes its table into docs/benchmarks.md: replace its ``## heading``
section (up to the next ``## ``) or append it, and leave every other section alone.

    write_section("docs/benchmarks.md", "## Strategies", table_markdown)
"""
from __future__ import annotations

from pathlib import Path

BENCHMARKS_MD = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def write_section(path: str | Path, heading: str, body: str) -> None:
    """Replace (or append) the ``heading`` section of a markdown file with ``body``.

    ``heading`` is the whole ``## ...`` line; ``body`` may start with that line itself (a
    bench that renders its own heading) or without it.
    """
    if not heading.startswith("## "):
        raise ValueError(f"heading {heading!r} must be a second-level markdown heading "
                         f"('## Name')")
    path = Path(path)
    body = body.strip("\n")
    if body.splitlines()[:1] != [heading]:
        body = f"{heading}\n\n{body}"
    old = path.read_text() if path.exists() else "# Benchmarks\n"
    lines = old.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == heading), None)
    if start is None:
        new = old.rstrip("\n") + "\n\n" + body + "\n"
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        rest = "\n".join(lines[end:])
        new = "\n".join(lines[:start]) + ("\n" if start else "") + body + "\n" \
            + ("\n" + rest + "\n" if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(new)
