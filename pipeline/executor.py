"""One executor for every schedule: ``shard_map`` over ``pipe`` (and ``data``), one ``lax.scan``
over the tick program, one gated op per op kind, ``ppermute`` between stages.

Per tick, every stage (1) files the messages that arrived into its inbox slots, (2) runs its
op from the program — idle, F, B, B_in or W — and (3) sends the forward activation to the
next stage and (schedules with a backward) the input gradient to the previous one with
``ppermute``. A forward stashes what its backward needs and cannot recompute (parameters
excluded) in a slot the program assigned; the backward reads it, adds the weight gradients
to the accumulator and frees the slot (ZB-H1, ZB-V: B_in writes its cut for W into the same
slot, over the residuals only B_in reads, ``pipeline.stash_layout``; W frees it). ZB-V's V sends
some activations down and some gradients up, and files a message on its own stage at the
turn; the program says which (``tick_program.Ticks``), so the V runs on the same two
channels.

**No per-tick tax.** Each op kind is its own two-branch conditional, "skip" or "run",
carrying only the buffers that op writes (F: the stash, the outgoing activation, the loss,
outputs and state; B: the gradient accumulators and the outgoing gradient; B_in: the stash
(its cut), the pre/post-stack's gradients and the outgoing gradient; W: the layers'
gradient accumulator), and reading the rest as operands. A
conditional whose only writing branch updates a buffer with a dynamic-update-slice, the
other passing it through, is compiled in place on XLA:CPU; one ``lax.switch`` carrying every
buffer through every branch (idle included) is not: it copied the whole accumulator and
zero-filled every output each tick. Each conditional's branch index is a lookup in a
constant table (so ``sharding.introspect`` counts how often it runs), and it sits in the
named scope ``OP_SCOPE + label`` (so ``op_costs`` finds it). ``data`` is manual too, so
gradients are summed locally over micro-batches and reduced over ``data`` once per step;
``tensor`` and ``expert`` stay automatic.

Besides gradients, the loop carries **per-stage state** for forward-only schedules: arrays
with a local-chunk axis and a micro-batch axis (a KV cache is one), whose slice for (chunk,
micro-batch) is read and written by that micro-batch's F on that chunk; and **per-micro-batch
outputs** (the logits of pipeline decode), written by the last chunk's F. So training,
evaluation and pipeline decode run the same tick loop.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline.buffers import put, take
from triax.pipeline.permute_parity import gated
from triax.pipeline.split_backward import StageBackward, pick_layout
from triax.pipeline.schedules import OpKind, Schedule
from triax.pipeline.stash_layout import StashLayout
from triax.pipeline.tick_program import TickProgram, Ticks, compile_program
from triax.pipeline.timeline import LABELS
from triax.sharding.introspect.branch_costs import OP_SCOPE, ORDERED_SCOPE

PIPE, DATA = "pipe", "data"


@dataclass(frozen=True, eq=False)
class StepSpec:
    """Static facts the scan body needs (all Python)."""

    program: TickProgram
    apply: Any                      # a pipeline.stage.Stage
    stages: int
    dtype: Any
    state_mb_axis: int = 0          # micro-batch axis of a state leaf, after its chunk axis


class TickResult(NamedTuple):
    loss: Any        # this stage's summed loss (a scalar, or the stage's loss dict)
    outputs: Any     # per-micro-batch outputs, leaves [M, ...] (meaningful on the last stage)
    state: Any       # the per-stage state after every tick
    grads: dict      # {"blocks": [v, Lc, ...], "pieces": ...} summed over micro-batches


def _state_starts(a, j, mb, axis):
    zero = jnp.zeros((), jnp.int32)
    starts = [zero] * a.ndim
    starts[0], starts[axis + 1] = j, mb
    return starts


def _statetake(a, j, mb, axis):
    """The (chunk j, micro-batch mb) slice of a state leaf ``[v, ..., M, ...]``."""
    sizes = list(a.shape)
    sizes[0] = sizes[axis + 1] = 1
    out = jax.lax.dynamic_slice(a, _state_starts(a, j, mb, axis), sizes)
    return out.squeeze((0, axis + 1))


def _stateput(a, x, j, mb, axis):
    x = jnp.expand_dims(x.astype(a.dtype), (0, axis + 1))
    return jax.lax.dynamic_update_slice(a, x, _state_starts(a, j, mb, axis))


def _perms(S: int, circular: bool):
    """The up (s → s+1) and down (s → s-1) channels; circular placement wraps around."""
    fwd = [(s, (s + 1) % S) for s in range(S) if circular or s + 1 < S]
    bwd = [(s, (s - 1) % S) for s in range(S) if circular or s > 0]
    return fwd, bwd


def _used_kinds(ticks: Ticks) -> list[OpKind]:
    """The op kinds a program runs, in ``OpKind`` order (only those get traced)."""
    return [OpKind(k) for k in sorted({int(k) for k in ticks.kind.ravel()} - {0})]


def branch_kinds(schedule: Schedule) -> tuple[str, ...]:
    """The tick's ops, as ``triax.sharding.introspect.op_costs`` takes them: ``"idle"``
    (every op skipped), then the op kinds ``schedule`` uses in ``OpKind`` order (1F1B:
    ``("idle", "F", "B")``; ZB-H1: ``("idle", "F", "B_in", "W")``).

        >>> from triax.pipeline import build
        >>> branch_kinds(build("zb-h1", stages=2, microbatches=4))
        ('idle', 'F', 'B_in', 'W')
    """
    return ("idle",) + tuple(LABELS[k] for k in _used_kinds(compile_program(schedule).ticks))


def stash_layout(program: TickProgram, sb: StageBackward) -> StashLayout:
    """The stash slot ``run_ticks`` allocates for ``program`` (``StageBackward.layout``)."""
    return sb.layout(program.schedule.kind.split_backward, program.stash_slots,
                     program.head_slots)


def slot_buffer_bytes(program: TickProgram, layouts, x_bytes: int) -> dict[str, int]:
    """Bytes of the tick loop's activation buffers on one stage, as ``run_ticks`` allocates
    them, from the slot layouts' sizes (``StageBackward.layouts``: anything with
    ``body_bytes`` and ``head_bytes``) and the bytes of the activation passed between stages.

    ``stash``: the live slots (written only inside F's and B_in's conditionals, so no
    scratch slot; the head cells, which only the last chunk's micro-batches hold and write,
    have slots of their own). F writes its residuals into
    the slot and B reads them there, in place, so no further residual set is materialised
    per tick (``tests/test_pipeline_tick_tax.py``). ``inbox``: the forward and backward
    inboxes (live slots plus scratch), the two activations in flight and the two being
    sent. Forward-only schedules stash nothing.
    """
    x = x_bytes
    if not program.schedule.has_backward:
        return {"stash": 0, "inbox": (program.fwd_slots + 1 + 2) * x}
    inbox = (program.fwd_slots + program.bwd_slots + 2 + 4) * x
    lay = pick_layout(layouts, program.stash_slots, program.head_slots)
    stash = program.stash_slots * lay.body_bytes + program.head_slots * lay.head_bytes
    return {"stash": stash, "inbox": inbox}


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
    apply, loss_apply = spec.apply, loss_only(spec.apply)
    chunk0 = jax.tree.map(lambda a: a[0], blocks)
    inputs0 = jax.tree.map(lambda a: a[0], inputs)
    extras0 = (inputs0, consts, jnp.bool_(True), jnp.bool_(True))
    state0 = jax.tree.map(lambda a: _statetake(a, 0, 0, ax), state)
    x_sd = apply.activation(chunk0, pieces, inputs0)
    x0 = jnp.zeros(x_sd.shape, spec.dtype)
    _, loss_sd, out_sd, _ = jax.eval_shape(apply, chunk0, pieces, x0, extras0, state0)
    sb = StageBackward.trace(loss_apply, chunk0, pieces, x0, extras0) if backward else None
    layout = stash_layout(prog, sb) if backward else None
    kinds = _used_kinds(prog.ticks)
    flags = {k: (prog.ticks.kind == int(k)).astype(np.int32) for k in kinds}
    fperm, bperm = _perms(spec.stages, prog.schedule.wraps)
    M = prog.out_slots
    # ZB-V's extra ways in (the second leg's activations from above, its gradients from
    # below, both at the turn from the stage itself): only the ones the program uses.
    scratch = {"fin": prog.fwd_slots, "bin": prog.bwd_slots}
    filings = [(buf, msg, field) for buf, msg, field in (
        ("fin", "recv_b", "fwd_in_down_w"), ("fin", "send_f", "fwd_in_turn_w"),
        ("bin", "recv_f", "bwd_in_up_w"), ("bin", "send_b", "bwd_in_turn_w"))
        if (getattr(prog.ticks, field) != scratch[buf]).any()]
    mixed_up, mixed_down = prog.ticks.up_b.any(), prog.ticks.down_f.any()

    def slots(n, sd):
        """n live slots +1 scratch (the inboxes, written every tick; the stash is written
        only inside F's and B_in's conditionals, always to a live slot: no scratch)."""
        return jnp.zeros((n + 1,) + tuple(sd.shape), sd.dtype)

    def tick(c, xs):
        row, flag = jax.tree.map(lambda a: take(a, stage), xs)
        j, mb, last = row.chunk, row.mb, row.last > 0
        c = dict(c, fin=put(c["fin"], c["recv_f"], row.fwd_in_w))
        if backward:
            c["bin"] = put(c["bin"], c["recv_b"], row.bwd_in_w)
        for buf, msg, field in filings:
            c[buf] = put(c[buf], c[msg], getattr(row, field))
        # Read-only views, computed inside whichever op reads them.
        chunk = lambda: jax.tree.map(lambda a: take(a, j), blocks)  # noqa: E731
        extras = lambda: (jax.tree.map(lambda a: take(a, mb), inputs), consts,  # noqa: E731
                          row.first > 0, last)
        # Every chunk's loss is seeded (a MoE adds auxiliary losses on every chunk; a dense
        # chunk that is not the last has a constant zero loss). The loss may be a dict.
        dloss = jax.tree.map(lambda s: jnp.ones(s.shape, s.dtype), loss_sd)

        def dy():  # the last chunk has no incoming gradient
            d = take(c["bin"], row.bwd_in_r)
            return jnp.where(last, jnp.zeros_like(d), d)

        def add_blocks(acc, d_chunk):
            return jax.tree.map(lambda a, d: a.at[j].add(d.astype(a.dtype)), acc, d_chunk)

        def add_pieces(acc, d_pieces):
            return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, d_pieces)

        def fwd(w):
            x_in = take(c["fin"], row.fwd_in_r)
            if sb is None:
                st = jax.tree.map(lambda a: _statetake(a, j, mb, ax), w["state"])
                y, loss, out, st = apply(chunk(), pieces, x_in, extras(), st)
                w = dict(w, state=jax.tree.map(lambda a, x: _stateput(a, x, j, mb, ax),
                                               w["state"], st),
                         out=jax.tree.map(lambda b, x: put(b, x, row.out_w), w["out"], out))
            else:
                (y, loss), res = sb.forward(loss_apply, chunk(), pieces, x_in, extras())
                w = dict(w, stash=layout.write(w["stash"], res, row.stash_w, row.head_w, last))
            return dict(w, send_f=y.astype(spec.dtype),
                        loss=jax.tree.map(jnp.add, w["loss"], loss))

        def bwd(w):
            stored = layout.read(c["stash"], row.stash_r, row.head_r)
            d_chunk, d_pieces, dx = sb.backward(stored, chunk(), pieces, extras(), dy(), dloss)
            return {"acc_blocks": add_blocks(w["acc_blocks"], d_chunk),
                    "acc_pieces": add_pieces(w["acc_pieces"], d_pieces),
                    "send_b": dx.astype(spec.dtype)}

        def bwd_in(w):
            def run(stash):
                stored = layout.read(stash, row.stash_r, row.head_r)
                return sb.backward_input(stored, chunk(), pieces, extras(), dy(), dloss)
            # The cut overwrites cells B_in reads, so every read must come first: B_in runs as
            # one conditional (on a flag true here) whose outputs are written after it. A
            # barrier does not hold on XLA:CPU: fusion moves a read past the write, and XLA
            # then copies the whole cell buffer each tick to keep the read valid.
            with jax.named_scope(ORDERED_SCOPE):   # introspection counts it as B_in's own
                d_pieces, dx, cut = jax.lax.cond(flag[OpKind.B_IN] > 0, run,
                                       lambda _: jax.tree.map(jnp.zeros_like,
                                                              jax.eval_shape(run, w["stash"])),
                                       w["stash"])
            return {"stash": layout.write_cut(w["stash"], cut, row.stash_r, row.head_r,
                                              last),
                    "acc_pieces": add_pieces(w["acc_pieces"], d_pieces),
                    "send_b": dx.astype(spec.dtype)}

        def wgt(w):
            stored = layout.read(c["stash"], row.stash_r, row.head_r)
            cut = layout.read_cut(c["stash"], row.stash_r, row.head_r)
            d_chunk = sb.backward_weight(stored, cut, chunk(), pieces, extras())
            return {"acc_blocks": add_blocks(w["acc_blocks"], d_chunk)}

        # Each op: what it runs, and the buffers it writes. Writers run before readers (F
        # writes the stash B, B_in and W read; B_in reads it and writes the cut W reads): a
        # buffer read by one conditional and then written in place by a later one is copied
        # whole first. One op runs per tick, so the order changes nothing else.
        ops = {OpKind.F: (fwd, ("stash", "send_f", "loss", "out", "state")),
               OpKind.B_IN: (bwd_in, ("stash", "acc_pieces", "send_b")),
               OpKind.W: (wgt, ("acc_blocks",)),
               OpKind.B: (bwd, ("acc_blocks", "acc_pieces", "send_b"))}
        for k in (OpKind.F, OpKind.B_IN, OpKind.W, OpKind.B):
            if k in kinds:
                run, writes = ops[k]
                with jax.named_scope(OP_SCOPE + LABELS[k]):
                    c.update(gated(flag[k], run, {n: c[n] for n in writes if n in c}, PIPE,
                                    spec.stages))
        # Up carries the activation, down the gradient, except where a V sends them the
        # other way (one op per tick: a stage sends at most one message).
        up = jnp.where(row.up_b > 0, c["send_b"], c["send_f"]) if mixed_up else c["send_f"]
        c["recv_f"] = jax.lax.ppermute(up, PIPE, fperm)
        if backward:
            down = (jnp.where(row.down_f > 0, c["send_f"], c["send_b"]) if mixed_down
                    else c["send_b"])
            c["recv_b"] = jax.lax.ppermute(down, PIPE, bperm)
        return c, None

    carry = {"fin": slots(prog.fwd_slots, x0), "recv_f": x0, "send_f": x0,
             "loss": jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), loss_sd),
             "state": state,
             "out": jax.tree.map(lambda s: slots(M, s), out_sd)}
    if backward:
        carry.update(bin=slots(prog.bwd_slots, x0), recv_b=x0, send_b=x0,
                     stash=layout.buffers(prog.stash_slots, prog.head_slots),
                     acc_blocks=jax.tree.map(jnp.zeros_like, blocks),
                     acc_pieces=jax.tree.map(jnp.zeros_like, pieces))
    xs = jax.tree.map(jnp.asarray, (prog.ticks, flags))
    out, _ = jax.lax.scan(tick, carry, xs)
    acc = ({"blocks": out["acc_blocks"], "pieces": out["acc_pieces"]} if backward
           else {"blocks": {}, "pieces": {}})
    return TickResult(out["loss"], jax.tree.map(lambda a: a[:M], out["out"]), out["state"], acc)


def loss_only(apply):
    """``(chunk, pieces, x, extras) -> (y, loss)``: the stateless part the backward needs."""
    def f(chunk, pieces, x, extras):
        y, loss, _, _ = apply(chunk, pieces, x, extras, {})
        return y, loss
    return f
