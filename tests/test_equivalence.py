"""Every strategy, on meshes that use each axis it names, equals the single-device step: loss,
every gradient, and the parameters after 3 optimizer steps (fp32)."""
import dataclasses
import re

import jax
import numpy as np
import pytest
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import ExecConfig, config, runtime
from triax.sharding import activation_sharding
from triax.sharding.introspect import bytes_over, collectives_from_compiled, memory_from_compiled
from triax.sharding.rules import get_strategy
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
B, T = 8, 16
# One mesh per strategy where one mesh already uses each axis the strategy names: dp and
# zero1 name only `data` (data=8); tp names `data` and `tensor` (2x4 uses both, tensor=4
# replicating the 2 KV heads). fsdp on 2x4 keeps the case of an axis the strategy leaves idle
# (weights replicated over `tensor`, sharded over a data=2). Dropped as the same path: dp 4x2,
# zero1 4x2 (the idle tensor axis, as fsdp 2x4), tp 1x8 and fsdp_tp 4x2 (the axes tp 2x4
# splits); fsdp 8x1 and fsdp_tp 2x4, whose rules the HSDP cases run with a replica axis added
# (fsdp's weights split over data=4: tests/test_hsdp.py; fsdp_tp's over data and tensor;
# tensor=4's replicated KV heads are tp 2x4's).
CASES = [("dp", 8, 1), ("fsdp", 2, 4), ("zero1", 8, 1), ("tp", 2, 4)]
# HSDP fsdp (replica=2 × data=4) is tests/test_hsdp.py's, against one device there, on the
# step whose collectives that file reads (one compile for both).
HSDP_CASES = [("fsdp_tp", dict(replica=2, data=2, tensor=2))]


def batches(trainer, n=3):
    return [trainer.example_batch(B, T, seed=i) for i in range(n)]


def with_grads(cfg, mesh, strategy, **kw):
    """A Trainer whose step's metrics carry the gradients: one compile checks the loss, the
    gradients (step 0's, at the initial parameters) and the parameters after the steps."""
    def loss_and_grad(params, batch):
        (loss, aux), grads = jax.value_and_grad(tr.loss_fn(), has_aux=True)(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    tr = Trainer(cfg, mesh, strategy, loss_and_grad=loss_and_grad, **kw)
    return tr


def run(trainer, init, n_steps=3, step=None):
    """From ``init`` (the one-device initial state, placed: no init compile per mesh);
    ``step``: the trainer's step compiled (``trainer.lower``), run instead of its own jit."""
    state = trainer.place(init)
    metrics = []
    for b in batches(trainer, n_steps):
        state, m = (step or trainer.step)(state, trainer.shard_batch(b))
        metrics.append(jax.device_get(m))
    losses = [float(m["loss"]) for m in metrics]
    return losses[0], metrics[0]["grads"], losses, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def one_device(devices):
    """The one-device trainer and its initial train state on the host, every run's start
    (``Trainer.place``; test_sharded_init.py: each mesh's own init is the same state)."""
    tr = with_grads(CFG, make_mesh(devices=devices[:1]), "dp")
    return tr, jax.device_get(tr.init(seed=0))


@pytest.fixture(scope="module")
def init(one_device):
    return one_device[1]


@pytest.fixture(scope="module")
def reference(one_device):
    return run(*one_device)


@pytest.fixture(scope="module")
def strategy_step():
    """``with_grads`` trainers of ``CASES`` and their compiled steps, made once: the program
    the equality test runs is the one the structural tests below read."""
    made = {}

    def get(strategy, data, tensor):
        if (strategy, data, tensor) not in made:
            tr = with_grads(CFG, make_mesh(data=data, tensor=tensor), strategy)
            made[strategy, data, tensor] = tr, tr.lower(B, T).compile()
        return made[strategy, data, tensor]
    return get


@pytest.mark.parametrize("strategy,data,tensor", CASES)
def test_strategy_matches_single_device(reference, init, strategy_step, strategy, data, tensor):
    ref_loss, ref_grads, ref_losses, ref_params = reference
    trainer, step = strategy_step(strategy, data, tensor)
    loss, grads, losses, params = run(trainer, init, step=step)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what="gradients")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6, what="params after 3 steps")


# Structural facts of two of the steps above, read from the programs the equality test ran
# (the gradients among their metrics are outputs: no collective, no argument). The other
# structural facts of the tiny steps are tests/test_collectives.py's.
def test_dp_gradient_all_reduce_equals_parameter_bytes(strategy_step):
    trainer, compiled = strategy_step("dp", 8, 1)
    cols = collectives_from_compiled(compiled, trainer.mesh)
    param_bytes = 4 * CFG.num_params
    ar = bytes_over(cols, "all-reduce", "data")
    assert abs(ar - param_bytes) <= 0.05 * param_bytes, (ar, param_bytes)
    assert {c.kind for c in cols} == {"all-reduce"}


