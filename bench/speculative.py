"""Speculative decoding (``--speculative ngram|draft``) against plain decoding, in-process.

Two workloads of greedy requests, all queued at once, served by one replica on one CPU device:

* *repetitive*: a passage of the training text followed by a newline and the passage's first
  16 tokens, so the answer that continues it quotes the prompt (an edit of a code block, a
  summary that quotes its source);
* *random*: random byte prompts (nothing to look up; a draft only guesses).

Each is served without speculation, with ``ngram`` (prompt lookup) and with ``draft``: tokens
per second of decode (the server's counters; the faster of two runs after a warm-up and one
untimed run, so every program is compiled), the acceptance rate (accepted ÷ proposed) and
the mean accepted length (tokens a row emits per verify step, the bonus token included).
Greedy tokens are checked equal to plain decoding's.

The target and the draft are trained here on the same data (the pydoc corpus): the target
``tiny`` (4 layers), the draft ``tiny --num-layers 1``, each for 400 steps of 16 × 128 tokens:

    triax train --model tiny --mesh data=2 --strategy dp --steps 400 --batch-size 16 \\
        --seq-len 128 --data pydoc --checkpoint-dir ckpt/target --checkpoint-every 400
    triax train --model tiny --num-layers 1 ... --checkpoint-dir ckpt/draft
    python bench/speculative.py --target ckpt/target --draft ckpt/draft
    python bench/speculative.py --smoke        # random weights, few requests: the script runs

CPU figures rank only. On a GPU, decode is bound by reading the weights and KV cache per
step, so verifying k+1 positions costs about one decode step: run the same script on the
device with ``--device gpu`` (a bigger target, e.g. ``--target`` a checkpoint of ``small``
and its draft, ``--slots 1`` and ``--slots 32`` to show the large-batch case).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "gpu" not in sys.argv:   # --device gpu: the accelerator JAX finds
    os.environ.setdefault("JAX_NUM_CPU_DEVICES", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from tables import BENCHMARKS_MD, write_section  # noqa: E402

from triax.inference.checkpoint import load_params  # noqa: E402
from triax.inference.draft_proposer import DraftWeights, draft_for  # noqa: E402
from triax.inference.engine import EngineConfig  # noqa: E402
from triax.inference.server import Server  # noqa: E402
from triax.inference.speculative import SpeculativeConfig, attach  # noqa: E402
from triax.mesh import make_mesh  # noqa: E402
from triax.text.byte_tokenizer import ByteTokenizer  # noqa: E402
from triax.training.data import pydoc_text  # noqa: E402


NOTES = """\
How the models were made: `triax train --model tiny --mesh data=2 --strategy dp --steps 400 \
--batch-size 16 --seq-len 128 --data pydoc` (the target; validation loss 1.41), the same with
`--num-layers 1` (the draft; 1.50): the same data and tokenizer, a quarter of the depth.
Greedy tokens are checked equal to plain decoding's in every row. The acceptance rates and
mean accepted lengths are deterministic (greedy) and carry over; the tok/s ratios rank only:
on this shared 2-core CPU the same script's `off` rows moved by 2× between runs, and a CPU
step's time grows with the positions it computes (every step is compute-bound, the large-batch
regime of docs/serving.md), so a verify of k + 1 positions and a draft's k sequential steps
cost more here than on a GPU. `ngram` finds little on *repetitive*: this 4-layer target,
trained 400 steps, seldom copies the quoted passage verbatim; after *random* prompts it falls
into loops that prompt lookup predicts. **Not met**: a GPU measurement (this task had no
device). On a GPU the decode step of a small batch is bound by reading the weights, so
verifying k + 1 positions costs about one step; the run that would show it is
`python bench/speculative.py --device gpu --target CKPT --draft CKPT` on one GPU with a
target large enough to be read-bound (e.g. `small` or `llama3-1b`, trained or imported, and
a 1–2 layer draft trained on the same data), at `--slots 1`, `4` and `32` (the last to show
the large-batch loss): bench/gpu_mfu.py's pattern, the same script on the device's own
platform."""


def workloads(n: int, seed: int = 0) -> dict:
    """``{name: [prompt, ...]}``: quoting passages of the corpus, and random bytes."""
    rng = np.random.default_rng(seed)
    text = ByteTokenizer().encode(pydoc_text())
    rep = []
    for start in rng.integers(0, len(text) - 200, n):
        passage = list(text[start:start + 48])
        rep.append(passage + [10] + passage[:16])
    rand = [rng.integers(32, 127, 64).tolist() for _ in range(n)]
    return {"repetitive": rep, "random": rand}


def serve(server: Server, prompts, new: int) -> dict:
    def once():
        before = dict(server.stats)
        spec0 = server.speculative_stats
        ids = [server.submit(p, new) for p in prompts]
        res = server.run()
        st = {k: server.stats[k] - before[k] for k in ("decode_tokens", "decode_s")}
        spec = {k: v - spec0[k] for k, v in server.speculative_stats.items()}
        return [res[i].tokens for i in ids], st, spec
    server.warmup(sorted({len(p) for p in prompts}))   # every program, speculative ones too
    once()                       # and any the warm-up does not reach
    runs = [once() for _ in range(2)]   # the faster of two: the CPU is shared
    tokens, st, spec = max(runs, key=lambda r: r[1]["decode_tokens"] / r[1]["decode_s"])
    return {"tokens": tokens, "tok_s": st["decode_tokens"] / max(st["decode_s"], 1e-9),
            "rate": spec["accepted"] / spec["proposed"] if spec["proposed"] else None,
            "mean": 1 + spec["accepted"] / spec["rounds"] if spec["rounds"] else None}


def run(args) -> str:
    mesh = make_mesh(devices=jax.devices()[:1])
    if args.smoke:
        cfg, params = load_params(mesh, model="tiny", seed=0, strategy="tp", num_layers=2)
        dcfg, dparams = load_params(mesh, model="tiny", seed=1, strategy="tp", num_layers=1)
    else:
        cfg, params = load_params(mesh, checkpoint=args.target, strategy="tp")
        dcfg, dparams = load_params(mesh, checkpoint=args.draft, strategy="tp")
    ecfg = EngineConfig(max_batch=args.slots, max_len=128, min_bucket=16)
    rows = []
    for name, prompts in workloads(args.requests).items():
        base = None
        for method in ("off", "ngram", "draft"):
            server = Server.from_params(cfg, params, [mesh], "tp", ecfg)
            if method != "off":
                attach(server.engines, SpeculativeConfig(
                    method, args.k, "draft" if method == "draft" else None),
                    draft_for(DraftWeights(dcfg, dparams)) if method == "draft" else None)
            t0 = time.perf_counter()
            got = serve(server, prompts, args.new_tokens)
            base = base or got
            same = np.mean([a == b for a, b in zip(got["tokens"], base["tokens"])])
            rows.append((name, method, got, got["tok_s"] / base["tok_s"], same))
            print(f"{name:10s} {method:5s} {got['tok_s']:8.1f} tok/s  rate={got['rate']}  "
                  f"mean={got['mean']}  same={same:.0%}  ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
    fmt = lambda x, f: "—" if x is None else format(x, f)  # noqa: E731
    lines = [f"`{cfg.name}` target ({cfg.num_layers} layers) and a {dcfg.num_layers}-layer "
             f"draft, both trained here on the pydoc corpus (bench/speculative.py's "
             f"docstring); 1 CPU device, {args.slots} slots, k = {args.k}; {args.requests} "
             f"greedy requests of {args.new_tokens} tokens per workload, queued at once; "
             f"`python bench/speculative.py --target ckpt/target --draft ckpt/draft`.", "",
             "| workload | speculative | decode tok/s | ÷ off | acceptance rate | "
             "mean accepted length | greedy tokens equal to off |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, method, got, ratio, same in rows:
        lines.append(f"| {name} | {method} | {got['tok_s']:.0f} | {ratio:.2f}× | "
                     f"{fmt(got['rate'], '.0%')} | {fmt(got['mean'], '.2f')} | {same:.0%} |")
    return "\n".join(lines + ["", NOTES])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", help="training checkpoint of the target")
    p.add_argument("--draft", help="training checkpoint of the draft (same vocabulary)")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--device", default="cpu", help="cpu (default) or gpu: the platform JAX uses")
    p.add_argument("--smoke", action="store_true", help="random weights, 4 requests")
    args = p.parse_args()
    if args.smoke:
        args.requests, args.new_tokens = 4, 16
    elif not (args.target and args.draft):
        p.error("give --target and --draft checkpoints (or --smoke)")
    table = run(args)
    print(table)
    if not args.smoke:
        write_section(BENCHMARKS_MD, "## Speculative decoding", table)


if __name__ == "__main__":
    main()
