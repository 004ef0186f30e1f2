"""``--base-dtype int8``: the frozen base's projections are int8 with fp32 per-output-channel
scales (``models.quantize``), dequantized where used; the adapters train in fp32.

The bounds (``test_int8_logits_within_the_rounding_bound``). Per weight: ``|Ŵ_ij - W_ij| ≤
s_j/2`` with ``s_j = max_i |W_ij| / 127`` of its output channel ``j`` (checked on the kernel
the layer uses). Logits: the rounding errors are independent, of mean ~0 and variance
≤ ``s_j²/12`` (uniform on ``±s_j/2``), so for a random functional ``f = <r, logits>`` the
first-order error ``Σ g_ij δ_ij`` (``g = ∂f/∂W`` of the fp32 base) is a sum of ~10⁵ such
terms with ``σ² = Σ g_ij² s_j² / 12``; the test checks ``|Δf| ≤ 6σ`` for 8 functionals (a
chance failure ~1e-8; second-order terms are ``O(s²)``, negligible). The fp32 base has one
outlier output channel per projection and layer (×50, as LLM weights have): per-tensor
scales then round every other channel ~50× coarser and fail both bounds (measured: 3 of 8
functionals beyond 6σ, up to 18σ, against ≤ 1.7σ per channel); skipping the dequantize
(int8 values used as weights) fails them by orders of magnitude.
"""
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from triax.mesh import make_mesh
from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.models.quantize import SUFFIX, cast_like, kernel, quantize
from triax.models.transformer import Transformer
from triax.training.step import Trainer

BASE = config.TINY.replace(num_layers=2, lora=LoraConfig(rank=4, alpha=8.0))
INT8 = BASE.replace(lora=LoraConfig(rank=4, alpha=8.0, base_dtype="int8"))
# The quantized projections and their input-dim counts (models.layers).
N_IN = {"wq_DNH": 1, "wk_DKH": 1, "wv_DKH": 1, "wo_NHD": 2, "w_in_D2F": 1, "w_down_FD": 1}
B, T = 8, 12
OUTLIER, FUNCTIONALS, SIGMAS = 50.0, 8, 6.0


def projections(params):
    """``(name, weight, scale or None)`` of every quantizable block projection."""
    return [(n, mod[n], mod.get(n + SUFFIX)) for mod in params["blocks"].values()
            for n in N_IN if n in mod]


@pytest.fixture(scope="module")
def steps(devices):
    mesh = make_mesh(devices=devices[:1])
    out = {}
    for cfg in (BASE, INT8):
        tr = Trainer(cfg, mesh, "dp")
        out[cfg.lora.base_dtype] = (tr, tr.lower(B, T).compile())
    return out


def test_int8_state_and_step_trains_the_adapters(steps):
    tr, compiled = steps["int8"]
    state = tr.init(0)
    params = jax.device_get(state["params"])
    ints = [x for x in jax.tree.leaves(params) if x.dtype == np.int8]
    proj = projections(params)
    assert len(proj) == len(N_IN) == len(ints)       # the six projections, nothing else int8
    for name, w, scale in proj:
        assert w.dtype == np.int8 and scale.dtype == np.float32, name
        # one scale per output channel (input dims kept as 1), per layer
        assert scale.shape == w.shape[:1] + (1,) * N_IN[name] + w.shape[1 + N_IN[name]:]
    ad, base = lora.split(params)
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(ad))
    losses = []
    for i in range(3):
        state, m = compiled(state, tr.shard_batch(tr.example_batch(B, T, seed=0)))
        losses.append(float(m["loss"]))
    assert losses[-1] < losses[0], losses          # the adapters learn the repeated batch
    _, base_after = lora.split(jax.device_get(state["params"]))
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(base),
                                                    jax.tree.leaves(base_after)))


def test_hf_base_quantizes_and_merged_export_dequantizes(steps):
    """An fp32 base cast to the int8 model's dtypes (``--init-from``: ``cast_like``) is the
    int8 init of the same seed (to a rounding tie); the merged export of an int8 run is
    plain fp32 weights."""
    p32 = jax.device_get(steps["float32"][0].init(0)["params"])
    tr = steps["int8"][0]
    pq = jax.device_get(tr.init(0)["params"])
    like = lora.split(tr.abstract.shapes)[1]
    # as --init-from runs it; compared on the host (no program per eager op and leaf)
    got = jax.device_get(jax.jit(lambda b: cast_like(b, like))(lora.split(p32)[1]))
    assert jax.tree.structure(got) == jax.tree.structure(lora.split(pq)[1])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(lora.split(pq)[1])):
        # exact but for a rounding tie (XLA may divide by the scale as a reciprocal product)
        assert a.dtype == b.dtype and np.max(np.abs(a.astype(float) - b)) <= (
            1 if a.dtype == np.int8 else 0)
    merge = jax.jit(lora.merged, static_argnums=1)   # as triax export runs it
    merged = jax.device_get(merge(pq, INT8.lora))
    plain = jax.device_get(merge(p32, BASE.lora))
    assert jax.tree.structure(merged) == jax.tree.structure(plain)
    assert all(a.dtype == np.float32 for a in jax.tree.leaves(merged))
    s = _channel_scale(p32["blocks"]["attn"]["wq_DNH"], 1)
    assert np.all(np.abs(merged["blocks"]["attn"]["wq_DNH"] - plain["blocks"]["attn"]["wq_DNH"])
                  <= s / 2 * (1 + 1e-5))   # B = 0: the merge is the dequantized base


