"""One tick of the executor's loop, on one stage: what it carries (:class:`Carry`), what it
reads (:class:`Step`, fixed for the step, and :class:`Tick`, this tick's row of the program),
and one kernel per op kind.

A tick (``tick``) files the messages that arrived (``file_arrivals``), runs each op kind the
program uses as its own run-or-skip conditional (``run_ops``), and sends (``send``). A kernel
(``forward``, ``backward``, ``backward_input``, ``backward_weight``) takes the tick, the carry
as the ops before it left it (read-only), and the part of the carry it writes (a partial
:class:`Carry`, the conditional's operand), and returns that part updated. Idle has no
kernel: every conditional takes its skip branch (``permute_parity.run_or_skip``).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import jax
import jax.numpy as jnp

from triax.pipeline.buffers import put, put_state, take, take_state
from triax.pipeline.permute_parity import run_or_skip
from triax.pipeline.schedules import OpKind
from triax.pipeline.stage_inputs import StageInputs
from triax.pipeline.timeline import LABELS
from triax.sharding.introspect.branch_costs import OP_SCOPE, ORDERED_SCOPE

PIPE, DATA = "pipe", "data"


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Carry:
    """What the tick loop carries from tick to tick on one stage. A field left None carries
    nothing (None is an empty pytree): the backward's under a forward-only schedule, and, in
    a kernel's partial carry, the buffers that kernel does not write. The fields are in the
    order the tick loop's buffers flatten in (its conditionals' operands, the scan's carry),
    as the compiled program's buffer assignment was measured with."""

    acc_blocks: Any = None    # the chunks' weight gradients [v, Lc, ...], summed
    acc_pieces: Any = None    # the pre/post-stack's gradients, summed
    bwd_inbox: Any = None     # [bwd_slots + 1, *x]: gradients waiting for their B / B_in
    fwd_inbox: Any = None     # [fwd_slots + 1, *x]: activations waiting for their F; scratch last
    loss: Any = None          # this stage's summed loss (a scalar, or the loss dict)
    out: Any = None           # per-micro-batch outputs [M + 1, ...]
    recv_b: Any = None        # what arrived on the down channel (s+1 → s) last tick
    recv_f: Any = None        # what arrived on the up channel (s-1 → s) last tick
    send_b: Any = None        # B's / B_in's input gradient
    send_f: Any = None        # F's output activation
    stash: Any = None         # the stash slots' cell buffers (StashLayout.buffers)
    state: Any = None         # per-stage state [v, ..., M, ...] ({} for none)
    recv_f_down: Any = None   # both ways (F&B): the activation that came down (s+1 → s)
    recv_b_up: Any = None     # both ways (F&B): the gradient that came up (s-1 → s)

    def merge(self, part: "Carry") -> "Carry":
        """This carry with ``part``'s fields that are set."""
        return replace(self, **{f.name: getattr(part, f.name) for f in fields(part)
                                if getattr(part, f.name) is not None})


@dataclass(frozen=True)
class Arrivals:
    """ZB-V's extra ways into the inboxes, beyond activations from below and gradients from
    above: only those the program uses are traced."""

    fwd_from_down: bool       # the V's second leg: activations come down
    fwd_at_turn: bool         # the turn: the stage's own activation
    bwd_from_up: bool         # the second leg: gradients go up
    bwd_at_turn: bool         # the turn: the stage's own gradient
    up_carries_b: bool        # some tick sends a gradient on the up channel
    down_carries_f: bool      # some tick sends an activation on the down channel
    both_ways: bool = False   # F&B sends two messages: each buffer goes up and down

    @classmethod
    def of(cls, program) -> "Arrivals":
        t = program.ticks
        return cls(bool((t.fwd_in_down_w != program.fwd_slots).any()),
                   bool((t.fwd_in_turn_w != program.fwd_slots).any()),
                   bool((t.bwd_in_up_w != program.bwd_slots).any()),
                   bool((t.bwd_in_turn_w != program.bwd_slots).any()),
                   bool(t.up_b.any()), bool(t.down_f.any()), program.both_ways)


