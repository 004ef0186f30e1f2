"""The projections into and out of the residual stream, through the runtime's hooks.

A block reads the residual stream ``x_BTD`` (logical ``("batch", "res_seq", "act_embed")``)
with column-parallel weights (attention's q, k, v; the MLP's fused gate/up) and writes back
onto it with row-parallel ones (attention's output, the MLP's down). Under sequence
parallelism the sharding layer turns the first into all-gather → matmul and the second
into matmul → reduce-scatter; with a collective matmul installed
(``Runtime.gather_matmul`` / ``matmul_scatter``, ``sharding.collective_matmul``) each is a
ring of permutes overlapped with partial matmuls instead. Without a hook both are plain
einsums, so the model runs anywhere unchanged.

A term is ``(equation, weight, weight's logical axes, output's logical axes)``; every
output keeps the sequence at axis 1.

    >>> import jax.numpy as jnp
    >>> x, w = jnp.ones((1, 4, 2)), jnp.ones((2, 3))
    >>> [y.shape for y in project_in(x, [("BTD,DF->BTF", w, ("embed", "mlp"),
    ...                                   ("batch", "seq", "act_mlp"))])]
    [(1, 4, 3)]
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

from triax.models import runtime

RESIDUAL = ("batch", "res_seq", "act_embed")   # the residual stream's logical axes

Term = tuple   # (equation, weight, weight_axes, out_axes)


def project_in(x_BTD, terms: Sequence[Term]) -> list:
    """Each term's ``einsum(equation, x_BTD, weight)``, all from one read of the stream
    (a collective matmul passes each chunk of ``x_BTD`` once for all of them)."""
    hook = runtime.current().gather_matmul
    if hook is None:
        return [jnp.einsum(eq, x_BTD, w) for eq, w, _, _ in terms]
    return hook(x_BTD, RESIDUAL, tuple(terms))


def project_out(h, h_axes: Sequence[Optional[str]], term: Term):
    """``einsum(equation, h, weight)`` back onto the residual stream (``RESIDUAL``)."""
    hook = runtime.current().matmul_scatter
    eq, w, _, _ = term
    if hook is None:
        return jnp.einsum(eq, h, w)
    return hook(h, tuple(h_axes), term)
