"""The pipeline's buffer pricing (``triax.pipeline.buffer_sizes``) extrapolates a chunk's
residual shapes from four small traces; every leaf's bytes equal a direct trace's."""
import jax
import numpy as np
import pytest

from triax.models import config
from triax.models.layers import ExecConfig
from triax.pipeline import buffer_sizes


def leaf_bytes(tree):
    return [int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("model,remat,layers,rows", [
    ("tiny", "none", 5, 7), ("tiny", "none", 3, 1), ("tiny-moe", "full", 6, 5)])
def test_extrapolated_residuals_equal_a_direct_trace(model, remat, layers, rows):
    cfg, exe = config.get(model), ExecConfig(remat=remat)
    assert (layers, rows) not in [(l, r) for l in buffer_sizes._PROBE_LAYERS
                                  for r in buffer_sizes._PROBE_ROWS]
    got = buffer_sizes._stage_residuals(cfg, layers, exe, rows, 32)
    want = buffer_sizes._trace_residuals(cfg, layers, exe, rows, 32)
    assert [leaf_bytes(t) for t in got] == [leaf_bytes(t) for t in want]
