"""The projections into and out of the residual stream, through the runtime's hooks.

A block reads the residual stream ``x_BTD`` (logical ``("batch", "res_seq", "act_embed")``)
with column-parallel weights (attention's q, k, v; the MLP's fused gate/up) and writes back
onto it with row-parallel ones (attention's output, the MLP's down). Under sequence
parallelism the sharding layer turns the first into all-gather → matmul and the second
into matmul → reduce-scatter; with a collective matmul installed
(``Runtime.gather_matmul`` / ``matmul_scatter``, ``sharding.collective_matmul``) each is a
ring of permutes overlapped with partial matmuls instead. Without a hook both are plain
einsums, so the model runs anywhere unchanged.

A term is ``(equation, module, weight's name, weight's logical axes, output's logical
axes)``; every output keeps the sequence at axis 1. Without a hook each term is
``quantize.project`` (float8 under ``--precision fp8``, int8 bases dequantized); a hook gets
the weights in the compute dtype (``quantize.kernel``), so ``build_run`` refuses
``--tp-overlap`` with fp8.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> class Proj(nnx.Module):
    ...     def __init__(self):
    ...         self.w_DF = nnx.Param(jnp.ones((2, 3)))
    >>> [y.shape for y in project_in(jnp.ones((1, 4, 2)), [
    ...     ("BTD,DF->BTF", Proj(), "w_DF", ("embed", "mlp"), ("batch", "seq", "act_mlp"))],
    ...     jnp.float32)]
    [(1, 4, 3)]
"""
from __future__ import annotations

from typing import Optional, Sequence

import jax.numpy as jnp

from triax.models import runtime
from triax.models.quantize import kernel, project

RESIDUAL = ("batch", "res_seq", "act_embed")   # the residual stream's logical axes

Term = tuple   # (equation, module, weight name, weight_axes, out_axes)


def _with_weights(terms: Sequence[Term], dtype) -> tuple:
    """The hooks' terms: ``(equation, weight, weight_axes, out_axes)``."""
    return tuple((eq, kernel(m, name, dtype), wa, oa) for eq, m, name, wa, oa in terms)


def project_in(x_BTD, terms: Sequence[Term], dtype) -> list:
    """Each term's ``einsum(equation, x_BTD, weight)``, all from one read of the stream
    (a collective matmul passes each chunk of ``x_BTD`` once for all of them)."""
    hook = runtime.current().gather_matmul
    if hook is None:
        return [project(eq, x_BTD, m, name, dtype) for eq, m, name, _, _ in terms]
    return hook(x_BTD, RESIDUAL, _with_weights(terms, dtype))


def project_out(h, h_axes: Sequence[Optional[str]], term: Term, dtype):
    """``einsum(equation, h, weight)`` back onto the residual stream (``RESIDUAL``)."""
    hook = runtime.current().matmul_scatter
    if hook is None:
        eq, m, name, _, _ = term
        return project(eq, h, m, name, dtype)
    return hook(h, tuple(h_axes), _with_weights([term], dtype)[0])
