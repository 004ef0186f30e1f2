"""One executor for every schedule: ``shard_map`` over ``pipe`` (and ``data``), one ``lax.scan``
over the tick program, ``lax.switch`` on each device's op, ``ppermute`` between stages.

Per tick, every stage (1) files the messages that arrived into its inbox slots, (2) runs its
op from the program — idle, F, B, B_in or W — as one ``lax.switch`` branch, so an idle tick
computes nothing, and (3) sends the forward activation to the next stage and (schedules with
a backward) the input gradient to the previous one with ``ppermute``. A forward stashes its
pullback's residuals (parameters excluded) in a slot the program assigned; the backward reads
them, adds the weight gradients to the carry and frees the slot. ``data`` is manual too, so
gradients are summed locally over micro-batches and reduced over ``data`` once per step;
``tensor`` and ``expert`` stay automatic.

Besides gradients, the loop carries **per-stage state** for forward-only schedules: arrays
with a local-chunk axis and a micro-batch axis (a KV cache is one), whose slice for (chunk,
micro-batch) is read and written by that micro-batch's F on that chunk; and **per-micro-batch
outputs** (the logits of pipeline decode), written by the last chunk's F. So training,
evaluation and pipeline decode run the same tick loop.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline.schedules import OpKind, Schedule
from triax.pipeline.stage import Residuals
from triax.pipeline.tick_program import TickProgram, Ticks, compile_program
from triax.pipeline.timeline import LABELS

PIPE, DATA = "pipe", "data"


@dataclass(frozen=True, eq=False)
class StepSpec:
    """Static facts the scan body needs (all Python)."""

    program: TickProgram
    apply: Any                      # a pipeline.stage.Stage
    stages: int
    virtual: int
    dtype: Any
    state_mb_axis: int = 0          # micro-batch axis of a state leaf, after its chunk axis


class TickResult(NamedTuple):
    loss: Any        # this stage's summed loss (a scalar, or the stage's loss dict)
    outputs: Any     # per-micro-batch outputs, leaves [M, ...] (meaningful on the last stage)
    state: Any       # the per-stage state after every tick
    grads: dict      # {"blocks": [v, Lc, ...], "pieces": ...} summed over micro-batches


def _take(buf, i):
    return jax.lax.dynamic_index_in_dim(buf, i, 0, keepdims=False)


def _put(buf, x, i):
    return jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), i, 0)


def _state_starts(a, j, mb, axis):
    zero = jnp.zeros((), jnp.int32)
    starts = [zero] * a.ndim
    starts[0], starts[axis + 1] = j, mb
    return starts


def _state_take(a, j, mb, axis):
    """The (chunk j, micro-batch mb) slice of a state leaf ``[v, ..., M, ...]``."""
    sizes = list(a.shape)
    sizes[0] = sizes[axis + 1] = 1
    out = jax.lax.dynamic_slice(a, _state_starts(a, j, mb, axis), sizes)
    return out.squeeze((0, axis + 1))


def _state_put(a, x, j, mb, axis):
    x = jnp.expand_dims(x.astype(a.dtype), (0, axis + 1))
    return jax.lax.dynamic_update_slice(a, x, _state_starts(a, j, mb, axis))


def _branches(spec: StepSpec, res: Residuals | None, zeros: dict):
    """Branches ``(inp, acc) -> (acc', out)`` for idle, F, B, B_in, W.

    ``inp`` is read-only (never returned, so XLA does not copy it per tick); ``out`` holds
    what the op produced (zeros where it produced nothing; the state slice unchanged),
    ``acc`` the gradient sums.
    """
    apply = spec.apply
    loss_apply = loss_only(apply)  # what the backward differentiates

    def chunk_of(i):
        return jax.tree.map(lambda a: _take(a, i["j"]), i["blocks"])

    def idle(i, acc):
        return acc, {**zeros, "state": i["state"]}

    def fwd(i, acc):
        chunk = chunk_of(i)
        if res is None:
            y, loss, out, state = apply(chunk, i["pieces"], i["x_in"], i["extras"], i["state"])
            produced = {"out": out, "state": state}
        else:
            (y, loss), stored = res.forward(loss_apply, chunk, i["pieces"], i["x_in"],
                                            i["extras"])
            produced = {"res": stored, "state": i["state"]}
        return acc, {**zeros, **produced, "msg_f": y.astype(spec.dtype), "loss": loss}

    def grads(i, dy):
        pb = res.pullback(i["res"], chunk_of(i), i["pieces"])
        # Every chunk's loss is seeded (MoE adds auxiliary losses on every chunk; a dense
        # chunk that is not the last has a constant zero loss).
        return pb((dy, jax.tree.map(jnp.ones_like, zeros["loss"])))

    def accumulate(i, acc, d_chunk, d_pieces):
        return {"blocks": jax.tree.map(lambda a, d: a.at[i["j"]].add(d), acc["blocks"], d_chunk),
                "pieces": jax.tree.map(jnp.add, acc["pieces"], d_pieces)}

    def bwd(i, acc):
        d_chunk, d_pieces, dx, _ = grads(i, i["dy"])
        return accumulate(i, acc, d_chunk, d_pieces), {**zeros, "state": i["state"],
                                                       "msg_b": dx.astype(spec.dtype)}

    def bwd_in(i, acc):
        _, _, dx, _ = grads(i, i["dy"])
        return acc, {**zeros, "state": i["state"], "msg_b": dx.astype(spec.dtype),
                     "ct": i["dy"]}

    def wgt(i, acc):
        d_chunk, d_pieces, _, _ = grads(i, i["ct"])
        return accumulate(i, acc, d_chunk, d_pieces), {**zeros, "state": i["state"]}

    return {0: idle, int(OpKind.F): fwd, int(OpKind.B): bwd, int(OpKind.B_IN): bwd_in,
            int(OpKind.W): wgt}


def _perms(S: int, circular: bool):
    fwd = [(s, (s + 1) % S) for s in range(S) if circular or s + 1 < S]
    bwd = [(s, (s - 1) % S) for s in range(S) if circular or s > 0]
    return fwd, bwd


def _dense_kinds(ticks: Ticks):
    """Op kinds → dense branch indices (only the branches the schedule uses get traced)."""
    kinds = sorted({int(k) for k in ticks.kind.ravel()} | {0})
    lookup = np.zeros(max(kinds) + 1, np.int32)
    lookup[kinds] = np.arange(len(kinds))
    return kinds, dataclasses.replace(ticks, kind=lookup[ticks.kind])


def branch_kinds(schedule: Schedule) -> tuple[str, ...]:
    """The tick switch's branches in order, as ``triax.sharding.introspect.op_costs`` takes
    them: ``"idle"``, then the op kinds ``schedule`` uses in ``OpKind`` order (1F1B:
    ``("idle", "F", "B")``; ZB-H1: ``("idle", "F", "B_in", "W")``).

        >>> from triax.pipeline import build
        >>> branch_kinds(build("zb-h1", stages=2, microbatches=4))
        ('idle', 'F', 'B_in', 'W')
    """
    kinds, _ = _dense_kinds(compile_program(schedule).ticks)
    return ("idle",) + tuple(LABELS[OpKind(k)] for k in kinds[1:])


def _nbytes(sd) -> int:
    return int(np.prod(sd.shape)) * jnp.dtype(sd.dtype).itemsize


def buffer_bytes(program: TickProgram, residuals, x_sd) -> dict[str, int]:
    """Bytes of the tick loop's activation buffers on one stage, as ``run_ticks`` allocates
    them. ``residuals``: the stored leaves of one chunk's pullback for one micro-batch
    (``Residuals.shapes``); ``x_sd``: the activation passed between stages.

    ``stash``: live slots plus the scratch slot; ``op``: the slot read out for this tick's op
    and the branch's result before it is written back (the switch's operand and output, two
    more residual sets); ``inbox``: the forward, backward and cotangent inboxes (live slots
    plus scratch) and the two activations in flight. Forward-only schedules stash nothing.
    """
    x = _nbytes(x_sd)
    if not program.schedule.has_backward:
        return {"stash": 0, "op": 0, "inbox": (program.fwd_slots + 2) * x}
    res = sum(_nbytes(r) for r in residuals)
    inbox = program.fwd_slots + program.bwd_slots + program.ct_slots + 3 + 2
    return {"stash": (program.stash_slots + 1) * res, "op": 2 * res, "inbox": inbox * x}


def run_ticks(spec: StepSpec, blocks, pieces, inputs, consts, state) -> TickResult:
    """The body inside ``shard_map``, on this stage's shards.

    ``blocks``: the stage's chunks ``[v, Lc, ...]``; ``inputs``: per-micro-batch inputs,
    leaves ``[M, b, ...]``; ``consts``: step-wide values every op sees; ``state``: per-stage
    state, leaves ``[v, ..., M, ...]`` (micro-batch axis ``spec.state_mb_axis`` after the
    chunk axis), ``{}`` for none — forward-only schedules only.
    """
    prog = spec.program
    backward = prog.schedule.has_backward
    if backward and jax.tree.leaves(state):
        raise ValueError("per-stage state is carried by forward-only schedules only; "
                         f"{prog.schedule.kind.value} has a backward")
    stage = jax.lax.axis_index(PIPE)
    ax = spec.state_mb_axis
    chunk0 = jax.tree.map(lambda a: a[0], blocks)
    inputs0 = jax.tree.map(lambda a: a[0], inputs)
    extras0 = (inputs0, consts, jnp.bool_(True), jnp.bool_(True))
    state0 = jax.tree.map(lambda a: _state_take(a, 0, 0, ax), state)
    x_sd = spec.apply.activation(chunk0, pieces, inputs0)
    x0 = jnp.zeros(x_sd.shape, spec.dtype)
    _, loss_sd, out_sd, _ = jax.eval_shape(spec.apply, chunk0, pieces, x0, extras0, state0)
    new_zeros = lambda tree: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tree)  # noqa: E731
    res = None
    if backward:
        res = Residuals.trace(loss_only(spec.apply), chunk0, pieces, x0, extras0)
    zeros = {"msg_f": x0, "loss": new_zeros(loss_sd), "out": new_zeros(out_sd)}
    if backward:
        zeros.update(res=[jnp.zeros(r.shape, r.dtype) for r in res.shapes], msg_b=x0, ct=x0)
    table = _branches(spec, res, zeros)
    kinds, ticks = _dense_kinds(prog.ticks)
    branches = [table[k] for k in kinds]
    fperm, bperm = _perms(spec.stages, spec.virtual > 1)
    buf = lambda n, like: jnp.zeros((n + 1,) + like.shape, like.dtype)  # noqa: E731 (+1 scratch)
    M = prog.out_slots

    def tick(c, row):
        r = jax.tree.map(lambda a: _take(a, stage), row)
        j, mb, last = r.chunk, r.mb, r.last > 0
        fin = _put(c["fin"], c["recv_f"], r.fwd_in_w)
        inp = {"blocks": blocks, "pieces": pieces, "j": j, "x_in": _take(fin, r.fwd_in_r),
               "extras": (jax.tree.map(lambda a: _take(a, mb), inputs), consts,
                          r.first > 0, last),
               "state": jax.tree.map(lambda a: _state_take(a, j, mb, ax), c["state"])}
        new = {"fin": fin}
        if backward:
            new["bin"] = bin_ = _put(c["bin"], c["recv_b"], r.bwd_in_w)
            dy = _take(bin_, r.bwd_in_r)  # the last chunk has no incoming gradient
            inp.update(dy=jnp.where(last, jnp.zeros_like(dy), dy), last=last,
                       ct=_take(c["ctb"], r.ct_r), res=[_take(s, r.stash_r) for s in c["stash"]])
        acc, o = jax.lax.switch(r.kind, branches, inp, c["acc"])
        new.update(acc=acc, loss=jax.tree.map(jnp.add, c["loss"], o["loss"]),
                   out=jax.tree.map(lambda b, x: _put(b, x, r.out_w), c["out"], o["out"]),
                   state=jax.tree.map(lambda a, x: _state_put(a, x, j, mb, ax), c["state"],
                                      o["state"]),
                   recv_f=jax.lax.ppermute(o["msg_f"], PIPE, fperm))
        if backward:
            new.update(ctb=_put(c["ctb"], o["ct"], r.ct_w),
                       stash=[_put(s, x, r.stash_w) for s, x in zip(c["stash"], o["res"])],
                       recv_b=jax.lax.ppermute(o["msg_b"], PIPE, bperm))
        return new, None

    carry = {"fin": buf(prog.fwd_slots, x0), "recv_f": x0, "loss": zeros["loss"],
             "out": jax.tree.map(lambda z: buf(M, z), zeros["out"]), "state": state,
             "acc": {"blocks": jax.tree.map(jnp.zeros_like, blocks) if backward else {},
                     "pieces": jax.tree.map(jnp.zeros_like, pieces) if backward else {}}}
    if backward:
        carry.update(bin=buf(prog.bwd_slots, x0), ctb=buf(prog.ct_slots, x0), recv_b=x0,
                     stash=[jnp.zeros((prog.stash_slots + 1,) + s.shape, s.dtype)
                            for s in res.shapes])
    out, _ = jax.lax.scan(tick, carry, jax.tree.map(jnp.asarray, ticks))
    return TickResult(out["loss"], jax.tree.map(lambda a: a[:M], out["out"]), out["state"],
                      out["acc"])


def loss_only(apply):
    """``(chunk, pieces, x, extras) -> (y, loss)``: the stateless part the backward needs."""
    def f(chunk, pieces, x, extras):
        y, loss, _, _ = apply(chunk, pieces, x, extras, {})
        return y, loss
    return f
