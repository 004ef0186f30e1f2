"""The split backward (``pipeline.split_backward``): B_in's input gradient and W's weight
gradients equal the full backward's, for the built-in Transformer (remat none and
full, MoE) and a user's ``PipelineModel``, on every first/last-chunk combination; and what
B_in stashes for W is smaller than the forward's residual set."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_checks import assert_trees_close
from user_models import ViT, VitConfig, image_batch, vit_loss

import triax

from triax.mesh import make_mesh
from triax.models import config
from triax.models.runtime import ExecConfig
from triax.pipeline.executor import loss_only
from triax.pipeline.split_backward import StageBackward
from triax.pipeline.stage import Stage
from triax.pipeline.stage_inputs import StageInputs
from triax.training.step import Trainer

B, T = 2, 8


def _split_vs_full(apply, chunk, pieces, inputs, x):
    consts = {"inv_total_weight": jnp.float32(0.1), "aux_scale": jnp.float32(0.5)}
    layers = jnp.arange(jax.tree.leaves(chunk)[0].shape[0], dtype=jnp.int32)
    sb = StageBackward.trace(apply, chunk, pieces, x,
                             StageInputs(inputs, consts, jnp.bool_(True), jnp.bool_(True),
                                         layers))

    @jax.jit
    def both(chunk, pieces, x, first, last, dy):
        extras = StageInputs(inputs, consts, first, last, layers)
        (_, loss), stored = sb.forward(chunk, pieces, x, extras)
        # The executor seeds every chunk's loss (a dict of aux losses for a MoE).
        dloss = jax.tree.map(lambda l: jnp.ones_like(l) * last, loss)
        full = sb.backward(stored, chunk, pieces, extras, dy, dloss)
        d_pieces, dx, cut = sb.backward_input(stored, chunk, pieces, extras, dy, dloss)
        assert [(c.shape, c.dtype) for c in cut] == \
            [(s.shape, s.dtype) for s in sb.cut_shapes]
        return full, (sb.backward_weight(stored, cut, chunk, pieces, extras), d_pieces, dx)

    dy = jnp.asarray(np.random.default_rng(3).normal(size=x.shape).astype(x.dtype))
    for first in (True, False):
        for last in (True, False):
            full, split = both(chunk, pieces, x, jnp.bool_(first), jnp.bool_(last), dy)
            # The same ops compiled apart: XLA may order a reduction differently (the
            # Transformer's agree bit for bit; the ViT's bias gradients by an ulp of the terms).
            assert_trees_close(split, full, what=f"first={first}, last={last}: (d_chunk, "
                                                 f"d_pieces, dx)")
    return sb


@functools.cache
def _model(name):
    """The model's graph and parameters from its trainer's one init program (the model built
    eagerly compiled a program per op), once per model for both remat settings."""
    cfg = config.get(name, num_layers=2)
    tr = Trainer(cfg, make_mesh(devices=jax.devices()[:1]), "dp")
    return cfg, tr.abstract.graphdef, tr.init(0)["params"]


def _transformer(name, remat="none"):
    """The split against the full backward of the model's stage; inputs drawn on the host."""
    cfg, gd, params = _model(name)
    pieces = {k: v for k, v in params.items() if k != "blocks"}
    rng = np.random.default_rng(1)
    inputs = {"inputs": jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T), np.int32)),
              "targets": jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T), np.int32)),
              "weights": jnp.ones((B, T), jnp.float32)}
    x = jnp.asarray(rng.normal(size=(B, T, cfg.embed_dim)).astype(np.float32))
    return _split_vs_full(loss_only(Stage(gd, ExecConfig(remat=remat))), params["blocks"],
                          pieces, inputs, x)


@pytest.mark.parametrize("name,remat", [("tiny", "none"), ("tiny", "full"), ("tiny-moe", "none")])
def test_split_equals_full_backward_transformer(name, remat):
    sb = _transformer(name, remat)
    if remat == "none":       # the cut is what W needs and B_in has: far less than F's stash
        assert sb.cut_bytes < 0.5 * sb.stash_bytes


def test_split_equals_full_backward_user_model_stage():
    c = VitConfig(layers=2)
    trainer = triax.Trainer.for_model(lambda rngs: ViT(c, rngs), vit_loss,
                                      make_mesh(devices=jax.devices()[:1]), "dp",
                                      rules={"pixels": None, "classes": None})
    gd, params = trainer.abstract.graphdef, trainer.init(seed=0)["params"]
    pieces = {k: v for k, v in params.items() if k != "blocks"}
    inputs = jax.tree.map(jnp.asarray, image_batch(c, B))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(B, c.patches, c.dim))
                    .astype(np.float32))
    _split_vs_full(loss_only(Stage(gd)), params["blocks"], pieces, inputs, x)


