"""Collective matmul for sequence-parallel tensor parallelism (``--tp-overlap``).

Under sequence parallelism (``tp_sp``, ``fsdp_tp_sp``) the residual stream is split over
``tensor`` along the sequence. A column-parallel projection then needs the whole sequence
(XLA: all-gather, then the matmul) and a row-parallel one hands back partial sums that are
split again (the matmul, then a reduce-scatter). Both collectives are exposed: the matmul
waits for the gather, the scatter waits for the matmul.

The collective-matmul pattern (JAX's shard_map ``ppermute`` example, Wang et al. 2023)
decomposes each into ``n - 1`` permutes of one sequence chunk around the ``tensor`` ring,
each overlapped with the partial matmul of the chunk already at hand:

* gather → matmul: device ``i`` multiplies its own chunk while passing it to ``i - 1``;
  at step ``s`` it holds chunk ``i + s`` and writes that chunk's rows of the output.
* matmul → scatter: device ``i`` starts with its partial product for chunk ``i + 1`` and
  at each step adds its partial product for the chunk whose running sum it just
  received from ``i + 1``; after ``n - 1`` steps it holds the whole sum of chunk ``i``.

The bytes are the collectives': ``n - 1`` permutes of ``B·T/n·D`` each, what a ring
all-gather or reduce-scatter sends. Only ``tensor`` is manual inside the ``shard_map``;
the batch axes and FSDP's ``data`` stay with XLA. The model calls these through
``models.projection`` (the runtime's ``gather_matmul`` / ``matmul_scatter``), naming no
mesh; :func:`collective_matmuls` builds them for a mesh and rules.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from triax.mesh.build import mesh_sizes
from triax.sharding.rules import Rules, ShardingError

TENSOR = "tensor"


def overlap_reason(sizes: dict, rules: Rules) -> Optional[str]:
    """Why ``--tp-overlap`` cannot run on a mesh of ``sizes`` under ``rules`` (None: it
    can): it needs ``tensor`` > 1, a sequence-parallel strategy (the residual stream's
    sequence split over ``tensor``), no ``context`` split and no pipeline stages."""
    if sizes.get(TENSOR, 1) < 2:
        return "--tp-overlap needs a mesh with tensor > 1"
    if TENSOR not in rules.mesh_axes("res_seq"):
        return ("--tp-overlap overlaps sequence parallelism's collectives: use a "
                "sequence-parallel strategy (tp_sp or fsdp_tp_sp)")
    if sizes.get("context", 1) > 1:
        return "--tp-overlap with context > 1 is not supported; drop context from --mesh"
    if sizes.get("pipe", 1) > 1:
        return ("--tp-overlap inside pipeline stages is not supported; drop pipe from --mesh "
                "or --tp-overlap")
    return None


def _tensor_only(spec: P, ndim: int) -> P:
    """``spec`` keeping only ``tensor`` (the manual axis): the other axes stay XLA's."""
    out = []
    for i in range(ndim):
        e = spec[i] if i < len(spec) else None
        axes = (e,) if isinstance(e, str) else tuple(e or ())
        out.append(TENSOR if TENSOR in axes else None)
    return P(*out)


def _left(n: int) -> list[tuple[int, int]]:
    """The ring's permutation: device ``j`` sends to ``j - 1``."""
    return [(j, (j - 1) % n) for j in range(n)]


def _split_seq(spec: P) -> bool:
    e = spec[1] if len(spec) > 1 else None
    return e == TENSOR or (isinstance(e, tuple) and TENSOR in e)


def _transposes(eq: str) -> tuple[str, str]:
    """The einsums of ``eq``'s two input gradients: ``a,b->c`` gives ``c,b->a``, ``a,c->b``."""
    ins, c = eq.split("->")
    a, b = ins.split(",")
    return f"{c},{b}->{a}", f"{a},{c}->{b}"


def _rows(x, c, tc):
    return lax.dynamic_slice_in_dim(x, c * tc, tc, axis=1)


def _ring_gather(chunk, n: int, fns):
    """Inside the shard_map: each ``fn(chunk)`` for every chunk of the sequence, placed in
    sequence order (axis 1); the chunk is passed on while this one is multiplied."""
    i, tc = lax.axis_index(TENSOR), chunk.shape[1]
    acc = None
    for s in range(n):
        nxt = lax.ppermute(chunk, TENSOR, _left(n)) if s < n - 1 else None
        parts = [f(chunk) for f in fns]
        if acc is None:
            acc = [jnp.zeros(p.shape[:1] + (n * tc,) + p.shape[2:], p.dtype) for p in parts]
        row = ((i + s) % n) * tc      # this chunk's place in the whole sequence
        acc = [lax.dynamic_update_slice_in_dim(a, p, row, axis=1) for a, p in zip(acc, parts)]
        chunk = nxt
    return acc


def _ring_scatter(n: int, part):
    """Inside the shard_map: this device's chunk of ``Σ_devices part(chunk)``; the running
    sum moves on while the next part is computed."""
    i = lax.axis_index(TENSOR)
    acc = part((i + 1) % n)
    for s in range(1, n):
        mine = part((i + s + 1) % n)
        acc = lax.ppermute(acc, TENSOR, _left(n)) + mine
    return acc


