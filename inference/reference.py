"""The no-cache reference: greedy decoding that recomputes the full sequence every step.

Slow by design (quadratic), on whatever single device holds ``params``; the KV-cache engine
on every serving layout must reproduce its tokens exactly and its logits to fp32 tolerance.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.sharding.partition import init_params
    >>> cfg = config.get("tiny", num_layers=1)
    >>> params = init_params(abstract_model(cfg), make_mesh(devices=jax.devices()[:1]), "dp")
    >>> tokens, logits = greedy_reference(cfg, params, [[72, 105]], max_new_tokens=4)
    >>> len(tokens[0]), logits.shape == (1, 4, cfg.vocab_size)
    (4, True)
"""
from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from triax.inference.served_weights import served_dtype
from triax.models.config import ModelConfig
from triax.models.runtime import ExecConfig
from triax.models import runtime
from triax.sharding.partition import abstract_model


def greedy_reference(cfg: ModelConfig, params: Any, prompts: Sequence[Sequence[int]],
                     max_new_tokens: int, forced: Sequence[Sequence[int]] | None = None,
                     dtype: str = "float32"):
    """Greedy tokens ``[n][max_new_tokens]`` and the logits each was chosen from
    (``[n, max_new_tokens, V]``). Rows are right-padded to one length; the causal mask
    keeps padding invisible to the positions that are read. ``forced`` feeds given tokens
    instead of the argmax (teacher forcing, to compare logits step by step). ``dtype``: the
    weights as served (``inference.served_weights``) and the compute dtype."""
    graphdef = abstract_model(cfg).graphdef
    params = jax.tree.map(lambda x: np.asarray(x).astype(served_dtype(x.dtype, dtype)),
                          jax.device_get(params))
    exe = ExecConfig(compute_dtype=dtype)
    n = len(prompts)
    lens = np.array([len(p) for p in prompts])
    T = int(lens.max()) + max_new_tokens
    seq = np.zeros((n, T), np.int32)
    for i, p in enumerate(prompts):
        seq[i, :len(p)] = p

    @jax.jit
    def step_logits(params, seq_BT, last_B):
        with runtime.using(moe_inference=True):  # MoE routes dropless, as in the engine
            logits, _ = nnx.merge(graphdef, params)(seq_BT, exe=exe)
        return jnp.take_along_axis(logits, last_B[:, None, None], axis=1)[:, 0]

    out_tokens, out_logits = np.zeros((n, max_new_tokens), np.int64), []
    for t in range(max_new_tokens):
        lg = np.asarray(step_logits(params, seq, lens + t - 1).astype(jnp.float32))
        out_logits.append(lg)
        nxt = lg.argmax(-1) if forced is None else np.array([f[t] for f in forced])
        out_tokens[:, t] = nxt
        seq[np.arange(n), lens + t] = nxt
    return out_tokens.tolist(), np.stack(out_logits, 1)
