"""One executor for every schedule: ``shard_map`` over ``pipe`` (and ``data``), one ``lax.scan``
over the tick table, ``lax.switch`` on each device's op, ``ppermute`` between stages.

Per tick, every stage (1) files the messages that arrived into its inbox slots, (2) runs its
op from the table — idle, F, B, B_in or W — as one ``lax.switch`` branch, so an idle tick
computes nothing, and (3) sends the forward activation to the next stage and the input
gradient to the previous one with ``ppermute``. A forward stashes its pullback's residuals
(parameters excluded) in a slot the program assigned; the backward reads them, adds the
weight gradients to the carry and frees the slot. ``data`` is manual too, so gradients are
summed locally over micro-batches and reduced over ``data`` once per step; ``tensor`` and
``expert`` stay automatic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline.tick_program import COL, TickProgram
from triax.pipeline.schedules import OpKind
from triax.pipeline.stage import Residuals

PIPE, DATA = "pipe", "data"


@dataclass(frozen=True, eq=False)
class StepSpec:
    """Static facts the scan body needs (all Python)."""

    program: TickProgram
    apply: Any                      # stage_apply
    stages: int
    virtual: int
    micro: int                      # micro-batch size per data shard
    dtype: Any


def _slot(i, n):
    return jnp.where(i < 0, n, i)   # -1 → the scratch slot at index n


def _take(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _put(buf, x, i):
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def _branches(spec: StepSpec, res: Residuals | None, zeros_out):
    """Branches ``(inp, acc) -> (acc', out)`` for idle, F, B, B_in, W.

    ``inp`` is read-only (never returned, so XLA does not copy it per tick); ``out`` holds
    what the op produced (zeros where it produced nothing), ``acc`` the gradient sums.
    """
    apply = spec.apply

    def chunk_of(i):
        return jax.tree.map(lambda a: _take(a, i["j"]), i["blocks"])

    def idle(i, acc):
        return acc, zeros_out

    def fwd(i, acc):
        chunk = chunk_of(i)
        if res is None:
            (y, loss), stored = apply(chunk, i["pieces"], i["x_in"], i["extras"]), []
        else:
            (y, loss), stored = res.forward(apply, chunk, i["pieces"], i["x_in"], i["extras"])
        return acc, {**zeros_out, "res": stored, "msg_f": y.astype(spec.dtype), "loss": loss}

    def grads(i, dy):
        chunk = chunk_of(i)
        pb = res.pullback(i["res"], chunk, i["pieces"])
        return pb((dy, i["last"].astype(jnp.float32)))

    def accumulate(i, acc, d_chunk, d_pieces):
        return {"blocks": jax.tree.map(lambda a, d: a.at[i["j"]].add(d), acc["blocks"], d_chunk),
                "pieces": jax.tree.map(jnp.add, acc["pieces"], d_pieces)}

    def bwd(i, acc):
        d_chunk, d_pieces, dx, _ = grads(i, i["dy"])
        return accumulate(i, acc, d_chunk, d_pieces), {**zeros_out,
                                                       "msg_b": dx.astype(spec.dtype)}

    def bwd_in(i, acc):
        _, _, dx, _ = grads(i, i["dy"])
        return acc, {**zeros_out, "msg_b": dx.astype(spec.dtype), "ct": i["dy"]}

    def wgt(i, acc):
        d_chunk, d_pieces, _, _ = grads(i, i["ct"])
        return accumulate(i, acc, d_chunk, d_pieces), zeros_out

    return {0: idle, int(OpKind.F): fwd, int(OpKind.B): bwd, int(OpKind.B_IN): bwd_in,
            int(OpKind.W): wgt}


def _perms(S: int, circular: bool):
    fwd = [(s, (s + 1) % S) for s in range(S) if circular or s + 1 < S]
    bwd = [(s, (s - 1) % S) for s in range(S) if circular or s > 0]
    return fwd, bwd


def _remap_kinds(rows):
    """Op kinds → dense branch indices (only the branches the schedule uses get traced)."""
    kinds = sorted({int(k) for k in rows[..., COL["kind"]].ravel()} | {0})
    rows = rows.copy()
    lookup = np.zeros(max(kinds) + 1, np.int32)
    lookup[kinds] = np.arange(len(kinds))
    rows[..., COL["kind"]] = lookup[rows[..., COL["kind"]]]
    return kinds, rows


def _init_carry(prog: TickProgram, res, blocks, pieces, x0):
    buf = lambda n: jnp.zeros((n + 1,) + x0.shape, x0.dtype)  # noqa: E731  (+1: scratch)
    backward = prog.schedule.has_backward
    return {"fin": buf(prog.fwd_slots), "bin": buf(prog.bwd_slots), "ctb": buf(prog.ct_slots),
            "stash": [jnp.zeros((prog.stash_slots + 1,) + s.shape, s.dtype)
                      for s in (res.shapes if res else ())],
            "recv_f": x0, "recv_b": x0, "loss": jnp.zeros((), jnp.float32),
            "acc": {"blocks": jax.tree.map(jnp.zeros_like, blocks) if backward else {},
                    "pieces": jax.tree.map(jnp.zeros_like, pieces) if backward else {}}}


def run_ticks(spec: StepSpec, blocks, pieces, tokens, targets, weights, inv_w):
    """The body inside ``shard_map``: returns ``(loss, acc_blocks, acc_pieces)`` (local)."""
    prog = spec.program
    stage = jax.lax.axis_index(PIPE)
    blocks = jax.tree.map(lambda a: a[0], blocks)               # [v, Lc, ...] of this stage
    mb_shape = (prog.schedule.microbatches, spec.micro) + tokens.shape[1:]
    tokens, targets, weights = (a.reshape(mb_shape) for a in (tokens, targets, weights))
    D = jax.tree.leaves(pieces["embed"])[0].shape[-1]
    x0 = jnp.zeros(mb_shape[1:] + (D,), spec.dtype)
    res = None
    if prog.schedule.has_backward:
        extras0 = (tokens[0], targets[0], weights[0], jnp.bool_(True), jnp.bool_(True), inv_w)
        res = Residuals.trace(spec.apply, jax.tree.map(lambda a: a[0], blocks), pieces, x0,
                              extras0)
    zeros_out = {"res": [jnp.zeros(r.shape, r.dtype) for r in (res.shapes if res else ())],
                 "msg_f": x0, "msg_b": x0, "ct": x0, "loss": jnp.zeros((), jnp.float32)}
    table = _branches(spec, res, zeros_out)
    kinds, rows = _remap_kinds(prog.rows)
    branches = [table[k] for k in kinds]
    fperm, bperm = _perms(spec.stages, spec.virtual > 1)

    def tick(c, row_all):
        r = {name: _take(row_all, stage)[i] for name, i in COL.items()}
        fin = _put(c["fin"], c["recv_f"], _slot(r["recv_f"], prog.fwd_slots))
        bin_ = _put(c["bin"], c["recv_b"], _slot(r["recv_b"], prog.bwd_slots))
        mb = jnp.maximum(r["mb"], 0)
        last = r["last"] > 0
        dy = _take(bin_, _slot(r["bin"], prog.bwd_slots))
        s_slot = _slot(r["stash"], prog.stash_slots)
        inp = {"blocks": blocks, "pieces": pieces, "j": jnp.maximum(r["local_chunk"], 0),
               "x_in": _take(fin, _slot(r["fin"], prog.fwd_slots)),
               "dy": jnp.where(last, jnp.zeros_like(dy), dy), "last": last,
               "ct": _take(c["ctb"], _slot(r["ct"], prog.ct_slots)),
               "extras": (tokens[mb], targets[mb], weights[mb], r["first"] > 0, last, inv_w),
               "res": [_take(s, s_slot) for s in c["stash"]]}
        acc, o = jax.lax.switch(r["kind"], branches, inp, c["acc"])
        s_write = _slot(r["stash_w"], prog.stash_slots)
        return {"fin": fin, "bin": bin_, "acc": acc, "loss": c["loss"] + o["loss"],
                "ctb": _put(c["ctb"], o["ct"], _slot(r["ct_w"], prog.ct_slots)),
                "stash": [_put(s, x, s_write) for s, x in zip(c["stash"], o["res"])],
                "recv_f": jax.lax.ppermute(o["msg_f"], PIPE, fperm),
                "recv_b": jax.lax.ppermute(o["msg_b"], PIPE, bperm)}, None

    out, _ = jax.lax.scan(tick, _init_carry(prog, res, blocks, pieces, x0), jnp.asarray(rows))
    return out["loss"], out["acc"]["blocks"], out["acc"]["pieces"]