def _logits(cfg, params, tokens):
    graph, state = nnx.split(Transformer(cfg, nnx.Rngs(0)))
    nnx.replace_by_pure_dict(state, params)
    return nnx.merge(graph, state)(tokens)[0]


def _channel_scale(w, k):
    """Per-output-channel ``max|W| / 127`` of a stacked weight (layer dim first), from its
    definition (not from ``models.quantize``)."""
    return np.max(np.abs(w), axis=tuple(range(1, 1 + k)), keepdims=True) / 127.0


def _outliers(params, rng):
    """The fp32 base with one output channel of each projection, per layer, ×OUTLIER (as
    LLM weights have outlier channels): per-tensor scales then round the rest coarsely."""
    blocks = {m: dict(v) for m, v in params["blocks"].items()}
    for mod in blocks.values():
        for name, k in N_IN.items():
            if name in mod:
                w = np.array(mod[name])
                out = w.reshape(w.shape[:1 + k] + (-1,))
                for layer in range(w.shape[0]):
                    out[layer, ..., rng.integers(out.shape[-1])] *= OUTLIER
                mod[name] = out.reshape(w.shape)
    return {**params, "blocks": blocks}


@jax.jit   # one program, not one per eager op and weight shape
def _quantize_stacked(params):
    """The int8 twin of an fp32 parameter dict: each stacked projection quantized per layer."""
    blocks = {m: dict(v) for m, v in params["blocks"].items()}
    for mod in blocks.values():
        for name, k in N_IN.items():
            if name in mod:
                mod[name], mod[name + SUFFIX] = jax.vmap(lambda w: quantize(w, k))(mod[name])
    return {**params, "blocks": blocks}


@jax.jit
def _kernels(blocks):
    """``{(module, name): kernel(...)}``: each int8 projection dequantized by the layer's own
    :func:`kernel`."""
    out = {}
    for m, mod in blocks.items():
        for n in N_IN:
            if n in mod:
                holder = nnx.Module()
                setattr(holder, n, nnx.Param(mod[n]))
                setattr(holder, n + SUFFIX, nnx.Param(mod[n + SUFFIX]))
                out[m, n] = kernel(holder, n, jnp.float32)
    return out


def test_int8_logits_within_the_rounding_bound(steps):
    tr, _ = steps["float32"]
    rng = np.random.default_rng(0)
    p32 = _outliers(jax.device_get(tr.init(0)["params"]), rng)
    pq = _quantize_stacked(p32)
    scales = {(m, n): _channel_scale(mod[n], k) for m, mod in p32["blocks"].items()
              for n, k in N_IN.items() if n in mod}
    kernels = jax.device_get(_kernels(pq["blocks"]))
    for (m, n), s in scales.items():   # the per-weight bound, on the kernel the layer uses
        err = np.abs(kernels[m, n] - p32["blocks"][m][n])
        assert np.all(err <= s / 2 * (1 + 1e-5)), (m, n, float(np.max(err / s)))
    tokens = rng.integers(0, BASE.vocab_size, (2, T)).astype(np.int32)
    ad, base32 = lora.split(p32)
    ref, got = (jax.jit(partial(_logits, c))(p, tokens) for c, p in ((BASE, p32), (INT8, pq)))
    rs = rng.standard_normal((FUNCTIONALS,) + ref.shape).astype(np.float32)
    grads = jax.jit(jax.vmap(jax.grad(lambda base, r: jnp.vdot(
        r, _logits(BASE, lora.join(ad, base), tokens))), in_axes=(None, 0)))(base32, rs)
    sigma = np.sqrt(sum(np.sum(np.asarray(grads["blocks"][m][n]) ** 2 * s[None] ** 2, axis=(
        tuple(range(1, grads["blocks"][m][n].ndim)))) for (m, n), s in scales.items()) / 12)
    diff = np.asarray(got) - np.asarray(ref)   # host arrays: no program per eager op
    err = np.abs(np.sum(rs * diff, axis=tuple(range(1, rs.ndim))))   # <r_f, got - ref>
    assert np.all(err <= SIGMAS * sigma), (err / sigma).round(2)
    assert np.max(np.abs(diff)) > 0   # it is quantized


def test_int8_quarters_the_projection_bytes(steps):
    """The compiled step's argument bytes (``memory_analysis``): the projections go from 4
    bytes to 1 plus their fp32 scales, everything else (adapters, moments, the fp32
    embedding and norms, the batch) is unchanged, so the difference is exact and the
    projections' bytes drop > 3.5× (the scales: one per output channel)."""
    def args(key):
        return steps[key][1].memory_analysis().argument_size_in_bytes
    tr = steps["int8"][0]
    proj = projections(tr.abstract.shapes)
    n = sum(int(np.prod(w.shape)) for _, w, _ in proj)
    scales = sum(int(np.prod(s.shape)) * 4 for _, _, s in proj)
    assert args("float32") - args("int8") == pytest.approx(3 * n - scales, abs=64)
    rest = args("float32") - 4 * n
    assert 4 * n / (args("int8") - rest) > 3.5, (n, scales)

