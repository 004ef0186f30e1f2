"""Shared helpers for the Hugging Face tests: the committed fixtures (made by real
``transformers``, see tests/fixtures/hf/make_fixtures.py) and a sharded forward."""
import os

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from triax.sharding.partition import abstract_model, activation_sharding

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "hf")
NAMES = ("llama", "llama-tied", "mixtral")


def fixture(name: str) -> str:
    return os.path.join(FIXTURES, name)


def golden(name: str) -> dict:
    with np.load(os.path.join(fixture(name), "golden.npz")) as g:
        return {k: g[k] for k in g.files}


def prompts(g: dict) -> list[np.ndarray]:
    return [g[f"ids_{i}"] for i in range(len(g["prompts"]))]


def forward_logits(cfg, params, mesh, strategy, rows: list[np.ndarray]) -> list[np.ndarray]:
    """Logits of each row (right-padded into one batch; causal, so padding is invisible),
    computed on ``mesh`` and replicated back."""
    T = max(len(r) for r in rows)
    batch = np.zeros((len(rows), T), np.int32)
    for i, r in enumerate(rows):
        batch[i, :len(r)] = r
    graphdef = abstract_model(cfg).graphdef

    @jax.jit
    def fwd(params, tokens):
        with activation_sharding(mesh, strategy):
            logits, _ = nnx.merge(graphdef, params)(tokens)
        return jax.lax.with_sharding_constraint(logits, NamedSharding(mesh, P()))

    out = np.asarray(fwd(params, batch).addressable_data(0))
    return [out[i, :len(r)] for i, r in enumerate(rows)]