def test_zero1_shards_only_optimizer_state(strategy_step):
    mem = memory_from_compiled(strategy_step("zero1", 8, 1)[1])
    P = 4 * CFG.num_params
    ideal = P + 2 * P / 8 + 2 * B * T * 4 // 8   # replicated params, sharded moments
    assert abs(mem.argument_bytes - ideal) <= 0.10 * ideal, (mem.argument_bytes, ideal)


@pytest.mark.parametrize("strategy,sizes", HSDP_CASES)
def test_hsdp_matches_single_device(reference, init, strategy, sizes):
    """HSDP: FSDP within each replica group of the batch, replicated across groups."""
    ref_loss, ref_grads, ref_losses, ref_params = reference
    trainer = with_grads(CFG, make_mesh(**sizes), strategy)
    assert "replica" in str(trainer.batch_sharding().spec)     # the batch split over groups
    loss, grads, losses, params = run(trainer, init)
    what = f"HSDP {strategy} on {sizes}"
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=what)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what=f"{what} gradients")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6, what=f"{what} params")


@pytest.mark.parametrize("strategy,data,tensor", [("tp_sp", 2, 4), ("fsdp_tp_sp", 4, 2)])
def test_tp_overlap_matches_single_device(reference, init, strategy, data, tensor):
    """--tp-overlap: SP's gathers and scatters as collective matmuls (ppermute rings)."""
    ref_loss, ref_grads, ref_losses, ref_params = reference
    st = dataclasses.replace(get_strategy(strategy), tp_overlap=True)
    mesh = make_mesh(data=data, tensor=tensor)
    with activation_sharding(mesh, st):                  # the collective matmuls are in
        assert runtime.current().matmul_scatter is not None
    loss, grads, losses, params = run(with_grads(CFG, mesh, st), init)
    what = f"tp-overlap {strategy} on data={data} tensor={tensor}"
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, err_msg=what)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what=f"{what} gradients")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=what)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6, what=f"{what} params")


def test_remat_matches_plain(reference, init):
    """Remat: loss, gradients and 3 steps equal the plain step's; the one compiled step, read
    for its memory, keeps under half the temporaries of its plain twin (HSDP fsdp_tp above,
    the same program: compiled once per run)."""
    mesh = make_mesh(**dict(HSDP_CASES)["fsdp_tp"])
    trainer = with_grads(CFG, mesh, "fsdp_tp", exe=ExecConfig(remat="full"))
    compiled = trainer.lower(B, T).compile()      # run, and read for its memory
    loss, grads, losses, params = run(trainer, init, step=compiled)
    ref_loss, ref_grads, ref_losses, ref_params = reference
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what="remat grads")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6, what="remat params")
    # Remat is on in the program: the compiled step keeps fewer temporaries than without.
    plain = with_grads(CFG, mesh, "fsdp_tp", exe=ExecConfig(remat="none"))
    temp = {name: c.memory_analysis().temp_size_in_bytes
            for name, c in (("remat", compiled), ("plain", plain.lower(B, T).compile()))}
    assert temp["remat"] < 0.6 * temp["plain"], temp


def test_bf16_compute_keeps_fp32_master(reference, init):
    """bf16 compute: every matmul the step hands XLA is bf16 × bf16 and the compiled program
    carries bf16 values (XLA's CPU backend then widens the dot arithmetic itself, so the
    compiled dot instructions are f32 on this backend); the loss moves off the fp32 one by
    bf16 rounding; parameters (the master copy) and gradients stay fp32."""
    ref_loss, *_ = reference
    trainer = with_grads(CFG, make_mesh(data=8), "dp", exe=ExecConfig(compute_dtype="bfloat16"))
    lowered = trainer.lower(B, T)
    dots = re.findall(r"stablehlo.dot_general .*: \((tensor<[^>]*>), (tensor<[^>]*>)\)",
                      lowered.as_text())
    assert dots and all(a.endswith("xbf16>") and b.endswith("xbf16>") for a, b in dots)
    compiled = lowered.compile()             # the one compile: the step, grads in its metrics
    assert "bf16[" in compiled.as_text()
    state, metrics = compiled(trainer.place(init), trainer.shard_batch(batches(trainer)[0]))
    loss, grads = metrics["loss"], metrics["grads"]
    assert 1e-6 * ref_loss < abs(float(loss) - ref_loss) < 2e-2 * ref_loss
    assert all(g.dtype == np.float32 for g in jax.tree.leaves(grads))
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(state["params"]))
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(trainer.abstract_state()["params"]))