def test_stash_holds_activations_only():
    """F stashes only what the backward reads and cannot compute without the stage's input:
    the weights cast to the compute dtype (a copy of the chunk's weights per slot), the tied
    head's transpose, rotary tables and masks are recomputed, and leaves the pullback never
    reads are dropped. What is left is activations, so the stash scales with the
    micro-batch's rows (up to a scalar or two of loss bookkeeping)."""
    from triax.pipeline.buffer_sizes import activation_buffer_bytes
    from triax.pipeline.pipelined import PipelineConfig
    cfg, exe = config.TINY.replace(num_layers=2), ExecConfig(compute_dtype="bfloat16")
    stash = [activation_buffer_bytes(cfg, 2, PipelineConfig("1f1b", 4), exe, rows, 16)["stash"]
             for rows in (2, 4)]
    assert abs(stash[1] - 2 * stash[0]) <= 16


def test_zero_bubble_schedules_hold_1f1b_activation_buffers():
    """Issue 11: ZB-V and ZB-H1 at 1F1B's activation buffers (stash and inboxes, per stage;
    tiny, 8 layers, S=4, M=8), within 5%. ZB-V holds 2S chunks of half a stage, 1F1B's S
    stages; the post-stack's residuals (final norm, head) sit in head cells with slots of
    their own, which only the last chunk's micro-batches take (ZB-V: two at once, 1F1B:
    one) instead of in every chunk's slot; B_in's cut lives in its micro-batch's slot."""
    from triax.pipeline.buffer_sizes import activation_buffer_bytes
    from triax.pipeline.pipelined import PipelineConfig
    cfg = config.TINY.replace(num_layers=8)
    total = {k: sum(activation_buffer_bytes(cfg, 4, PipelineConfig(k, 8), ExecConfig(), 2,
                                            16).values())
             for k in ("1f1b", "zb-v", "zb-h1")}
    assert total["zb-v"] <= 1.05 * total["1f1b"], total
    assert total["zb-h1"] <= 1.05 * total["1f1b"], total


@pytest.mark.parametrize("kind", ["1f1b", "zb-h1"])
def test_a_pipelined_step_traces_its_stage_twice(kind, monkeypatch):
    """Tracing a pipelined training step runs the stage's Python twice, whatever the
    schedule's length: once for the shapes (``executor._trace_step``'s ``eval_shape``) and
    once under ``jax.vjp`` (``split_backward.Residuals.trace``), whose one jaxpr the stash
    layout, the backward's recomputed leaves and every tick's F read. (A second vjp trace
    for the recomputed leaves and one per F kernel took twice as long.)"""
    from triax.pipeline.pipelined import Pipeline, PipelineConfig
    calls = []
    call = Stage.__call__
    monkeypatch.setattr(Stage, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    pp = Pipeline(config.TINY.replace(num_layers=4), make_mesh(pipe=2, devices=jax.devices()[:2]),
                  "dp", PipelineConfig(kind, 4))
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), dict(pp.stored.shapes))
    ints = jax.ShapeDtypeStruct((8, 8), jnp.int32)
    jax.jit(pp.loss_and_grad).trace(params, {"inputs": ints, "targets": ints})
    assert len(calls) == 2


def test_the_stage_forward_is_traced_once():
    """``StageBackward.trace`` takes the stash's shapes, the loss's structure and the jaxpr
    ``Rebuild`` analyses from one trace of the stage's forward (it was traced three times:
    a third of the planner's per-chunk trace time)."""
    from triax.sharding.partition import abstract_model
    am = abstract_model(config.TINY.replace(num_layers=2))
    pieces = {k: v for k, v in am.shapes.items() if k != "blocks"}
    ints = jax.ShapeDtypeStruct((B, T), jnp.int32)
    extras = StageInputs({"inputs": ints, "targets": ints,
                          "weights": jax.ShapeDtypeStruct((B, T), jnp.float32)},
                         {"inv_total_weight": jnp.float32(1)}, True, True, jnp.arange(2))
    x = jax.ShapeDtypeStruct((B, T, config.TINY.embed_dim), jnp.float32)
    stage, calls = loss_only(Stage(am.graphdef)), []

    def apply(*args):
        calls.append(1)
        return stage(*args)
    StageBackward.trace(apply, am.shapes["blocks"], pieces, x, extras)
    assert len(calls) == 1