@dataclass(frozen=True, eq=False)
class Step:
    """What every tick of one step reads: the stage's parameters and inputs, the traced
    stage and its backward, and the program's static facts."""

    apply: Any                # the stage (pipeline.stage.Stage)
    loss_apply: Any           # its stateless (chunk, pieces, x, extras) -> (y, loss)
    sb: Any                   # a split_backward.StageBackward; None without a backward
    layout: Any               # the stash slot's StashLayout; None without a backward
    blocks: Any               # the stage's chunks [v, Lc, ...]
    layers: Any               # int32 [v, Lc]: their layers' indices in the whole stack
    pieces: Any
    inputs: Any               # per-micro-batch inputs [M, b, ...]
    consts: Any
    loss_sd: Any              # the loss's shapes
    dtype: Any                # of the activations sent between stages
    stages: int
    state_mb_axis: int
    kinds: tuple              # the op kinds the program runs
    arrivals: Arrivals
    perms: tuple              # the up and down channels' (source, target) pairs
    slot_counts: Any = None   # uneven stages: [S, v] layers run per chunk (StageLayers)

    @property
    def backward(self) -> bool:
        return self.sb is not None


@dataclass(frozen=True, eq=False)
class Tick:
    """One tick on this stage: the program's row and which ops run."""

    step: Step
    row: Any                  # the Ticks fields at (tick, stage), traced int32 scalars
    on: dict                  # {OpKind: 1 where that op runs this tick}
    last: Any                 # bool: the chunk is the model's last (once per tick, not per op)
    dloss: Any                # the loss seed (ones): every chunk's loss is differentiated
    count: Any = None         # uneven stages: the layers this op's chunk runs
    b_count: Any = None       # uneven stages: the layers the backward's chunk runs

    def backward_view(self) -> "Tick":
        """The tick as its backward op reads it: ``b_mb`` ... ``b_last`` (an F&B's B is on
        another micro-batch and chunk than its F; for a lone backward they are the same)."""
        r = self.row
        row = replace(r, mb=r.b_mb, chunk=r.b_chunk, first=r.b_first, last=r.b_last)
        return replace(self, row=row, last=r.b_last > 0, count=self.b_count)

    def chunk(self):
        """This op's chunk of the stage's layers (read inside the op that needs it)."""
        return jax.tree.map(lambda a: take(a, self.row.chunk), self.step.blocks)

    def extras(self) -> StageInputs:
        s = self.step
        return StageInputs(jax.tree.map(lambda a: take(a, self.row.mb), s.inputs), s.consts,
                           self.row.first > 0, self.last, take(s.layers, self.row.chunk),
                           self.count)

    def dy(self, c: Carry):
        """The incoming gradient (the last chunk has none: its loss is the seed)."""
        d = take(c.bwd_inbox, self.row.bwd_in_r)
        return jnp.where(self.last, jnp.zeros_like(d), d)

    def add_blocks(self, acc, d_chunk):
        return jax.tree.map(lambda a, d: a.at[self.row.chunk].add(d.astype(a.dtype)),
                            acc, d_chunk)


def _add_pieces(acc, d_pieces):
    return jax.tree.map(lambda a, d: a + d.astype(a.dtype), acc, d_pieces)


def forward(t: Tick, c: Carry, w: Carry, after=None) -> Carry:
    """F: the chunk on the filed activation; with a backward it stashes its residuals, else
    it reads and writes the state's (chunk, micro-batch) slice and files the outputs.
    ``after``: values the stash write must wait for (F&B: its B's read of the stash)."""
    s, row = t.step, t.row
    x_in = take(c.fwd_inbox, row.fwd_in_r)
    if not s.backward:
        j, mb, ax = row.chunk, row.mb, s.state_mb_axis
        st = jax.tree.map(lambda a: take_state(a, j, mb, ax), w.state)
        y, loss, out, st = s.apply(t.chunk(), s.pieces, x_in, t.extras(), st)
        w = replace(w, state=jax.tree.map(lambda a, x: put_state(a, x, j, mb, ax), w.state, st),
                    out=jax.tree.map(lambda b, x: put(b, x, row.out_w), w.out, out))
    else:
        (y, loss), res = s.sb.forward(t.chunk(), s.pieces, x_in, t.extras())
        if after is not None:   # the write depends on the read: XLA orders them, no copy
            res, _ = jax.lax.optimization_barrier((res, after))
        w = replace(w, stash=s.layout.write(w.stash, res, row.stash_w, row.head_w, t.last))
    return replace(w, send_f=y.astype(s.dtype), loss=jax.tree.map(jnp.add, w.loss, loss))


def backward(t: Tick, c: Carry, w: Carry) -> Carry:
    """B (1F1B, interleaved, DualPipeV): the whole backward from the stash; frees the slot."""
    t = t.backward_view()
    return _backward_from(t, c, w, t.step.layout.read(c.stash, t.row.stash_r, t.row.head_r))


