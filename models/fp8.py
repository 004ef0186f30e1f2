"""FP8 matmuls for the block's projections (``--precision fp8``).

Each projection ``y = einsum(spec, x, W)`` runs with both operands in float8 e4m3 and the
backward's incoming gradient in e5m2 (more range, less precision: gradients span more
decades than activations and weights), accumulated in fp32 and rescaled:

- forward: ``y = (x_q · W_q) · s_x · s_W``, ``x_q = x / s_x`` and ``W_q = W / s_W`` cast to
  e4m3 after clipping to its largest finite value (448);
- backward: ``g_q = g / s_g`` in e5m2 (57344), ``dx = (g_q · W_q^T) · s_g · s_W`` and
  ``dW = (x_q^T · g_q) · s_x · s_g``: the saved e4m3 operands are reused, no second cast.

Scales are per tensor and *current*: ``s = amax(|t|) / max_finite`` of the tensor being cast,
computed in the step that uses it. Delayed scaling (an amax history carried across steps)
saves that reduction but adds state to the train step, its checkpoint and its resume, and
lags the tensor by a step (a loss spike overflows before the history sees it). Here the
reduction of a weight's amax is one scalar all-reduce over the weight's shards, the price
torchtitan pays for its precomputed scales too.

The weight is cast where it is stored, before any gather: under FSDP the all-gather moves
the e4m3 bytes (1 per element) instead of the compute dtype's. Master weights, gradients
and optimizer state stay fp32 (the step's). No mesh is named here.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1.0, -2.0], [0.5, 4.0]]); w = jnp.eye(2)
    >>> einsum("BD,DF->BF", x, w, jnp.bfloat16).tolist()   # e4m3 holds these exactly
    [[1.0, -2.0], [0.5, 4.0]]
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from triax.models.axes import constrain

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2   # forward operands, backward gradients
# Bytes per element of a projection weight where it is gathered (``gathered``: the e4m3
# bytes, cast before the gather): what the planner prices FSDP's all-gathers at.
WEIGHT_BYTES = jnp.dtype(E4M3).itemsize
# The block's modules whose weights run through ``quantize.project`` (attention's q, k, v, o;
# the dense MLP's fused gate|up and down): the matmuls ``--precision fp8`` runs in float8.
PROJECTED_MODULES = ("attn", "mlp")


def runs_in_fp8(path: str) -> bool:
    """Whether the parameter at ``path`` (``blocks/attn/wq_DNH``, as the parameter tree
    names it) of a dense block is a projection weight ``--precision fp8`` casts to e4m3
    (not a norm scale, the embedding or the head; an MoE block's experts are not projected).

    >>> [runs_in_fp8(p) for p in ("blocks/attn/wq_DNH", "blocks/mlp/w_in_D2F",
    ...                           "blocks/attn_norm/scale", "head_DV")]
    [True, True, False, False]
    """
    parts = path.split("/")
    return len(parts) == 3 and parts[0] == "blocks" and parts[1] in PROJECTED_MODULES
# A weight's logical dims -> the activation dims it meets in its matmul: where a gathered
# weight lies (over ``tensor`` as the activations, whole over ``data``).
ACTIVATION_TWIN = {"embed": "act_embed", "heads": "act_heads", "kv_heads": "act_kv_heads",
                   "head_dim": "act_head_dim", "mlp": "act_mlp"}


def quantize(t, dtype):
    """``(t_q, scale)``: ``t / scale`` in ``dtype`` with ``scale = amax(|t|) / max_finite``
    (an all-zero tensor keeps scale 1)."""
    top = float(jnp.finfo(dtype).max)
    amax = jnp.max(jnp.abs(t)).astype(jnp.float32)
    scale = jnp.where(amax > 0, amax / top, 1.0)
    return jnp.clip(t.astype(jnp.float32) / scale, -top, top).astype(dtype), scale


def gathered(wq, axes):
    """The e4m3 weight laid out for its matmul (``axes``: the weight's logical dims, ()
    when unknown), moved as raw bytes: the gather its constraint asks for (FSDP's, over
    ``data``) carries one byte per element, which no backend widens (the CPU's collectives
    would carry an f8 array as f16)."""
    if not axes:
        return wq
    axes = tuple(axes[-wq.ndim:])
    # as stored (sharded: the cast ran there), then as the matmul needs it: the gather
    # between the two is of the bytes
    bits = constrain(jax.lax.bitcast_convert_type(wq, jnp.uint8), axes)
    bits = constrain(bits, tuple(ACTIVATION_TWIN.get(a) for a in axes))
    # the barrier keeps the compiler from folding the bitcast pair and gathering the wider
    # type the backend computes f8 in
    return jax.lax.bitcast_convert_type(jax.lax.optimization_barrier(bits), E4M3)


def _dot(spec: str, a, b):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _transposed(spec: str) -> tuple[str, str]:
    """For ``"a,b->c"``: the specs of ``dx = g·Wᵀ`` (``"c,b->a"``) and ``dW = xᵀ·g``
    (``"a,c->b"``)."""
    ins, c = spec.split("->")
    a, b = ins.split(",")
    return f"{c},{b}->{a}", f"{a},{c}->{b}"


@partial(jax.custom_vjp, nondiff_argnums=(0, 3, 4))
def einsum(spec: str, x, w, dtype, axes: tuple = ()):
    """``einsum(spec, x, w)`` in ``dtype`` with both operands in e4m3 (its gradient in e5m2);
    ``x`` and ``w`` may be any float dtype (fp32 master weights are cast here, as stored);
    ``axes``: ``w``'s logical dims, which place its gathered e4m3 copy (:func:`gathered`)."""
    return _forward(spec, x, w, dtype, axes)[0]


def _forward(spec, x, w, dtype, axes):
    xq, sx = quantize(x, E4M3)
    wq, sw = quantize(w, E4M3)   # cast where the weight is stored: before any gather
    y = (_dot(spec, xq, gathered(wq, axes)) * (sx * sw)).astype(dtype)
    # the stored (not the gathered) e4m3 weight is kept: the backward gathers it again
    return y, (xq, sx, wq, sw, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _backward(spec, dtype, axes, res, g):
    xq, sx, wq, sw, x0, w0 = res
    gq, sg = quantize(g, E5M2)
    dx_spec, dw_spec = _transposed(spec)
    # mixed e5m2 × e4m3 operands: each cast up by the dot's own conversion, accumulated fp32
    dx = _dot(dx_spec, gq, gathered(wq, axes)) * (sg * sw)
    dw = _dot(dw_spec, xq, gq) * (sx * sg)
    return dx.astype(x0.dtype), dw.astype(w0.dtype)


einsum.defvjp(_forward, _backward)
