"""LoRA over a frozen base equals one device on every layout (dp, fsdp_tp, tensor × pipe with
1F1B and ZB-H1, expert parallelism): loss, adapter gradients and 3 steps (fp32); the base is
bit-identical after training and has no optimizer state."""
import jax
import numpy as np
import pytest
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.pipeline.pipelined import PipelineConfig
from triax.training.step import Trainer

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE = config.TINY.replace(num_layers=2, lora=LoraConfig(rank=4, alpha=8.0))
MOE = config.TINY_MOE.replace(num_layers=2, lora=LoraConfig(rank=4, alpha=8.0, targets=ATTN))
B, T, STEPS = 8, 16, 3
CASES = {  # name: (cfg, mesh sizes, strategy, pipeline)
    "dp": (DENSE, dict(data=8), "dp", None),
    "fsdp_tp": (DENSE, dict(data=2, tensor=4), "fsdp_tp", None),
    "tp_pipe_1f1b": (DENSE, dict(data=2, pipe=2, tensor=2), "tp", PipelineConfig("1f1b")),
    "tp_pipe_zbh1": (DENSE, dict(data=2, pipe=2, tensor=2), "tp", PipelineConfig("zb-h1")),
    "expert": (MOE, dict(data=2, expert=4), "dp", None),
}


def start_params(trainer):
    """The trainer's init with every B made non-zero (B = 0 would zero A's gradients)."""
    params = jax.device_get(trainer.init(0)["params"])
    ad, base = lora.split(params)
    rng = np.random.default_rng(1)
    ad = jax.tree_util.tree_map_with_path(
        lambda p, x: (0.05 * rng.standard_normal(x.shape)).astype(x.dtype)
        if p[-1].key == "b" else x, ad)
    return lora.join(ad, base)


def run(cfg, mesh, strategy, pipeline, params):
    tr = Trainer(cfg, mesh, strategy, pipeline=pipeline)
    params = jax.device_put(params, tr.param_shardings)
    (loss, aux), grads = tr.grads(params, tr.example_batch(B, T))
    state = jax.jit(tr.fresh_state, out_shardings=tr.state_shardings)(params)
    losses = []
    for i in range(STEPS):
        state, m = tr.step(state, tr.example_batch(B, T, seed=i))
        losses.append(float(m["loss"]))
    return dict(loss=float(loss), grads=jax.device_get(grads), losses=losses,
                params=jax.device_get(state["params"]),
                opt=jax.device_get(state["opt_state"]))


@pytest.fixture(scope="module")
def reference(devices):
    out = {}
    for cfg in (DENSE, MOE):
        tr = Trainer(cfg, make_mesh(devices=devices[:1]), "dp")
        init = start_params(tr)
        out[cfg] = (init, run(cfg, tr.mesh, "dp", None, init))
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_lora_matches_single_device(name, reference):
    cfg, sizes, strategy, pipeline = CASES[name]
    init, ref = reference[cfg]
    got = run(cfg, make_mesh(**sizes), strategy, pipeline, init)
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    # Gradients of the adapters only: the base has none.
    assert not lora.split(got["grads"])[1]
    assert_trees_close(got["grads"], ref["grads"], rtol=1e-5, atol=1e-7,
                       what=f"{name} adapter gradients")
    assert np.abs(np.concatenate([np.ravel(g) for g in jax.tree.leaves(got["grads"])])).max() > 0
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trees_close(got["params"], ref["params"], rtol=1e-5, atol=1e-5,
                       what=f"{name} params after {STEPS} steps")
    # The base is bit-identical after training; the adapters moved.
    ad0, base0 = lora.split(init)
    ad, base = lora.split(got["params"])
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(base)[0],
                            jax.tree.leaves(base0)):
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ad),
                                                        jax.tree.leaves(ad0)))
    # The optimizer state holds the adapters' moments only.
    n_opt = sum(np.size(x) for x in jax.tree.leaves(got["opt"]) if np.ndim(x))
    n_ad = sum(np.size(x) for x in jax.tree.leaves(ad))
    assert n_opt == 2 * n_ad == 2 * lora.param_count(cfg.lora, cfg), (n_opt, n_ad)


def test_step_zero_is_the_base(reference, devices):
    """B = 0 at init: the adapted model's loss is the base model's."""
    mesh = make_mesh(devices=devices[:1])
    tr = Trainer(DENSE, mesh, "dp")
    params = jax.device_get(tr.init(0)["params"])
    base_tr = Trainer(DENSE.replace(lora=None), mesh, "dp")
    (loss, _), _ = tr.grads(params, tr.example_batch(B, T))
    (base_loss, _), _ = base_tr.grads(lora.split(params)[1], tr.example_batch(B, T))
    assert float(loss) == float(base_loss)
