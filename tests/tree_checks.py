"""Shared test helper (a plain module: ``conftest`` is not importable by name once
``notebooks/conftest.py`` is collected in the same run)."""
import jax
import numpy as np


def assert_trees_close(actual, expected, rtol=1e-5, atol=1e-6, what="tree"):
    """Leaf-by-leaf comparison that names the first differing path."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree.leaves(expected)
    assert len(flat_a) == len(flat_e), f"{what}: {len(flat_a)} leaves vs {len(flat_e)}"
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol,
                                   err_msg=f"{what} at {jax.tree_util.keystr(path)}")
