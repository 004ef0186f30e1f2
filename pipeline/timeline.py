"""Draw a schedule: ticks across, stages down, F/B/B_in/W/F&B coloured (an F&B cell names its
forward's micro-batch, then its backward's), bubbles left blank.

matplotlib is imported only when drawing, so the schedules stay importable without it.

    >>> import pathlib, tempfile
    >>> from triax.pipeline import build
    >>> fig = draw(build("zb-h1", stages=4, microbatches=8))
    >>> path = save(build("1f1b", 4, 8), pathlib.Path(tempfile.mkdtemp()) / "1f1b.svg")
    >>> path.suffix                                   # PNG or SVG by suffix
    '.svg'
"""
from __future__ import annotations

from pathlib import Path

from triax.pipeline.schedules import OpKind, Schedule

COLORS = {OpKind.F: "#4C72B0", OpKind.B: "#DD8452", OpKind.B_IN: "#C44E52",
          OpKind.W: "#55A868", OpKind.FB: "#8172B3"}
LABELS = {OpKind.F: "F", OpKind.B: "B", OpKind.B_IN: "B_in", OpKind.W: "W", OpKind.FB: "FB"}


def draw(sched: Schedule, ax=None, title: str | None = None):
    """Draw onto ``ax`` (a new figure if None); returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    if ax is None:
        _, ax = plt.subplots(figsize=_figsize(sched))
    for t, row in enumerate(sched.table):
        for s, op in enumerate(row):
            if op is None:
                continue
            shade = 1.0 - 0.35 * (op.chunk // sched.stages) / max(1, sched.virtual - 1)
            ax.add_patch(_cell(t, s, COLORS[op.kind], shade))
            mb = str(op.mb) if op.kind is not OpKind.FB else f"{op.mb}|{op.b_mb}"
            ax.text(t + 0.5, s + 0.5, mb, ha="center", va="center",
                    fontsize=7 if op.kind is not OpKind.FB else 5, color="white")
    ax.set_xlim(0, sched.ticks)
    ax.set_ylim(sched.stages, 0)
    ax.set_yticks([s + 0.5 for s in range(sched.stages)],
                  [f"stage {s}" for s in range(sched.stages)])
    ax.set_xlabel("tick")
    used = sorted({op.kind for row in sched.table for op in row if op is not None})
    ax.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in used],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    v = f", v={sched.virtual}" if sched.virtual > 1 else ""
    ax.set_title(title or f"{sched.kind.value}: S={sched.stages}, M={sched.microbatches}{v}, "
                          f"bubble {sched.bubble_fraction():.1%}, "
                          f"peak in flight {sched.peak_in_flight}", fontsize=9)
    ax.figure.tight_layout()
    return ax.figure


def _figsize(sched: Schedule) -> tuple[float, float]:
    return max(6.0, 0.28 * sched.ticks), 0.45 * sched.stages + 1.2


def _cell(t, s, color, shade):
    from matplotlib.colors import to_rgb
    from matplotlib.patches import Rectangle
    rgb = tuple(c * shade for c in to_rgb(color))
    return Rectangle((t + 0.03, s + 0.05), 0.94, 0.9, color=rgb)


def save(sched: Schedule, path: "str | Path") -> Path:
    """Write the timeline as PNG or SVG (by the file suffix)."""
    path = Path(path)
    if path.suffix.lower() not in (".png", ".svg"):
        raise ValueError(f"timeline file {str(path)!r}: use a .png or .svg suffix")
    # A Figure outside pyplot: no backend switch, so a notebook that saves still shows its plots.
    from matplotlib.figure import Figure
    fig = Figure(figsize=_figsize(sched))
    draw(sched, ax=fig.subplots())
    fig.savefig(path, dpi=120)
    return path
