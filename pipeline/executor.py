"""One executor for every schedule: ``shard_map`` over ``pipe`` (and ``data``), one ``lax.scan``
over the tick program, one run-or-skip conditional per op kind, ``ppermute`` between stages.

Per tick, every stage (1) files the messages that arrived into its inbox slots, (2) runs its
op from the program — idle, F, B, B_in or W — and (3) sends the forward activation to the
next stage and (schedules with a backward) the input gradient to the previous one with
``ppermute``. A forward stashes what its backward needs and cannot recompute (parameters
excluded) in a slot the program assigned; the backward reads it, adds the weight gradients
to the accumulator and frees the slot (ZB-H1, ZB-V: B_in writes its cut for W into the same
slot, over the residuals only B_in reads, ``pipeline.stash_layout``; W frees it). ZB-V's V sends
some activations down and some gradients up, and files a message on its own stage at the
turn; the program says which (``tick_program.Ticks``), so the V runs on the same two
channels. The tick itself — its typed carry, its context, one kernel per op kind — is
``pipeline.tick_kernels``; this module sets it up, scans it, and prices its buffers.

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

from dataclasses import dataclass, replace
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from triax.pipeline.buffers import take_state
from triax.pipeline.split_backward import StageBackward, pick_layout
from triax.pipeline.schedules import OpKind, Schedule
from triax.pipeline.stage_inputs import StageInputs
from triax.pipeline.stash_layout import StashLayout
from triax.pipeline.tick_kernels import DATA, PIPE, Arrivals, Carry, Step, tick
from triax.pipeline.tick_program import TickProgram, Ticks, compile_program
from triax.pipeline.timeline import LABELS

__all__ = ["DATA", "PIPE", "RunResult", "StepSpec", "TickResult", "branch_kinds", "loss_only",
           "run_ticks", "slot_buffer_bytes", "stash_layout"]


@dataclass(frozen=True, eq=False)
class StepSpec:
    """Static facts the scan body needs (all Python)."""

    program: TickProgram
    apply: Any                      # a pipeline.stage.Stage
    stages: int
    dtype: Any
    layers: Any                     # int32 [S, v, Lc]: StageLayers.layer_ids (numpy)
    state_mb_axis: int = 0          # micro-batch axis of a state leaf, after its chunk axis
    slot_counts: Any = None         # uneven stages: [S, v] int32 (StageLayers.slot_counts)


class TickResult(NamedTuple):
    loss: Any        # this stage's summed loss (a scalar, or the stage's loss dict)
    outputs: Any     # per-micro-batch outputs, leaves [M, ...] (meaningful on the last stage)
    state: Any       # the per-stage state after every tick
    grads: dict      # {"blocks": [v, Lc, ...], "pieces": ...} summed over micro-batches


class RunResult(NamedTuple):
    """What one pipelined run returns (``pipelined.Pipeline._run``), outside ``shard_map``."""

    loss: Any         # summed over stages and data shards
    outputs: Any      # per-micro-batch outputs, leaves [S, B, ...] (the last stage's: the model's)
    state: Any        # the per-stage state in storage layout ({} for none)
    grad_blocks: Any  # the stack's gradients in storage layout ({} forward-only)
    grad_pieces: Any  # the pre/post-stack's gradients ({} forward-only)


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
    per tick (``tests/test_pipeline_hlo.py``). ``inbox``: the forward and backward
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
    if prog.schedule.has_backward and jax.tree.leaves(state):
        raise ValueError("per-stage state is carried by forward-only schedules only; "
                         f"{prog.schedule.kind.value} has a backward")
    stage = jax.lax.axis_index(PIPE)
    layers = jnp.asarray(spec.layers)[stage]     # [v, Lc]: this stage's chunks' layers
    step, x0, out_sd = _trace_step(spec, blocks, pieces, inputs, consts, state, layers)
    flags = {k: (prog.ticks.kind == int(k)).astype(np.int32) for k in step.kinds}
    out, _ = jax.lax.scan(lambda c, xs: (tick(step, stage, c, xs), None),
                          _initial_carry(step, prog, x0, out_sd, state),
                          jax.tree.map(jnp.asarray, (prog.ticks, flags)))
    M = prog.out_slots
    grads = ({"blocks": out.acc_blocks, "pieces": out.acc_pieces} if step.backward
             else {"blocks": {}, "pieces": {}})
    return TickResult(out.loss, jax.tree.map(lambda a: a[:M], out.out), out.state, grads)


def _trace_step(spec: StepSpec, blocks, pieces, inputs, consts, state, layers):
    """The step's fixed facts (``tick_kernels.Step``), the activation's zeros and the
    outputs' shapes, from one trace of the stage on chunk 0 and micro-batch 0."""
    prog = spec.program
    apply, loss_apply = spec.apply, loss_only(spec.apply)
    chunk0 = jax.tree.map(lambda a: a[0], blocks)
    inputs0 = jax.tree.map(lambda a: a[0], inputs)
    # Uneven stages: a count leaf, traced like the real one (the slots' conditional stays).
    count0 = None if spec.slot_counts is None else jnp.int32(spec.slot_counts.max())
    extras0 = StageInputs(inputs0, consts, jnp.bool_(True), jnp.bool_(True), layers[0], count0)
    state0 = jax.tree.map(lambda a: take_state(a, 0, 0, spec.state_mb_axis), state)
    x_sd = apply.activation(chunk0, pieces, inputs0)
    x0 = jnp.zeros(x_sd.shape, spec.dtype)
    _, loss_sd, out_sd, _ = jax.eval_shape(apply, chunk0, pieces, x0, extras0, state0)
    sb = (StageBackward.trace(loss_apply, chunk0, pieces, x0, extras0)
          if prog.schedule.has_backward else None)
    step = Step(apply, loss_apply, sb, stash_layout(prog, sb) if sb else None, blocks, layers,
                pieces, inputs, consts, loss_sd, spec.dtype, spec.stages, spec.state_mb_axis,
                tuple(_used_kinds(prog.ticks)), Arrivals.of(prog),
                _perms(spec.stages, prog.schedule.wraps), spec.slot_counts)
    return step, x0, out_sd


def _initial_carry(step: Step, prog: TickProgram, x0, out_sd, state) -> Carry:
    def slots(n, sd):
        """n live slots +1 scratch (the inboxes, written every tick; the stash is written
        only inside F's and B_in's conditionals, always to a live slot: no scratch)."""
        return jnp.zeros((n + 1,) + tuple(sd.shape), sd.dtype)
    carry = Carry(fwd_inbox=slots(prog.fwd_slots, x0), recv_f=x0, send_f=x0,
                  loss=jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), step.loss_sd),
                  state=state, out=jax.tree.map(lambda s: slots(prog.out_slots, s), out_sd))
    if not step.backward:
        return carry
    if prog.both_ways:
        carry = replace(carry, recv_f_down=x0, recv_b_up=x0)
    return replace(carry, bwd_inbox=slots(prog.bwd_slots, x0), recv_b=x0, send_b=x0,
                   stash=step.layout.buffers(prog.stash_slots, prog.head_slots),
                   acc_blocks=jax.tree.map(jnp.zeros_like, step.blocks),
                   acc_pieces=jax.tree.map(jnp.zeros_like, step.pieces))


def loss_only(apply):
    """``(chunk, pieces, x, extras) -> (y, loss)``: the stateless part the backward needs."""
    def f(chunk, pieces, x, extras):
        y, loss, _, _ = apply(chunk, pieces, x, extras, {})
        return y, loss
    return f
