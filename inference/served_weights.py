"""The weights as an engine serves them: their floating leaves in the served dtype
(``--dtype``; ``EngineConfig.dtype``), the others (an int8 LoRA base's projections, a bf16
base) as they are. One home for the rule the engine, the memory check and the no-cache
reference share.

    >>> import jax.numpy as jnp
    >>> served_dtype(jnp.float32, "bfloat16"), served_dtype(jnp.int8, "bfloat16")
    (dtype(bfloat16), dtype('int8'))
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def served_dtype(leaf_dtype, dtype: str):
    """A parameter's dtype as served: fp32 leaves in ``dtype``; others as they are."""
    return jnp.dtype(dtype) if jnp.dtype(leaf_dtype) == jnp.float32 else jnp.dtype(leaf_dtype)


def cast_params(params, dtype: str, shardings):
    """``params`` with their fp32 leaves cast to ``dtype``, placed on ``shardings``."""
    if jnp.dtype(dtype) == jnp.float32:
        return params
    # no donation: the caller's arrays may be these very ones (a device_put in place)
    return jax.jit(lambda p: jax.tree.map(lambda x: x.astype(served_dtype(x.dtype, dtype)), p),
                   out_shardings=shardings)(params)