def _backward_from(t: Tick, c: Carry, w: Carry, stored) -> Carry:
    """B on the slot's ``stored`` residuals (``t``: the backward's view of the tick)."""
    s = t.step
    d_chunk, d_pieces, dx = s.sb.backward(stored, t.chunk(), s.pieces, t.extras(), t.dy(c),
                                          t.dloss)
    return replace(w, acc_blocks=t.add_blocks(w.acc_blocks, d_chunk),
                   acc_pieces=_add_pieces(w.acc_pieces, d_pieces), send_b=dx.astype(s.dtype))


def backward_input(t: Tick, c: Carry, w: Carry) -> Carry:
    """B_in (ZB-H1, ZB-V): the input gradient and the pre/post-stack's gradients; writes the
    cut for W over the residuals only it reads."""
    on = t.on[OpKind.B_IN]
    t = t.backward_view()
    s, row = t.step, t.row

    def run(ops):
        stash, acc = ops
        stored = s.layout.read(stash, row.stash_r, row.head_r)
        d_pieces, dx, cut = s.sb.backward_input(stored, t.chunk(), s.pieces, t.extras(),
                                                t.dy(c), t.dloss)
        return _add_pieces(acc, d_pieces), dx, cut

    def skip(ops):
        _, dx, cut = jax.tree.map(jnp.zeros_like, jax.eval_shape(run, ops))
        return ops[1], dx, cut
    # The cut overwrites cells B_in reads, so every read must come first: B_in runs as one
    # conditional (on a flag true here) whose outputs are written after it. A barrier does
    # not hold on XLA:CPU: fusion moves a read past the write, and XLA then copies the whole
    # cell buffer each tick to keep the read valid. The pre/post-stack's gradients are summed
    # inside it, into the accumulator it carries: returned fresh, the head's (embedding and
    # unembedding, vocab-sized) would each hold a buffer of their own across the tick.
    with jax.named_scope(ORDERED_SCOPE):   # introspection counts it as B_in's own
        acc_pieces, dx, cut = jax.lax.cond(on > 0, run, skip,
                                           (w.stash, w.acc_pieces))
    return replace(w, stash=s.layout.write_cut(w.stash, cut, row.stash_r, row.head_r, t.last),
                   acc_pieces=acc_pieces, send_b=dx.astype(s.dtype))


def backward_weight(t: Tick, c: Carry, w: Carry) -> Carry:
    """W (ZB-H1, ZB-V): the layers' weight gradients from the stash and the cut; frees the
    slot."""
    t = t.backward_view()
    s, row = t.step, t.row
    stored = s.layout.read(c.stash, row.stash_r, row.head_r)
    cut = s.layout.read_cut(c.stash, row.stash_r, row.head_r)
    d_chunk = s.sb.backward_weight(stored, cut, t.chunk(), s.pieces, t.extras())
    return replace(w, acc_blocks=t.add_blocks(w.acc_blocks, d_chunk))


def forward_backward(t: Tick, c: Carry, w: Carry) -> Carry:
    """F&B (DualPipeV): one micro-batch's B and another's F in one conditional branch, with
    no data between them, so the compiler may run one's communication (an MoE all-to-all)
    beside the other's compute. B's slot is read out of the stash by a conditional of its
    own (on a flag true here), and F's write waits for that read (an optimization barrier
    on F's residuals and the read slot): without the order XLA copied the whole stash every
    tick to keep the read valid (``tests/test_pipeline_hlo.py``). Only the read and
    the write are ordered; B computes on the read slot, free to interleave with F."""
    tb = t.backward_view()
    read = lambda stash: tb.step.layout.read(stash, tb.row.stash_r, tb.row.head_r)  # noqa: E731
    with jax.named_scope(ORDERED_SCOPE):   # introspection counts it as F&B's own
        stored = jax.lax.cond(
            t.on[OpKind.FB] > 0, read,
            lambda st: jax.tree.map(jnp.zeros_like, jax.eval_shape(read, st)), w.stash)
    return forward(t, c, _backward_from(tb, c, w, stored), after=stored)


@dataclass(frozen=True)
class Kernel:
    """An op kind's kernel and the buffers it writes (its conditional carries only those,
    so the skip branch passes them through and the run branch updates them in place)."""

    run: Callable[[Tick, Carry, Carry], Carry]
    writes: Callable[[Carry], Carry]      # the carry -> the partial carry the op writes