def _gather_matmul_local(n: int, eqs: tuple[str, ...]):
    """The per-device ``x → [einsum(eq, x_whole, w) ...]`` with its own backward: the
    input gradient by the scatter ring, each weight gradient by one einsum on the whole
    sequence kept from the forward (per-step partial products would each be reduced over
    the batch axes by XLA, ``n`` times the bytes)."""
    @jax.custom_vjp
    def f(x, *ws):
        return _ring_gather(x, n, [lambda c, eq=eq, w=w: jnp.einsum(eq, c, w)
                                   for eq, w in zip(eqs, ws)])

    def fwd(x, *ws):
        *outs, whole = _ring_gather(x, n, [lambda c, eq=eq, w=w: jnp.einsum(eq, c, w)
                                           for eq, w in zip(eqs, ws)] + [lambda c: c])
        return outs, (whole, ws)

    def bwd(res, douts):
        whole, ws = res
        tc = whole.shape[1] // n
        tr = [_transposes(eq) for eq in eqs]

        def part(c):
            return sum(jnp.einsum(dx, _rows(d, c, tc), w).astype(whole.dtype)
                       for (dx, _), d, w in zip(tr, douts, ws))
        dws = tuple(jnp.einsum(dw, whole, d).astype(w.dtype)
                    for (_, dw), d, w in zip(tr, douts, ws))
        return (_ring_scatter(n, part),) + dws

    f.defvjp(fwd, bwd)
    return f


def _matmul_scatter_local(n: int, eq: str):
    """The per-device ``(h, w) → chunk of Σ einsum(eq, h, w)`` with its own backward: the
    input gradient by the gather ring, the weight gradient by one einsum on the whole
    output gradient that ring gathered."""
    dx_eq, dw_eq = _transposes(eq)

    def primal(h, w):
        tc = h.shape[1] // n
        return _ring_scatter(n, lambda c: jnp.einsum(eq, _rows(h, c, tc), w))

    @jax.custom_vjp
    def f(h, w):
        return primal(h, w)

    def fwd(h, w):
        return primal(h, w), (h, w)

    def bwd(res, dy):
        h, w = res
        dh, whole = _ring_gather(dy, n, [lambda c: jnp.einsum(dx_eq, c, w), lambda c: c])
        return dh.astype(h.dtype), jnp.einsum(dw_eq, h, whole).astype(w.dtype)

    f.defvjp(fwd, bwd)
    return f


def collective_matmuls(mesh: Mesh, rules: Rules) -> tuple[Callable, Callable]:
    """``(gather_matmul, matmul_scatter)`` for the runtime (``models.projection``'s hooks)
    on ``mesh`` under ``rules``; raises ShardingError where :func:`overlap_reason` does."""
    sizes = mesh_sizes(mesh)
    why = overlap_reason(sizes, rules)
    if why:
        raise ShardingError(why)
    n = sizes[TENSOR]

    def spec(axes, shape):
        return rules.spec(axes, shape, sizes, what="collective matmul operand")

    def manual_inside():
        if jax.sharding.get_abstract_mesh().manual_axes:
            raise ShardingError("--tp-overlap's collective matmul ran inside another "
                                "shard_map (a pipeline stage or a context kernel); drop "
                                "--tp-overlap there")

    def gather_matmul(x_BTD, x_axes: Sequence, terms: Sequence):
        manual_inside()
        xs = spec(x_axes, x_BTD.shape)
        if not _split_seq(xs):      # a sequence tensor does not divide (decode): whole
            return [jnp.einsum(eq, x_BTD, w) for eq, w, _, _ in terms]
        ws = [w for _, w, _, _ in terms]
        outs = [jax.eval_shape(lambda w, eq=eq: jnp.einsum(eq, x_BTD, w), w)
                for eq, w, _, _ in terms]
        fn = jax.shard_map(
            _gather_matmul_local(n, tuple(eq for eq, *_ in terms)), mesh=mesh,
            axis_names={TENSOR}, check_vma=False,
            in_specs=(_tensor_only(xs, x_BTD.ndim),) + tuple(
                _tensor_only(spec(wa, w.shape), w.ndim) for (_, w, wa, _) in terms),
            out_specs=[_tensor_only(spec(oa, o.shape), o.ndim)
                       for (_, _, _, oa), o in zip(terms, outs)])
        return list(fn(x_BTD, *ws))

    def matmul_scatter(h, h_axes: Sequence, term):
        manual_inside()
        eq, w, w_axes, out_axes = term
        out = jax.eval_shape(lambda h, w: jnp.einsum(eq, h, w), h, w)
        os_ = spec(out_axes, out.shape)
        if not _split_seq(os_):
            return jnp.einsum(eq, h, w)
        fn = jax.shard_map(_matmul_scatter_local(n, eq), mesh=mesh, axis_names={TENSOR},
                           check_vma=False,
                           in_specs=(_tensor_only(spec(h_axes, h.shape), h.ndim),
                                     _tensor_only(spec(w_axes, w.shape), w.ndim)),
                           out_specs=_tensor_only(os_, out.ndim))
        return fn(h, w)

    return gather_matmul, matmul_scatter
