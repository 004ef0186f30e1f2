"""The shell examples of ``README.md`` and ``docs/*.md``, read the way a reader copies them.

A fenced ``bash``/``sh``/``console`` block is one example. The line just above its fence may
carry one marker, an HTML comment the rendered page does not show:

- ``<!-- doc-commands: short -->``: run it shortened, as :func:`shortened` says (fewer
  ``--steps``, fewer ``--max-new-tokens``, ``--port`` a free one);
- ``<!-- doc-commands: skip: WHY -->``: not runnable on this machine, and why (a cluster, a
  model that is not in the repository, a server another block starts).

Everything else runs exactly as written.
"""
from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")))
_FENCE = re.compile(r"^```(bash|sh|shell|console)\s*$")
_MARKER = re.compile(r"^<!-- doc-commands: (short|skip: (?P<why>.+?)) -->$")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str        # relative to the repository root
    line: int        # the fence's line, 1-based
    marker: str      # "", "short" or "skip"
    why: str         # a skip's reason
    lines: tuple[str, ...]

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    def commands(self) -> list[str]:
        """The block's commands, continuation lines joined, comment-only lines dropped."""
        out, cmd = [], ""
        for line in self.lines:
            s = line.rstrip()
            if s.endswith("\\"):
                cmd += s[:-1] + " "
                continue
            cmd = (cmd + s).strip()
            if not _closed(cmd):          # a quoted argument spans lines
                cmd += "\n"
                continue
            if cmd and not cmd.startswith("#"):
                out.append(cmd)
            cmd = ""
        return out


def _closed(command: str) -> bool:
    try:
        shlex.split(command, comments=True)
    except ValueError:
        return False
    return True


def blocks(pages=PAGES) -> list[Block]:
    found = []
    for page in pages:
        lines = page.read_text(encoding="utf-8").splitlines()
        i = 0
        while i < len(lines):
            if _FENCE.match(lines[i]):
                end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
                marker = _MARKER.match(lines[i - 1].strip()) if i else None
                kind = "" if marker is None else marker.group(1).split(":")[0]
                found.append(Block(str(page.relative_to(ROOT)), i + 1, kind,
                                   (marker.group("why") or "") if marker else "",
                                   tuple(lines[i + 1:end])))
                i = end
            i += 1
    return found


def triax_argv(command: str) -> list[str] | None:
    """The argument list after ``triax`` when ``command`` runs the CLI (``srun``, environment
    assignments and a trailing ``&`` or comment allowed), else None."""
    words = shlex.split(command, comments=True)
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] == "srun"):
        words = words[1:]
    if words and words[-1] == "&":
        words = words[:-1]
    if not words or Path(words[0]).name != "triax":
        return None
    return words[1:]


def _set(argv: list[str], flag: str, value) -> list[str]:
    if flag in argv:
        i = argv.index(flag)
        return argv[:i + 1] + [str(value)] + argv[i + 2:]
    return argv + [flag, str(value)]


def shortened(argv: list[str], port: int | None = None) -> list[str]:
    """A ``short`` block's command: ``train`` runs ``--steps`` N // 100 (at least 2) and
    ``generate``/``serve`` ``--max-new-tokens`` at most 4; ``serve`` listens on ``port``."""
    if not argv:
        return argv
    if argv[0] == "train":
        steps = int(argv[argv.index("--steps") + 1]) if "--steps" in argv else 200
        argv = _set(argv, "--steps", max(2, steps // 100))
    if argv[0] == "generate" and "--max-new-tokens" in argv:
        n = int(argv[argv.index("--max-new-tokens") + 1])
        argv = _set(argv, "--max-new-tokens", min(n, 4))
    if argv[0] == "serve" and port is not None:
        argv = _set(_set(argv, "--port", port), "--host", "127.0.0.1")
    return argv