KERNELS = {
    OpKind.F: Kernel(forward, lambda c: Carry(stash=c.stash, send_f=c.send_f, loss=c.loss,
                                              out=c.out, state=c.state)),
    OpKind.B_IN: Kernel(backward_input, lambda c: Carry(stash=c.stash, acc_pieces=c.acc_pieces,
                                                        send_b=c.send_b)),
    OpKind.W: Kernel(backward_weight, lambda c: Carry(acc_blocks=c.acc_blocks)),
    OpKind.B: Kernel(backward, lambda c: Carry(acc_blocks=c.acc_blocks,
                                               acc_pieces=c.acc_pieces, send_b=c.send_b)),
    OpKind.FB: Kernel(forward_backward,
                      lambda c: Carry(stash=c.stash, send_f=c.send_f, loss=c.loss, out=c.out,
                                      state=c.state, acc_blocks=c.acc_blocks,
                                      acc_pieces=c.acc_pieces, send_b=c.send_b)),
}
# Writers run before readers (F and F&B write the stash B, B_in and W read; B_in reads it and
# writes the cut W reads): a buffer read by one conditional and then written in place by a
# later one is copied whole first. One op runs per tick, so the order changes nothing else.
KERNEL_ORDER = (OpKind.F, OpKind.FB, OpKind.B_IN, OpKind.W, OpKind.B)


def file_arrivals(s: Step, c: Carry, row) -> Carry:
    """The messages of the last tick into their inbox slots (scratch where none is due)."""
    fin = put(c.fwd_inbox, c.recv_f, row.fwd_in_w)
    bin_ = put(c.bwd_inbox, c.recv_b, row.bwd_in_w) if s.backward else c.bwd_inbox
    a = s.arrivals
    if a.fwd_from_down:
        fin = put(fin, c.recv_f_down if a.both_ways else c.recv_b, row.fwd_in_down_w)
    if a.fwd_at_turn:
        fin = put(fin, c.send_f, row.fwd_in_turn_w)
    if a.bwd_from_up:
        bin_ = put(bin_, c.recv_b_up if a.both_ways else c.recv_f, row.bwd_in_up_w)
    if a.bwd_at_turn:
        bin_ = put(bin_, c.send_b, row.bwd_in_turn_w)
    return replace(c, fwd_inbox=fin, bwd_inbox=bin_)


def run_ops(t: Tick, c: Carry) -> Carry:
    """Each op kind the program uses, as its own run-or-skip conditional over the buffers it
    writes, in the named scope introspection finds it by (``OP_SCOPE + label``)."""
    for kind in KERNEL_ORDER:
        if kind in t.step.kinds:
            k = KERNELS[kind]
            with jax.named_scope(OP_SCOPE + LABELS[kind]):
                part = run_or_skip(t.on[kind], lambda w, c=c, k=k: k.run(t, c, w),
                                   k.writes(c), PIPE, t.step.stages)
            c = c.merge(part)
    return c


def send(s: Step, c: Carry, row) -> Carry:
    """Up carries the activation, down the gradient, except where a V sends them the other
    way (one op per tick: a stage sends at most one message), or, where F&B sends two,
    each goes both ways."""
    fperm, bperm = s.perms
    a = s.arrivals
    if a.both_ways:
        return replace(c, recv_f=jax.lax.ppermute(c.send_f, PIPE, fperm),
                       recv_b=jax.lax.ppermute(c.send_b, PIPE, bperm),
                       recv_f_down=jax.lax.ppermute(c.send_f, PIPE, bperm),
                       recv_b_up=jax.lax.ppermute(c.send_b, PIPE, fperm))
    up = jnp.where(row.up_b > 0, c.send_b, c.send_f) if a.up_carries_b else c.send_f
    c = replace(c, recv_f=jax.lax.ppermute(up, PIPE, fperm))
    if s.backward:
        down = jnp.where(row.down_f > 0, c.send_f, c.send_b) if a.down_carries_f else c.send_b
        c = replace(c, recv_b=jax.lax.ppermute(down, PIPE, bperm))
    return c


def tick(s: Step, stage, c: Carry, xs) -> Carry:
    """One tick on this stage (``stage``: its index on ``pipe``): file, run, send."""
    row, on = jax.tree.map(lambda a: take(a, stage), xs)
    last = row.last > 0
    c = file_arrivals(s, c, row)
    # Every chunk's loss is seeded (a MoE adds auxiliary losses on every chunk; a dense
    # chunk that is not the last has a constant zero loss). The loss may be a dict.
    dloss = jax.tree.map(lambda sd: jnp.ones(sd.shape, sd.dtype), s.loss_sd)
    counts = None if s.slot_counts is None else jnp.asarray(s.slot_counts)[stage]
    count, b_count = (None, None) if counts is None else (counts[row.chunk], counts[row.b_chunk])
    return send(s, run_ops(Tick(s, row, on, last, dloss, count, b_count), c), row)
