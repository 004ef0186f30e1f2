"""Every attention implementation against the einsum reference (outputs and gradients), the
blockwise kernel's O(T) memory, and how ``auto`` and the run config name one."""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.tree_checks import assert_trees_close
from triax.models import config
from triax.models import attention as A
from triax.models import visibility as V
from triax.models.runtime import ExecConfig
from triax.sharding.partition import abstract_model
from triax.training.config import RunConfig

T = 13        # not a multiple of the block
BLOCK = 4
KERNELS = {"blockwise": partial(A.blockwise, block_size=BLOCK), "dot_product": A.dot_product}


def _visibility(kind, B):
    if kind == "causal":
        return V.Visibility.causal(B, T)
    segments = jnp.array([[1] * 5 + [2] * 6 + [0] * 2, [3] * 2 + [1] * 11])
    return V.packed_visibility(segments)


def _out_loss_and_grads(fn, q, k, v, vis):
    """``(output, (loss, dq, dk, dv))`` in one program. A non-linear loss, so every output
    element gets its own cotangent."""
    def loss(q, k, v):
        out = fn(q, k, v, vis)
        return jnp.sum(jnp.sin(3.0 * out)), out
    (loss, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, (loss, grads)


@pytest.fixture(scope="module", params=[2, 1], ids=["gqa_K2", "mqa_K1"])
def qkv(request):
    rng = np.random.default_rng(request.param)     # host data: no program to draw it
    B, N, K, H = 2, 4, request.param, 8
    return tuple(rng.standard_normal(s, np.float32) for s in ((B, T, N, H), (B, T, K, H),
                                                                (B, T, K, H)))


@pytest.fixture(scope="module")
def references(qkv):
    """The reference's output, loss and gradients per visibility kind, computed once for both
    kernels."""
    return {kind: _out_loss_and_grads(A.reference, *qkv, _visibility(kind, qkv[0].shape[0]))
            for kind in ("causal", "segments")}


@pytest.mark.parametrize("kind", ["causal", "segments"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernel_outputs_and_gradients_equal_reference(qkv, references, name, kind):
    out, loss_grads = _out_loss_and_grads(KERNELS[name], *qkv, _visibility(kind, qkv[0].shape[0]))
    want_out, want_loss_grads = references[kind]
    np.testing.assert_allclose(out, want_out, rtol=1e-5, atol=1e-6)
    assert_trees_close(loss_grads, want_loss_grads, rtol=1e-5, atol=1e-5,
                       what=f"{name}/{kind} (loss, dq, dk, dv)")


def test_whole_model_loss_and_grads_blockwise_equal_reference(monkeypatch):
    cfg = config.TINY.replace(num_layers=2)
    # Weights and tokens drawn on the host (an eager init compiles ~25 small programs): the
    # two kernels see the same ones. Unit norm scales, the rest normal at tiny's init scale.
    am = abstract_model(cfg)
    rng = np.random.default_rng(0)
    params = jax.tree_util.tree_map_with_path(
        lambda path, s: np.ones(s.shape, s.dtype) if path[-1].key == "scale" else
        (cfg.init_std * rng.standard_normal(s.shape)).astype(s.dtype), am.shapes)
    graphdef = am.graphdef
    tokens = rng.integers(0, cfg.vocab_size, (2, 21), dtype=np.int32)
    traced = []   # the model must reach the kernel its ExecConfig names

    def blockwise(*args):
        traced.append(1)
        return A.blockwise(*args, block_size=8)   # 21 tokens: three blocks, the last padded

    monkeypatch.setitem(A.IMPLEMENTATIONS, "blockwise", blockwise)

    def loss_and_grads(implementation):
        def loss(params):
            logits, _ = nnx.merge(graphdef, params)(tokens, exe=ExecConfig(attention=implementation))
            return jnp.mean(jax.nn.log_softmax(logits)[..., 0])
        return jax.jit(jax.value_and_grad(loss))(params)

    assert_trees_close(loss_and_grads("blockwise"), loss_and_grads("reference"), rtol=1e-5,
                       atol=1e-6, what="tiny (loss, grads)")
    assert traced


def _temp_bytes(fn, T, B=1, N=4, K=2, H=16):
    q = jax.ShapeDtypeStruct((B, T, N, H), jnp.float32)
    kv = jax.ShapeDtypeStruct((B, T, K, H), jnp.float32)
    step = jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, V.Visibility.causal(B, T)) ** 2),
                    argnums=(0, 1, 2))
    return jax.jit(step).lower(q, kv, kv).compile().memory_analysis().temp_size_in_bytes


@pytest.fixture(scope="module")
def temp_ratios():
    """Compiled forward+backward temporaries at 4T ÷ at T (T = 256)."""
    kernels = {"reference": A.reference, "blockwise": partial(A.blockwise, block_size=64)}
    return {name: _temp_bytes(fn, 1024) / _temp_bytes(fn, 256) for name, fn in kernels.items()}


def test_blockwise_temporaries_grow_linearly_reference_quadratically(temp_ratios):
    # Measured: blockwise 4.0× (scores of one 64-key block per step, O(T)); reference
    # ≈ 15× (the [B, N, T, T] scores and probabilities kept for the backward).
    assert temp_ratios["blockwise"] < 5.0, temp_ratios
    assert temp_ratios["reference"] > 12.0, temp_ratios


def test_auto_resolves_per_backend_and_names_are_checked():
    assert A.resolve("auto", "gpu") == "dot_product"
    assert A.resolve("auto", "cpu") == A.AUTO["cpu"]
    assert A.resolve("blockwise") == "blockwise"
    assert A.kernel("auto") is A.IMPLEMENTATIONS[A.AUTO[jax.default_backend()]]
    with pytest.raises(ValueError, match="'flash'.*auto, reference, blockwise, dot_product"):
        RunConfig.of(attention="flash").exec_config()
    assert RunConfig.of(attention="blockwise").exec_config().attention == "blockwise"


def test_attention_choices_are_the_named_kernels():
    from triax import choices
    assert tuple(A.IMPLEMENTATIONS) == choices.ATTENTION_KERNELS
    assert A.CHOICES == ("auto", *A.IMPLEMENTATIONS) == choices.ATTENTION_CHOICES
