"""Context parallelism (``triax.sharding.context``) equals one device: loss, every gradient
and (ring, context=8) the parameters after 3 steps, fp32; and the compiled step moves K/V the
way its scheme says (ring: collective-permutes over ``context`` only; all-gather: K and V)."""
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


def make(scheme, strategy="dp", devices=None, **mesh):
    st = dataclasses.replace(get_strategy(strategy), context_attention=scheme)
    return Trainer(CFG, make_mesh(devices=devices, **mesh), st)


def packed(trainer, seed=0):
    """Two documents per row, split at a row-dependent point (segment ids and positions)."""
    b = trainer.example_batch(B, T, seed=seed)
    cut = np.array([[5], [11]])
    t = np.arange(T)[None]
    b["segment_ids"] = np.where(t < cut, 1, 2).astype(np.int32)
    b["positions"] = np.where(t < cut, t, t - cut).astype(np.int32)
    return b


def run(trainer, n_steps=0, pack=False):
    state = trainer.init(seed=0)
    batches = [packed(trainer, i) if pack else trainer.example_batch(B, T, seed=i)
               for i in range(max(n_steps, 1))]
    (loss, _), grads = trainer.grads(state["params"], batches[0])
    params = None
    if n_steps:
        for b in batches:
            state, _ = trainer.step(state, b)
        params = jax.device_get(state["params"])
    return float(loss), jax.device_get(grads), params


def check(out, ref):
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    assert_trees_close(out[1], ref[1], rtol=1e-5, atol=1e-7, what="gradients")
    if out[2] is not None:
        assert_trees_close(out[2], ref[2], rtol=1e-5, atol=1e-6, what="params after 3 steps")


@pytest.fixture(scope="module")
def reference(devices):
    return run(make("ring", devices=devices[:1]), n_steps=3)


@pytest.fixture(scope="module")
def reference_packed(devices):
    return run(make("ring", devices=devices[:1]), pack=True)


@pytest.fixture(scope="module")
def ring8():
    return make("ring", context=8)


def test_ring_context8_matches_single_device(reference, ring8):
    check(run(ring8, n_steps=3), reference)


def test_ring_moves_kv_by_collective_permute_over_context_only(ring8):
    coll = collectives_from_compiled(ring8.lower(B, T).compile(), ring8.mesh)
    permutes = [c for c in coll if c.kind == "collective-permute"]
    assert permutes and all(c.axes == ("context",) for c in permutes), permutes
    assert not [c for c in coll if c.kind == "all-gather" and "context" in c.axes], coll


def test_all_gather_context4_data2_matches_and_gathers_exactly_kv(reference):
    tr = make("all-gather", context=4, data=2)
    check(run(tr), reference)
    coll = collectives_from_compiled(tr.lower(B, T).compile(), tr.mesh)
    gathers = [c for c in coll if c.kind == "all-gather" and c.axes == ("context",)]
    # K and V of the one layer: [B/data, T, kv_heads, head_dim] fp32 each (and their
    # int32 order arrays [B/data, T], which the mask compares).
    kv_bytes = (B // 2) * T * CFG.num_kv_heads * CFG.head_dim * 4
    floats = sorted(c.bytes_per_device for c in gathers if c.bytes_per_device >= kv_bytes)
    assert sum(c.count for c in gathers if c.bytes_per_device == kv_bytes) == 2, gathers
    assert floats == [kv_bytes], gathers
    assert not [c for c in coll if c.kind == "collective-permute"], coll


def test_ring_context2_tensor2_data2_matches(reference):
    check(run(make("ring", "fsdp_tp", context=2, tensor=2, data=2)), reference)


def test_packed_sequences_ring_context4_matches(reference_packed):
    check(run(make("ring", context=4, data=2), pack=True), reference_packed)


def test_cli_choices_are_the_schemes():
    from triax.sharding.context import SCHEMES
    from triax.training.config import RunConfig
    field = RunConfig.__dataclass_fields__["context_attention"]
    assert tuple(field.metadata["choices"]) == SCHEMES


def test_pipe2_context2_matches(devices):
    from triax.pipeline.runner import PipelineConfig
    cfg = CFG.replace(num_layers=2)

    def grads(mesh, pipeline=None):
        tr = Trainer(cfg, mesh, dataclasses.replace(get_strategy("dp"), context_attention="ring"),
                     pipeline=pipeline)
        (loss, _), g = tr.grads(tr.init(seed=0)["params"], tr.example_batch(4, T))
        return float(loss), jax.device_get(g), None
    check(grads(make_mesh(context=2, pipe=2, data=2), PipelineConfig("1f1b", 2)),
          grads(make_mesh(devices=devices[:1])))


def visible_pairs_per_rank(order_T, C):
    """Unmasked (query, key) pairs each context rank's queries have, by the model's mask."""
    from triax.models.attention import Visibility
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
