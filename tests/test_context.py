"""Context parallelism (``triax.sharding.context``) equals one device: loss, every gradient
and the parameters after 3 steps, fp32, for both schemes at context 2, 4 and 8 (with data,
tensor, packed documents, and pipe × context); and the compiled step moves K/V the way its
scheme says (ring: collective-permutes over ``context`` only; all-gather: K and V). The
ring's own structure (causal skipping, FLOP balance, memory) is tests/test_ring_attention.py."""
import dataclasses

import jax
import numpy as np
import pytest
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.introspect.hlo import collectives_from_compiled
from triax.sharding.rules import get_strategy
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=1)
B, T = 2, 16


def with_grads(loss_and_grad):
    """Report the gradients among the metrics: one compile of the step gives the loss and
    gradients at the initial parameters (step 0's) and the 3 steps, and is the program the
    HLO tests read (the gradients are one more output; K/V move the same)."""
    def f(params, batch):
        (loss, aux), grads = loss_and_grad(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    return f


def make(scheme, strategy="dp", devices=None, cfg=CFG, **mesh):
    """A Trainer whose step's metrics carry the gradients (``with_grads``)."""
    st = dataclasses.replace(get_strategy(strategy), context_attention=scheme)
    lg = lambda p, b: jax.value_and_grad(tr.loss_fn(), has_aux=True)(p, b)  # noqa: E731
    tr = Trainer(cfg, make_mesh(devices=devices, **mesh), st, loss_and_grad=with_grads(lg))
    return tr


def packed(trainer, seed=0):
    """Two documents per row, split at a row-dependent point (segment ids and positions)."""
    b = trainer.example_batch(B, T, seed=seed)
    cut = np.array([[5], [11]])
    t = np.arange(T)[None]
    b["segment_ids"] = np.where(t < cut, 1, 2).astype(np.int32)
    b["positions"] = np.where(t < cut, t, t - cut).astype(np.int32)
    return b


def run(trainer, n_steps=3, pack=False, init=None, rows=B, step=None):
    """Step 0's loss and gradients (from its metrics) and the parameters after ``n_steps``,
    from ``init`` (a host train state: the reference's, so no init compiles) or seed 0;
    ``step``: a compiled step to run instead of the trainer's."""
    state = trainer.init(seed=0) if init is None else \
        trainer.place(init)
    metrics = []
    for i in range(n_steps):
        b = packed(trainer, i) if pack else trainer.example_batch(rows, T, seed=i)
        state, m = (step or trainer.step)(state, trainer.shard_batch(b))
        metrics.append(jax.device_get(m))
    return float(metrics[0]["loss"]), metrics[0]["grads"], jax.device_get(state["params"])


def check(out, ref):
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    assert_trees_close(out[1], ref[1], rtol=1e-5, atol=1e-7, what="gradients")
    if out[2] is not None:
        assert_trees_close(out[2], ref[2], rtol=1e-5, atol=1e-6, what="params after 3 steps")


@pytest.fixture(scope="module")
def one_device(devices):
    """The one-device trainer and its initial train state on the host (every run's)."""
    tr = make("ring", devices=devices[:1])
    return tr, jax.device_get(tr.init(seed=0))


@pytest.fixture(scope="module")
def init(one_device):
    return one_device[1]


@pytest.fixture(scope="module")
def reference(one_device):
    return run(one_device[0], n_steps=3, init=one_device[1])


@pytest.fixture(scope="module")
def reference_packed(one_device):
    return run(one_device[0], n_steps=3, pack=True, init=one_device[1])


@pytest.fixture(scope="module")
def ring8():
    return make("ring", context=8)


def test_ring_context8_matches_single_device(reference, init, ring8):
    check(run(ring8, n_steps=3, init=init), reference)


# all-gather over context × data is test_packed_sequences_context4_matches's all-gather
# case (context=4, data=2: the same gather of K/V over context with the batch split over
# data, plus the documents' segment ids).
@pytest.mark.parametrize("scheme, strategy, mesh", [
    ("all-gather", "dp", dict(context=8)),
    ("ring", "fsdp_tp", dict(context=2, tensor=2, data=2)),
], ids=["all-gather-context8", "ring-context2-tensor2-data2"])
def test_matches_single_device(reference, init, devices, scheme, strategy, mesh):
    n = int(np.prod(list(mesh.values())))
    check(run(make(scheme, strategy, devices=devices[:n], **mesh), n_steps=3, init=init),
          reference)


@pytest.fixture(scope="module")
def all_gather4():
    return make("all-gather", context=4, data=2)


@pytest.mark.parametrize("scheme", ["ring", "all-gather"])
def test_packed_sequences_context4_matches(reference_packed, init, all_gather4, scheme):
    tr = all_gather4 if scheme == "all-gather" else make(scheme, context=4, data=2)
    check(run(tr, n_steps=3, pack=True, init=init), reference_packed)


def test_ring_moves_kv_by_collective_permute_over_context_only(ring8):
    coll = collectives_from_compiled(ring8.lower(B, T).compile(), ring8.mesh)
    permutes = [c for c in coll if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("context",) for c in permutes), permutes
    assert not [c for c in coll if c.kind == "all-gather" and "context" in c.axes], coll


def test_ring_step_runs_the_zigzag_halves(ring8):
    """The training step tells the ring its zigzag layout: each ring step's switch chooses
    between two halves of a block, both computing (an unknown layout gives skip / full).
    Their equal cost is tests/test_ring_attention.py's (here, at halves of one token, XLA
    turns one backward matmul into an elementwise product)."""
    from triax.sharding import ring
    from triax.sharding.introspect.ring_balance import ring_switches
    switches = ring_switches(ring8.lower(B, T).compile())
    assert {sw.scope for sw in switches} == {ring.FWD_SCOPE, ring.BWD_SCOPE}, switches
    for sw in switches:
        assert len(sw.branches) == 2 and min(b.flops for b in sw.branches) > 0, sw


def test_all_gather_context4_data2_gathers_exactly_kv(all_gather4):
    tr = all_gather4   # the packed step above: the same compiled program
    keys = ("inputs", "targets", "segment_ids", "positions")
    coll = collectives_from_compiled(tr.lower(B, T, keys).compile(), tr.mesh)
    gathers = [c for c in coll if c.kind == "all-gather" and c.axes == ("context",)]
    # K and V of the one layer: [B/data, T, kv_heads, head_dim] fp32 each (and their
    # int32 order and segment arrays [B/data, T], which the mask compares).
    kv_bytes = (B // 2) * T * CFG.num_kv_heads * CFG.head_dim * 4
    floats = sorted(c.bytes_per_device for c in gathers if c.bytes_per_device >= kv_bytes)
    assert sum(c.count for c in gathers if c.bytes_per_device == kv_bytes) == 2, gathers
    assert floats == [kv_bytes], gathers
    assert not [c for c in coll if c.kind == "collective-permute"], coll


def test_cli_choices_are_the_schemes():
    from triax.sharding.context import SCHEMES
    from triax.configs import leaves
    from triax.training.config import RunConfig
    field = leaves(RunConfig)["context_attention"].field
    assert tuple(field.metadata["choices"]) == SCHEMES


def test_pipe2_context2_ring_matches(devices):
    """The ring inside the pipeline's tick conditionals, in the zigzag layout: equal to one
    device (loss, gradients, 3 steps), collective-permutes over ``context`` in the compiled
    program, and each op's skip branch running as many collective-permutes as its run
    branch (``pipeline.permute_parity``: without that, XLA:CPU mixes the stages' sends).
    One compiled step (the gradients among its metrics) gives the numbers and the HLO."""
    from triax.pipeline.pipelined import Pipeline, PipelineConfig
    from triax.sharding.introspect.branch_costs import op_conditionals
    cfg, rows = CFG.replace(num_layers=2), 4
    st = dataclasses.replace(get_strategy("dp"), context_attention="ring")
    mesh = make_mesh(context=2, pipe=2, data=2)
    assert Trainer(cfg, mesh, st, pipeline=PipelineConfig("1f1b", 2)).context_layout == "zigzag"
    pipe = Pipeline(cfg, mesh, st, PipelineConfig("1f1b", 2))
    tr = Trainer(cfg, mesh, pipe.strategy, loss_and_grad=with_grads(pipe.loss_and_grad))
    ref = make("ring", devices=devices[:1], cfg=cfg)
    init = jax.device_get(ref.init(seed=0))
    compiled = tr.lower(rows, T).compile()
    check(run(tr, init=init, rows=rows, step=compiled), run(ref, init=init, rows=rows))
    coll = collectives_from_compiled(compiled, tr.mesh)
    assert [c for c in coll if c.kind == "collective-permute" and c.axes == ("context",)], coll
    # No K/V gathered ([micro-batch rows, T, kv_heads, head_dim] fp32; the gathers over
    # context left are the first stage's embedding gradient: tokens and dx, for its scatter).
    kv_bytes = (rows // 4) * T * CFG.num_kv_heads * CFG.head_dim * 4
    assert not [c for c in coll if c.kind == "all-gather" and "context" in c.axes
                and c.bytes_per_device == kv_bytes], coll
    ops = op_conditionals(compiled)
    assert ops["F"][1].permutes > 0 and ops["B"][1].permutes > ops["F"][1].permutes, ops
    assert all(skip.permutes == run.permutes for skip, run in ops.values()), ops


def visible_pairs_per_rank(order_T, C):
    """Unmasked (query, key) pairs each context rank's queries have, by the model's mask."""
    from triax.models.visibility import Visibility
    order_BT = np.asarray(order_T)[None]
    visible_TS = np.asarray(Visibility.self_attention(order_BT).mask())[0]
    return visible_TS.reshape(C, -1, visible_TS.shape[1]).sum(axis=(1, 2))


@pytest.mark.parametrize("C", [2, 4, 8])
def test_zigzag_layout_balances_causal_work(C):
    from triax.sharding.context import zigzag_order
    T = 64
    zig = visible_pairs_per_rank(zigzag_order(T, C), C)
    contiguous = visible_pairs_per_rank(np.arange(T), C)
    assert zig.max() / zig.mean() <= 1.1, zig
    assert contiguous.max() / contiguous.mean() > 1.4, contiguous   # about 2 - 1/C
    assert sorted(zigzag_order(T, C)) == list(range(T))   # a permutation: no token lost
