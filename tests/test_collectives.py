"""Structural facts read from the compiled HLO and from memory_analysis (exact, no timing).
dp's gradient all-reduce and zero1's sharded moments are tests/test_equivalence.py's, read
from the dp and zero1 steps (tiny, data=8) it runs against one device."""
import jax
import jax.numpy as jnp
import pytest
from layer_collectives import with_one_more_layer

from triax.mesh import make_mesh
from triax.models import config
from triax.sharding import activation_sharding
from triax.sharding.introspect import (bytes_over, collectives_from_compiled, inspect_trainer,
                                       memory_from_compiled)
from triax.training.step import Trainer

B, T = 8, 16


def count(collectives, kind, axis):
    return sum(c.count for c in collectives if c.kind == kind and axis in c.axes)


def step_program(cfg, mesh, strategy):
    return Trainer(cfg, mesh, strategy).lower(B, T).compile()


def forward_program(cfg, mesh, strategy):
    trainer = Trainer(cfg, mesh, strategy)

    def loss(params, batch):
        with activation_sharding(mesh, trainer.strategy):
            return trainer.loss_fn()(params, batch)[0]
    sh = trainer.batch_sharding()
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh) for k in ("inputs", "targets")}
    params = trainer.abstract_state()["params"]
    return jax.jit(loss).lower(params, batch).compile()


@pytest.fixture(scope="module")
def tp_mesh(devices):
    return make_mesh(tensor=2, devices=devices[:2])


@pytest.mark.parametrize("which,per_block", [("forward", 2), ("step", 4)])
def test_tp_all_reduces_per_block(tp_mesh, which, per_block):
    """Megatron TP: one all-reduce after attention and one after the MLP in the forward;
    their transposes in the backward; no per-layer all-gather of weights. Per block: the
    2-layer program's collectives with its layer scans run once more (``layer_collectives``;
    the 3-layer step compiles the same loop bodies)."""
    fn = forward_program if which == "forward" else step_program
    two, three = with_one_more_layer(fn(config.TINY.replace(num_layers=2), tp_mesh, "tp"),
                                     tp_mesh, layers=2, loops=1 if which == "forward" else 2)
    assert count(three, "all-reduce", "tensor") - count(two, "all-reduce", "tensor") == per_block
    assert count(three, "all-gather", "tensor") == count(two, "all-gather", "tensor") == 0
    # Per-block payload: B·T·D fp32 per all-reduce in the forward; in the backward the MLP's
    # input gradient (B·T·D) and attention's q/k/v input gradients (3·B·T·D, one tuple op).
    BTD = B * T * config.TINY.embed_dim * 4
    added = bytes_over(three, "all-reduce", "tensor") - bytes_over(two, "all-reduce", "tensor")
    assert added == (2 * BTD if which == "forward" else 6 * BTD)


def test_fsdp_memory_is_total_over_n(devices):
    cfg = config.TINY.replace(num_layers=2)
    mesh = make_mesh(data=8)
    trainer = Trainer(cfg, mesh, "fsdp")
    compiled = trainer.lower(B, T).compile()   # one compile: its memory and its collectives
    mem = memory_from_compiled(compiled)
    state_bytes = 3 * 4 * cfg.num_params  # params + Adam mu + nu, fp32
    batch_bytes = 2 * B * T * 4 // 8
    ideal = state_bytes / 8 + batch_bytes
    assert abs(mem.argument_bytes - ideal) <= 0.10 * ideal, (mem.argument_bytes, ideal)
    cols = collectives_from_compiled(compiled, mesh)
    assert count(cols, "all-gather", "data") > 0
    # The gradients are reduced over data (XLA's CPU backend all-reduces, then slices),
    # every one but the embedding table's (its lookup exchanges activations instead): far
    # more than the 4-byte loss all-reduce.
    reduced = bytes_over(cols, "reduce-scatter", "data") + bytes_over(cols, "all-reduce", "data")
    assert reduced >= 4 * (cfg.num_params - cfg.vocab_size * cfg.embed_dim), reduced


def test_report_json_contract(devices):
    trainer = Trainer(config.TINY.replace(num_layers=2), make_mesh(data=2, tensor=4), "fsdp_tp")
    report = inspect_trainer(trainer, B, T).to_json()
    assert set(report["memory"]) >= {"argument_bytes", "output_bytes", "temp_bytes"}
    assert report["collectives"] and set(report["collectives"][0]) == {
        "kind", "axes", "bytes_per_device", "count", "frequency_known", "branch", "at_most"}
    row = next(p for p in report["params"] if p["path"] == "blocks/attn/wq_DNH")
    assert row["logical_axes"] == ["layers", "embed", "heads", "head_dim"]
    assert row["spec"] == [None, "data", "tensor"]
    assert row["global_shape"] == [2, 64, 8, 8] and row["shard_shape"] == [2, 32, 2, 8]
    assert row["bytes_per_device"] == 2 * 32 * 2 * 8 * 4
