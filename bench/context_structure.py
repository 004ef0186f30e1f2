"""Context parallelism's structural figures, from compiled programs (deterministic: no timing):
attention FLOPs per context rank of the ring (its forward and backward alone, tiny's heads,
T = 8·C) for the zigzag and contiguous layouts, and the compiled temporaries per device of
tiny's training step (1 layer, batch 1, seq 8192) by scheme and context size.

The table goes into docs/long_context.md (section "Measured"); tests/test_ring_attention.py
holds the same facts as bounds.

    JAX_NUM_CPU_DEVICES=8 python bench/context_structure.py             # prints and writes the section
    JAX_NUM_CPU_DEVICES=8 python bench/context_structure.py --no-write
"""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from tables import write_section  # noqa: E402  (bench/ is the script's dir)

from triax.mesh import make_mesh  # noqa: E402
from triax.models import config  # noqa: E402
from triax.models.visibility import Visibility  # noqa: E402
from triax.models.runtime import ExecConfig  # noqa: E402
from triax.sharding.context import context_attention, zigzag_order  # noqa: E402
from triax.sharding.introspect.memory import memory_from_compiled  # noqa: E402
from triax.sharding.introspect.ring_balance import flops_per_rank  # noqa: E402
from triax.sharding.rules import get_strategy  # noqa: E402
from triax.training.step import Trainer  # noqa: E402
from triax.units import human_bytes  # noqa: E402

LONG_CONTEXT_MD = Path(__file__).resolve().parents[1] / "docs" / "long_context.md"
HEADING = "## Measured: balance and memory"
CFG = config.TINY.replace(num_layers=1)


def strategy(scheme: str):
    return dataclasses.replace(get_strategy("dp"), context_attention=scheme)


def ring_flops(C: int, layout: str) -> np.ndarray:
    T = 8 * C
    mesh = make_mesh(context=C, devices=jax.devices()[:C])
    hook = context_attention(mesh, strategy("ring").rules, "ring", layout)
    order = zigzag_order(T, C) if layout == "zigzag" else np.arange(T)
    vis = Visibility.self_attention(jnp.asarray(order, jnp.int32)[None])
    sh = NamedSharding(mesh, P(None, "context"))
    args = [jax.ShapeDtypeStruct((1, T, n, CFG.head_dim), jnp.float32, sharding=sh)
            for n in (CFG.num_heads, CFG.num_kv_heads, CFG.num_kv_heads, CFG.num_heads)]
    f = jax.jit(jax.grad(lambda q, k, v, w: jnp.sum(hook(q, k, v, vis, "auto") * w),
                         argnums=(0, 1, 2)))
    return np.array(flops_per_rank(f.lower(*args).compile(), layout, C))


def temps(C: int, scheme: str, attention: str, T: int) -> int:
    tr = Trainer(CFG.replace(max_seq_len=T), make_mesh(context=C, devices=jax.devices()[:C]),
                 strategy(scheme), exe=ExecConfig(attention=attention))
    return memory_from_compiled(tr.lower(1, T).compile()).temp_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2,4,8")
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--no-write", action="store_true")
    a = ap.parse_args()
    Cs = [int(c) for c in a.contexts.split(",")]
    rows = ["| context | layout | FLOPs per rank (forward + backward) | max ÷ mean |",
            "|---|---|---|---|"]
    for C in Cs:
        for layout in ("zigzag", "contiguous"):
            f = ring_flops(C, layout)
            rows.append(f"| {C} | {layout} | {', '.join(str(int(x)) for x in f)} | "
                        f"{f.max() / f.mean():.3f} |")
    one = {att: temps(1, "ring", att, a.seq) for att in ("auto", "blockwise")}
    mem = ["| context | scheme | attention | temporaries per device | ÷ context=1 (auto) | "
           "÷ context=1 (blockwise) |", "|---|---|---|---|---|---|"]
    mem += [f"| 1 | (none) | {att} | {human_bytes(b)} | {b / one['auto']:.3f} | "
            f"{b / one['blockwise']:.3f} |" for att, b in one.items()]
    for C in Cs:
        for scheme in ("ring", "all-gather"):
            b = temps(C, scheme, "auto", a.seq)
            mem.append(f"| {C} | {scheme} | auto | {human_bytes(b)} | {b / one['auto']:.3f} | "
                       f"{b / one['blockwise']:.3f} |")
    body = "\n".join([
        HEADING, "",
        "Attention FLOPs per context rank, read from the compiled HLO of the ring's forward "
        "and backward alone (tiny's heads, T = 8·C, fp32; `sharding.introspect.ring_balance`"
        "):", "", *rows, "",
        "Rank i's figure is the local block plus, per ring step, the branch it takes. "
        "Contiguous: rank i computes i + 1 blocks, max ÷ mean about 2C/(C+1) (a little above: "
        "at this size XLA merges the local block's recomputed scores in the backward with the "
        "forward's, so the local block costs one matmul less than a ring step's whole block). "
        "Zigzag: every rank computes its local block and C−1 half blocks.", "",
        f"Compiled temporaries per device of tiny's training step (1 layer, batch 1, seq "
        f"{a.seq}, fp32; `memory_analysis()`). `auto` is the reference kernel on CPU; the "
        f"ring runs its own tiles whatever `--attention` says:", "", *mem, "",
        "The ring's temporaries fall as 1/C (each step's scores are [B, N, T/C, 512]); the "
        "all-gather scheme's too here, but with `auto` it materialises [B, N, T/C, T] "
        "scores, and with a larger K·H it also holds the whole gathered K/V.", "",
        "Regenerate: `JAX_NUM_CPU_DEVICES=8 python bench/context_structure.py`."])
    print(body)
    if not a.no_write:
        write_section(LONG_CONTEXT_MD, HEADING, body)


if __name__ == "__main__":
    main()
