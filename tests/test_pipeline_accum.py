"""Gradient accumulation with the pipeline (``--grad-accum``): each accumulation micro-step
runs the whole pipelined schedule, and the step equals one device without accumulation."""
import jax
import numpy as np
import pytest

from tree_checks import assert_trees_close
from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline.pipelined import PipelineConfig
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
B, T, STEPS = 16, 8, 2   # 16 rows = data 2 × accumulation 2 × micro-batches 2 × 2 rows


def _run(tr, init):
    state = tr.place(init)
    metrics = []
    for i in range(STEPS):
        state, m = tr.step(state, tr.example_batch(B, T, seed=i))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def reference(devices):
    tr = Trainer(CFG, make_mesh(devices=devices[:1]), "dp")
    init = jax.device_get(tr.init(0))
    return init, _run(tr, init)


def test_pipelined_accumulation_equals_one_device(reference):
    init, (ref_metrics, ref_params) = reference
    tr = Trainer(CFG, make_mesh(data=2, pipe=2, tensor=2), "fsdp_tp",
                 pipeline=PipelineConfig("1f1b", 2), accum_steps=2)
    assert tr.pipeline is not None and tr.accum_steps == 2
    metrics, params = _run(tr, init)
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        for k in ("loss", "grad_norm", "lr"):
            np.testing.assert_allclose(m[k], r[k], rtol=1e-5, err_msg=f"step {i} {k}")
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-5, what="params")
