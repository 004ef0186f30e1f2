"""The MoE layer against a dense loop-over-experts reference; capacity drops; bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_checks import assert_trees_close
from triax.mesh import make_mesh
from triax.models import config
from triax.models.config import MoEConfig
from triax.models.moe import MoE, capacity
from triax.sharding.partition import abstract_model, param_shardings
from triax.sharding.rules import ShardingError


def dense_reference(p, x_BTD, moe: MoEConfig, keep_BTR=None):
    """Every expert on every token, weighted by its gate where it was chosen (and kept)."""
    logits_BTE = x_BTD @ p["router_DE"]
    top_BTR, idx_BTR = jax.lax.top_k(logits_BTE, moe.top_k)
    gates_BTR = jax.nn.softmax(top_BTR, axis=-1)
    if keep_BTR is not None:
        gates_BTR = gates_BTR * keep_BTR
    y_BTD = jnp.zeros_like(x_BTD)
    for e in range(moe.num_experts):
        h = jax.nn.silu(x_BTD @ p["w_gate_EDF"][e]) * (x_BTD @ p["w_up_EDF"][e])
        w_BT = jnp.sum(jnp.where(idx_BTR == e, gates_BTR, 0.0), axis=-1)
        y_BTD = y_BTD + w_BT[..., None] * (h @ p["w_down_EFD"][e])
    probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
    frac_E = jnp.mean(jax.nn.one_hot(idx_BTR, moe.num_experts).sum(2), axis=(0, 1)) / moe.top_k
    lb = moe.num_experts * jnp.sum(frac_E * jnp.mean(probs_BTE, axis=(0, 1)))
    z = jnp.mean(jax.nn.logsumexp(logits_BTE, axis=-1) ** 2)
    return y_BTD, lb, z


def _layer(moe: MoEConfig, seed=0):
    """The layer's graph and its initial parameters, made in one program (eagerly, each
    random op would compile a program of its own)."""
    cfg = config.TINY_MOE.replace(moe=moe)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: MoE(cfg, nnx.Rngs(seed))))
    params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(MoE(cfg, nnx.Rngs(seed)))))()
    return graphdef, params


def _apply(graphdef, params, x_BTD):
    return nnx.merge(graphdef, params)(x_BTD, jnp.float32)


def test_dropless_layer_equals_dense_reference_outputs_and_grads():
    moe = MoEConfig(num_experts=4, top_k=2, mlp_dim=16, z_loss_weight=1e-3)
    graphdef, params = _layer(moe)
    x_BTD = jax.random.normal(jax.random.key(1), (2, 8, 64))
    cot_BTD = jax.random.normal(jax.random.key(2), (2, 8, 64))

    def loss(params, x, fn):
        y, lb, z = fn(params, x)
        return jnp.sum(y * cot_BTD) + 0.01 * lb + 1e-3 * z, (y, lb, z)

    def ours(params, x):
        y, aux = _apply(graphdef, params, x)
        return y, aux["moe_lb_loss"], aux["moe_z_loss"]

    grad = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
    (l1, out1), g1 = jax.jit(lambda p, x: grad(p, x, ours))(params, x_BTD)
    (l2, out2), g2 = jax.jit(lambda p, x: grad(p, x, lambda p, x: dense_reference(p, x, moe)))(
        params, x_BTD)
    assert_trees_close(out1, out2, what="outputs/lb/z")
    assert_trees_close(g1, g2, what="grads")
    _, aux = jax.jit(lambda p, x: _apply(graphdef, p, x))(params, x_BTD)
    assert float(aux["moe_dropped_tokens"]) == 0.0
    np.testing.assert_allclose(aux["moe_loss_weighted"], 0.01 * out1[1] + 1e-3 * out1[2],
                               rtol=1e-6)


def test_capacity_mode_drops_exactly_the_rule():
    # E=4, k=2, T=8, capacity_factor=1 → C = ceil(1·8·2/4) = 4 slots per expert per sequence.
    # Tokens 0-3 choose (expert 0, then 1); tokens 4-7 choose (1, then 2). Expert 1 fills its
    # 4 slots with the first choices of tokens 4-7 (first choices take priority), so exactly the
    # second choices of tokens 0-3 are dropped, although they come earlier in the sequence.
    moe = MoEConfig(num_experts=4, top_k=2, mlp_dim=16, capacity_factor=1.0)
    assert capacity(moe, 8) == 4
    graphdef, params = _layer(moe)
    params = {k: 30.0 * np.asarray(v) for k, v in params.items()}   # O(1) expert outputs
    params["router_DE"] = np.eye(64, 4, dtype=np.float32)
    first = np.array([0, 0, 0, 0, 1, 1, 1, 1])
    second = np.array([1, 1, 1, 1, 2, 2, 2, 2])
    x_TD = 2.0 * np.eye(64)[first] + 1.0 * np.eye(64)[second]
    x_TD = x_TD + 0.01 * np.asarray(jax.random.normal(jax.random.key(3), (8, 64))) * (
        np.arange(64) >= 4)   # content for the experts, no effect on routing
    x_BTD = jnp.asarray(np.stack([x_TD, x_TD]), jnp.float32)
    y, aux = jax.jit(lambda p, x: _apply(graphdef, p, x))(params, x_BTD)
    keep_BTR = np.ones((2, 8, 2), np.float32)
    keep_BTR[:, :4, 1] = 0.0
    ref = jax.jit(dense_reference, static_argnums=2)
    y_ref, _, _ = ref(params, x_BTD, moe, keep_BTR)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert float(aux["moe_dropped_tokens"]) == 2 * 4
    # And the dropped route mattered: without dropping, tokens 0-3 would differ.
    y_all, _, _ = ref(params, x_BTD, moe, np.ones_like(keep_BTR))
    assert np.abs((np.asarray(y_all) - np.asarray(y))[:, :4]).max() > 1e-2
    np.testing.assert_allclose(y_all[:, 4:], y[:, 4:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kw, match", [
    (dict(num_experts=8, top_k=9), "top_k=9 exceeds num_experts=8"),
    (dict(capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(capacity_factor=-1.5), "capacity_factor=-1.5 must be > 0"),
])
def test_bad_moe_config(kw, match):
    with pytest.raises(ValueError, match=match):
        MoEConfig(**kw)


def test_experts_not_divisible_by_expert_axis(devices):
    cfg = config.TINY_MOE.replace(num_layers=1, moe=MoEConfig(num_experts=6, mlp_dim=16))
    am = abstract_model(cfg)
    with pytest.raises(ShardingError, match=r"num_experts=6 is not divisible by the expert mesh "
                                            r"axis.*size 4.*expert=2"):
        param_shardings(am, make_mesh(data=2, expert=4), "dp")


def test_bf16_expert_parallel_layer_grads(devices):
    """bf16 compute over data × expert: weight gradients reduce over data in fp32 (a bf16
    reduction there once crashed XLA:CPU) and match the fp32 local layer to bf16 precision."""
    from triax.models import runtime
    from triax.sharding.experts import expert_runner
    from triax.sharding.rules import get_strategy
    graphdef, params = _layer(MoEConfig(num_experts=8, top_k=2, mlp_dim=32))
    x_BTD = jax.random.normal(jax.random.key(4), (8, 8, 64))
    runner = expert_runner(make_mesh(data=4, expert=2), get_strategy("dp").rules)

    def loss(params, dtype, run):
        with runtime.using(moe_runner=run):
            y, _ = nnx.merge(graphdef, params)(x_BTD.astype(dtype), dtype)
        return jnp.sum(y.astype(jnp.float32) * x_BTD)

    g_bf16 = jax.jit(jax.grad(lambda p: loss(p, jnp.bfloat16, runner)))(params)
    g_ref = jax.jit(jax.grad(lambda p: loss(p, jnp.float32, None)))(params)
    for k in ("w_gate_EDF", "w_down_EFD"):
        scale = float(np.max(np.abs(g_ref[k])))
        np.testing.assert_allclose(g_bf16[k], g_ref[k], atol=0.03 * scale, err_msg=k)
