"""The planner's MoE and pipeline-loop memory terms against the loops XLA compiles.

A layer loop keeps for the backward what its forward stacks: the loop's zero-initialised
stacked outputs (``[trips, ...]`` buffers). These tests read them off compiled HLO and set
them beside what ``costs.memory`` counts, term by term:

* an MoE layer's residuals (``moe_residual_elements``: traced from ``models.moe``, the ones
  its pullback reads), on scanned MoE layers alone;
* the per-layer copy of a device's expert weights that the expert runner's ``pcast`` over
  ``data`` makes (``_expert_weight_copies``), and its absence without a data axis;
* a pipelined op's layer loop when a chunk holds several layers: F's loop stacks the
  residual set (``activation_buffer_bytes``' ``loop``) and B's loop stacks the chunk's
  gradient (``_fresh_grad_elements``); a one-layer chunk runs no loop.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triax.mesh import make_mesh
from triax.models import config
from triax.models.config import MoEConfig
from triax.models.moe import MoE
from triax.models.layers import ExecConfig
from triax.pipeline.buffer_sizes import activation_buffer_bytes
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.costs.activations import (_expert_weight_copies, layer_activation_elements,
                                       moe_residual_elements)
from triax.costs.memory import _fresh_grad_elements
from triax.costs.workload import Layout, Workload
from triax.sharding.introspect.hlo_text import compiled_text, parse_module
from triax.training.step import Trainer

F32 = 4


def _stacked(compiled, scope: str) -> list[tuple[tuple[int, ...], str]]:
    """Shapes of the zero-initialised ``[trips, ...]`` outputs of the loops whose op name
    ends with ``scope``: what the loop's iterations fill (not the inputs it slices)."""
    m = parse_module(compiled_text(compiled))
    found = []
    for comp, instrs in m.comps.items():
        for ins in instrs:
            name = re.search(r'op_name="([^"]*)"', ins.rest)
            if ins.op != "while" or not name or not name.group(1).endswith(scope):
                continue
            for operand in m.instr(comp, ins.operands[0]).operands:
                src = origin = m.instr(comp, operand)
                while origin is not None and origin.op in ("copy", "bitcast"):
                    origin = m.instr(comp, origin.operands[0])
                if origin is not None and origin.op == "fusion":
                    origin = m.root(dict(origin.calls)["calls"])
                if origin is not None and origin.op == "broadcast" and len(src.shapes) == 1 \
                        and src.shapes[0][0][:1] == (ins.trip_count,):
                    found.append(src.shapes[0])
    return found


def _nbytes(shapes) -> int:
    from triax.sharding.introspect.hlo_text import DTYPE_BYTES
    return sum(int(np.prod(s)) * DTYPE_BYTES[dt] for s, dt in shapes)


L_MOE, B_MOE, T_MOE = 3, 2, 16


def _moe_cfg(width: int):
    return config.TINY_MOE.replace(moe=MoEConfig(num_experts=8, top_k=2, mlp_dim=width,
                                                 capacity_factor=1.5))


def _stacked_moe_residuals(width: int) -> int:
    """Bytes the forward loop of three scanned MoE layers (nothing else) stacks, one device."""
    cfg = _moe_cfg(width)

    @nnx.split_rngs(splits=L_MOE)
    @nnx.vmap(in_axes=0, out_axes=0)
    def stack(rngs):
        return MoE(cfg, rngs)
    gd, layers = nnx.split(nnx.eval_shape(lambda: stack(nnx.Rngs(0))))

    def loss(layers, x):
        def body(carry, layer):
            x, aux = carry
            y, a = nnx.merge(gd, layer)(x, jnp.float32)
            return (x + y, aux + a["moe_loss_weighted"]), None
        (y, aux), _ = jax.lax.scan(body, (x, 0.0), layers)
        return jnp.sum(y) + aux

    x = jax.ShapeDtypeStruct((B_MOE, T_MOE, cfg.embed_dim), jnp.float32)
    return _nbytes(_stacked(jax.jit(jax.grad(loss)).lower(layers, x).compile(), "jvp()/while"))


@pytest.fixture(scope="module")
def moe_loops():
    return {w: _stacked_moe_residuals(w) for w in (32, 64)}


