"""``triax plot FILE.jsonl``: loss and throughput curves from a ``--log-json`` file to PNG.

    triax plot run.jsonl                 # writes run.png
    triax plot run.jsonl -o curves.png
"""
from __future__ import annotations

import json
import os


def add_parser(sub) -> None:
    p = sub.add_parser("plot", help="plot loss and throughput from a --log-json file",
                       description=__doc__)
    p.add_argument("file", help="JSONL written by triax train --log-json")
    p.add_argument("-o", "--output", help="PNG path (default: FILE with .png)")
    p.set_defaults(func=run)


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"metrics file {path!r} does not exist")
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{n}: not JSON ({e})") from None
    if not rows or "step" not in rows[0] or "loss" not in rows[0]:
        raise ValueError(f"{path!r} holds no step/loss records (write it with --log-json)")
    return rows


def plot(rows: list[dict], output: str) -> str:
    """Two panels: training (and validation) loss; tokens/s per step."""
    # A Figure outside pyplot: no global backend switch for a caller that also draws on screen.
    from matplotlib.figure import Figure
    fig = Figure(figsize=(11, 4))
    ax1, ax2 = fig.subplots(1, 2)
    ax1.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train")
    val = [(r["step"], r["val_loss"]) for r in rows if r.get("val_loss") is not None]
    if val:
        ax1.plot(*zip(*val), "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss", title="loss")
    ax1.legend()
    tput = [(r["step"], r["tokens_per_s"]) for r in rows if r.get("tokens_per_s")]
    ax2.plot(*zip(*tput))
    ax2.set(xlabel="step", ylabel="tokens / s", title="throughput")
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    return output


def run(args) -> int:
    rows = read_jsonl(args.file)
    out = plot(rows, args.output or os.path.splitext(args.file)[0] + ".png")
    print(f"wrote {out}")
    return 0
