"""Structural facts of the compiled pipeline step (tiny, 2 layers, data=2 × pipe=2, a
micro-batch of ``b`` rows per device): memory_analysis, HLO collectives, and no per-tick
tax (issue 11).

The tick tax: at two MLP widths, doubling the width doubles most of a stage's parameter
bytes, and must not change the bytes the tick loop copies or materialises per tick (1F1B,
ZB-H1, and DualPipeV, whose F&B reads one slot of the stash and writes another in one
branch). ZB-H1's compiled temporaries stay within 5% of 1F1B's: B_in's cut for W lives in
the stash slot of its micro-batch. The narrow width is tiny's own, so 1F1B's narrow step
is the M=4 program the other tests read (one compile)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.mesh import make_mesh
from triax.models import config
from triax.models.layers import ExecConfig
from triax.pipeline.buffer_sizes import activation_buffer_bytes
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.sharding.introspect import collectives_from_compiled, memory_from_compiled
from triax.sharding.introspect.loop_bytes import loop_bytes

CFG = config.TINY.replace(num_layers=2)
b, T, S = 2, 16, 2  # micro-batch size fixed, so the global batch grows with M
WIDTHS = (CFG.mlp_dim, 2 * CFG.mlp_dim)


def compile_step(kind, M, mlp=CFG.mlp_dim):
    """The loss-and-gradient step compiled on abstract inputs, on data=2 × pipe=2 (the
    schedules' memory does not depend on data, whose micro-batch per device is ``b``;
    the collective test reads its data reduction), once per (schedule, M, width)."""
    return _compile_step(kind, M, mlp)


@functools.cache
def _compile_step(kind, M, mlp):
    mesh = make_mesh(data=2, pipe=S, devices=jax.devices()[:4])
    cfg = CFG.replace(mlp_dim=mlp)
    pp = Pipeline(cfg, mesh, "dp", PipelineConfig(kind, M))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), pp.abstract.shapes)
    batch = {k: jax.ShapeDtypeStruct((b * M * pp.data, T), jnp.int32)
             for k in ("inputs", "targets")}
    return pp, jax.jit(pp.loss_and_grad).lower(params, batch).compile()


@pytest.fixture(scope="module")
def temps(devices):
    """1F1B and GPipe at M = 2S and 8S: the temporaries of each."""
    return {(k, M): memory_from_compiled(compile_step(k, M)[1]).temp_bytes
            for k in ("1f1b", "gpipe") for M in (4, 16)}


def test_1f1b_temporaries_below_gpipe(temps):
    for M in (4, 16):  # M = 2S and 8S
        assert temps[("1f1b", M)] < temps[("gpipe", M)]


def test_1f1b_flat_while_gpipe_grows(temps):
    assert temps[("1f1b", 16)] < 1.1 * temps[("1f1b", 4)]
    assert temps[("gpipe", 16)] > 2 * temps[("gpipe", 4)]


def test_pipe_carries_only_permutes_and_the_scan_is_not_unrolled(devices):
    pp, compiled = compile_step("1f1b", 4)
    ticks = pp.schedule.ticks
    colls = collectives_from_compiled(compiled, pp.mesh)
    over_pipe = [c for c in colls if "pipe" in c.axes]
    D = CFG.embed_dim
    # Activations forward and gradients backward: one permute each per tick, b*T*D fp32.
    permutes = [c for c in over_pipe if c.kind == "collective-permute"]
    assert [(c.bytes_per_device, c.count) for c in permutes] == [(b * T * D * 4, 2 * ticks)]
    # The only other traffic over pipe: the loss, and the gradients of the parameters that
    # live on one stage only (embedding on the first, final norm and head on the last).
    others = [c for c in over_pipe if c.kind != "collective-permute"]
    assert {c.kind for c in others} == {"all-reduce"}
    pieces = sum(int(np.prod(s.shape)) * 4 for k, v in pp.abstract.shapes.items()
                 if k != "blocks" for s in jax.tree.leaves(v))
    assert sorted(c.count * c.bytes_per_device for c in others) == [4, pieces]
    # Data-parallel gradient reduction: once per step, not per micro-batch.
    over_data = [c for c in colls if c.axes == ("data",)]
    assert [c.count for c in over_data] == [1] and over_data[0].kind == "all-reduce"
    # The tick loop is one while loop: two permute instructions in the text, run `ticks` times.
    text = compiled.as_text()
    assert len(re.findall(r"\scollective-permute(?:-start)?\(", text)) == 2
    assert f'"known_trip_count":{{"n":"{ticks}"}}' in text


# ---- the tick tax -----------------------------------------------------------------------

M_TAX = 4
# The messages each op kind sends per execution, one activation each: what a tick may
# materialise, summed over the op kinds' branches as if every one ran (1F1B's F and B;
# ZB-H1's F and B_in; DualPipeV's F, B, B_in, and F&B's two).
MESSAGES = {"1f1b": 2, "zb-h1": 2, "dualpipev": 5}
KINDS = tuple(MESSAGES)


@functools.cache
def tick_step(kind, mlp):
    pp, compiled = compile_step(kind, M_TAX, mlp)
    stage_bytes = sum(int(np.prod(s.shape)) * 4
                      for s in jax.tree.leaves(pp.abstract.shapes["blocks"])) // S
    bufs = activation_buffer_bytes(CFG.replace(mlp_dim=mlp), S, PipelineConfig(kind, M_TAX),
                                   ExecConfig(), b, T)
    return {"loop": loop_bytes(compiled), "temp": memory_from_compiled(compiled).temp_bytes,
            "stage_bytes": stage_bytes, "buffers": bufs}


@pytest.mark.parametrize("kind", KINDS)
def test_tick_bytes_do_not_grow_with_stage_parameters(devices, kind):
    narrow, wide = (tick_step(kind, w) for w in WIDTHS)
    grown = wide["stage_bytes"] - narrow["stage_bytes"]
    assert grown > narrow["stage_bytes"] // 2          # the width really moves the parameters
    # Nothing is copied whole per tick: the accumulator and the stash are updated in place.
    assert wide["loop"].copies + wide["loop"].branch_copies < 64
    # What is materialised per tick is the messages an op produces, not parameter-sized.
    assert wide["loop"].total == narrow["loop"].total
    assert wide["loop"].fresh_results <= MESSAGES[kind] * b * T * config.TINY.embed_dim * 4


def test_zb_h1_holds_1f1b_memory(devices):
    """Issue 11: ZB-H1's compiled temporaries within 5% of 1F1B's. Its stash holds 1F1B's S
    micro-batches (peak in flight S, counted until W), and B_in's cut for W lives in the
    micro-batch's own slot, over the residuals only B_in reads (``pipeline.stash_layout``):
    no cut buffer of its own (with one, 1.11x). What it holds beyond 1F1B: the cut's pieces
    that find no free cell (the grouped-query K/V cotangents, the norm scales' gradients),
    and the head's residuals on every slot, since its last stage keeps S micro-batches of
    the last chunk until their W, where 1F1B keeps one. B_in sums the pre/post-stack's
    gradients into their accumulator inside its ordering conditional: returned fresh from
    it, the head's vocabulary-sized gradient held a buffer of its own through B_in (on
    JAX 0.12, 1.0525x at width 128)."""
    for w in WIDTHS:
        zb, ob = tick_step("zb-h1", w), tick_step("1f1b", w)
        assert zb["buffers"]["inbox"] == ob["buffers"]["inbox"]
        assert zb["temp"] <= 1.05 * ob["temp"]