def test_moe_residuals_are_what_the_layer_loop_stacks(moe_loops):
    """Three scanned MoE layers (expert width 32 ≠ D = 64, capacity factor 1.5) on one
    device: the forward loop stacks each layer's input and exactly the residuals the planner
    counts per token (per capacity slot the expert input and six F-wide SwiGLU
    intermediates; the combine's top_k·D; routing). Counting every residual the pullback
    has, dead ones too, misses by a D per slot."""
    tokens = B_MOE * T_MOE
    per_layer = moe_residual_elements(_moe_cfg(32), T_MOE, 1, "none") * tokens \
        + tokens * config.TINY_MOE.embed_dim        # the scan's stacked layer input
    assert L_MOE * per_layer * F32 == pytest.approx(moe_loops[32], rel=0.01)


def test_planner_block_counts_the_traced_moe_term(moe_loops):
    """The planner's per-block count (``layer_activation_elements``, what ``estimate``
    uses) grows with the expert width as the compiled loop does: six F-wide buffers per
    capacity slot (the hand-written four would grow two thirds as fast)."""
    tokens = B_MOE * T_MOE
    grown = (layer_activation_elements(_moe_cfg(64), tokens, T_MOE, 1, "none")
             - layer_activation_elements(_moe_cfg(32), tokens, T_MOE, 1, "none"))
    assert L_MOE * grown * F32 == pytest.approx(moe_loops[64] - moe_loops[32], rel=0.01)


@pytest.mark.parametrize("sizes,copies", [(dict(data=2, expert=4), True),
                                          (dict(expert=8), False)])
def test_expert_weight_copies_are_in_the_compiled_step(devices, sizes, copies):
    """With a data axis the runner marks the expert weights per-shard, and the layer scan
    stacks that copy of each layer's local expert weights [E/EP, D, F] (three matrices):
    what the planner adds per layer. Without one the weights are the scan's own inputs."""
    L = 2
    cfg = config.get("tiny-moe", num_layers=L)
    compiled = Trainer(cfg, make_mesh(**sizes), "dp").lower(8, 16).compile()
    moe = cfg.moe
    weight = (L, moe.num_experts // sizes["expert"], cfg.embed_dim, moe.mlp_dim)
    found = [s for s in _stacked(compiled, "jvp()/while") if s[0] == weight]
    assert len(found) == (3 if copies else 0)
    w = Workload.of(cfg, train=True, dtype="fp32", batch=8, seq=16)
    assert L * _expert_weight_copies(w, Layout(**sizes, strategy="dp")) * F32 \
        == _nbytes(found)


def _pipelined(layers: int, devices):
    S, M, b, T = 2, 2, 2, 16
    cfg = config.TINY.replace(num_layers=layers)
    pp = Pipeline(cfg, make_mesh(pipe=S, devices=jax.devices()[:S]), "dp",
                  PipelineConfig("1f1b", M))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), pp.abstract.shapes)
    batch = {k: jax.ShapeDtypeStruct((b * M, T), jnp.int32) for k in ("inputs", "targets")}
    compiled = jax.jit(pp.loss_and_grad).lower(params, batch).compile()
    w = Workload.of(cfg, train=True, dtype="fp32", batch=b * M, seq=T)
    lay = Layout(pipe=S, strategy="dp", microbatches=M)
    bufs = activation_buffer_bytes(cfg, S, PipelineConfig("1f1b", M), ExecConfig(), b, T)
    return compiled, bufs, _fresh_grad_elements(w, lay) * F32


F_LOOP = "pipeline_op_F/cond/branch_1_fun/jvp()/while"
B_LOOP = "pipeline_op_B/cond/branch_1_fun/transpose(jvp())/while"


def test_pipelined_op_loop_stacks_residuals_and_chunk_gradient(devices):
    """Three layers per chunk: F's layer loop stacks one micro-batch's residual set before
    the executor writes it into the stash slot (the planner's ``loop``), and B's loop stacks
    the chunk's three blocks' gradients before they are added up (``_fresh_grad_elements``).
    One layer per chunk: XLA inlines the one-trip loop, and neither exists."""
    compiled, buffers, grads = _pipelined(6, devices)
    assert buffers["loop"] == pytest.approx(_nbytes(_stacked(compiled, F_LOOP)), rel=0.02)
    assert grads == _nbytes(_stacked(compiled, B_LOOP))
    one, one_buffers, one_grads = _pipelined(2, devices)
    assert not _stacked(one, F_LOOP) and not _stacked(one, B_LOOP)
    assert one_buffers["loop"] == 0 and one_grads == grads // 3
