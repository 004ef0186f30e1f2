"""The pipeline executor against the unpipelined single-device model: loss and every gradient
(fp32, rtol 1e-5) for every schedule, uneven layer counts, a 3D mesh, and forward-only."""
import jax
import numpy as np
import pytest
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.pipeline import ScheduleError
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.training.step import Trainer
from pipeline_helpers import single_device_references

B, T = 8, 16


@pytest.fixture(scope="module")
def reference():
    """Per layer count: host params, batch, and the single-device loss and grads."""
    return single_device_references(B, T, masked=True)


# Each case is one compiled program (~5 s of CPU): uneven layer counts ride on cases that
# also check a schedule and a stage count, all at 6 layers (one one-device reference for
# them). 1F1B on 2 stages: test_3d_mesh_train_step. Interleaved and ZB-V with whole chunks
# on each stage's storage (``StageLayers.routed``: chunks moved to compute order and their
# gradients back, ``Pipeline._run``'s ``routes`` into the routed buffers) run the same
# routing under FSDP by layer, where a layer's gather is the only addition (without FSDP
# splits the gather is the identity): test_pipeline_fsdp_layer.py checks both against one
# device on pipe=2, 4 layers (routed), so their dp cases here are not compiled again; the
# cases kept here run M = 2S micro-batches (the steady state those cases had, which the
# by-layer ones, at M = S, do not reach). Compile cost hardly grows with M (one scan).
CASES = [  # (schedule, S, M, v, L)
    ("gpipe", 2, 2, 1, 2),
    ("1f1b", 4, 8, 1, 6),          # uneven: 6 layers on 4 stages (two identity pads)
    ("zb-h1", 4, 4, 1, 4),
    ("zb-v", 4, 8, 1, 6),          # V over 4 stages, uneven: 8 chunks for 6 layers (pads)
    ("interleaved", 2, 4, 2, 6),   # uneven chunks: 4 chunks of 2 for 6 layers (two pads)
]


@pytest.mark.parametrize("kind,S,M,v,L", CASES)
def test_loss_and_grads_match_unpipelined(reference, kind, S, M, v, L):
    cfg, params, batch, loss0, grads0 = reference(L)
    tr = Trainer(cfg, make_mesh(pipe=S, devices=jax.devices()[:S]), "dp",
                 pipeline=PipelineConfig(kind, M, v))
    assert tr.pipeline.schedule.microbatches == M
    assert not tr.pipeline.layout.routed     # routed: test_pipeline_fsdp_layer.py
    (loss, _), grads = tr.grads(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)
    assert_trees_close(grads, grads0, rtol=1e-5, atol=1e-6, what=f"{kind} grads")


def test_3d_mesh_train_step(reference):
    """data=2, tensor=2, pipe=2 under fsdp_tp: one optimizer step from the initial state
    matches (loss, gradients, gradient norm); the step reports its gradients
    among its metrics, so one compile checks them all."""
    cfg, params, batch, loss0, grads0 = reference(2)
    mesh = make_mesh(data=2, tensor=2, pipe=2)
    pp = Trainer(cfg, mesh, "fsdp_tp", pipeline=PipelineConfig()).pipeline  # default schedule
    assert pp is not None and pp.schedule.kind.value == "1f1b"

    def with_grads(params, batch):
        (loss, aux), grads = pp.loss_and_grad(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    tr = Trainer(cfg, mesh, pp.strategy, loss_and_grad=with_grads)
    # The one-device init the reference's params came from (compiled already: a cache hit),
    # placed: no init compile for this mesh (test_sharded_init.py: the same state).
    one = Trainer(cfg, make_mesh(devices=jax.devices()[:1]), "dp")
    _, m = tr.step(tr.place(jax.device_get(one.init(0))), batch)
    assert_trees_close(m["grads"], grads0, rtol=1e-5, atol=1e-6, what="3D grads")
    np.testing.assert_allclose(float(m["loss"]), loss0, rtol=1e-5)
    norm0 = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads0)))
    np.testing.assert_allclose(float(m["grad_norm"]), norm0, rtol=1e-5)


def test_forward_only_matches(reference):
    cfg, params, batch, loss0, _ = reference(4)
    mesh = make_mesh(data=2, pipe=4)
    fwd = Pipeline(cfg, mesh, "dp", PipelineConfig(microbatches=4)).forward
    loss, _ = jax.jit(fwd)(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)


def test_bad_batch_errors(reference):
    cfg, params, batch, _, _ = reference(2)
    pp = Pipeline(cfg, make_mesh(data=2, pipe=4), "dp", PipelineConfig(microbatches=8))
    with pytest.raises(ScheduleError, match="batch 8 must split into 2 data shard.* x 8 micro"):
        jax.eval_shape(pp.loss_and_grad, params, batch)
    with pytest.raises(ScheduleError, match="M=6 is not a multiple of S=4"):
        Pipeline(cfg, make_mesh(data=2, pipe=4), "dp", PipelineConfig("interleaved", 6, 2))
    with pytest.raises(ScheduleError, match="pipe >= 2"):
        Pipeline(cfg, make_mesh(data=8), "dp")
