"""The pipeline executor against the unpipelined single-device model: loss and every gradient
(fp32, rtol 1e-5) for every schedule, uneven layer counts, a 3D mesh, and forward-only; and
tensor parallelism surviving the pipeline in the 3D mesh's compiled step (under ``fsdp_tp``
the executor's FSDP gather runs over ``data`` only, and each weight stays split over
``tensor`` inside the stage)."""
import math

import jax
import numpy as np
import pytest
from step_grads import first_step_grads
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.pipeline import ScheduleError
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.sharding.introspect.hlo import collectives_from_compiled
from triax.training.step import Trainer
from pipeline_helpers import single_device_references

# Every case runs 6 layers, so one one-device reference serves the file: on 4 stages they
# pad to 8 slots with two zero blocks (exact identities that run like any layer: the
# padded layout has no slot conditional, so ZB-H1 there runs the even layout's kernels).
B, T, L = 8, 16, 6


@pytest.fixture(scope="module")
def references():
    return single_device_references(B, T, masked=True)


@pytest.fixture(scope="module")
def reference(references):
    """Host params, batch, and the single-device loss and grads of the 6-layer model."""
    return references(L)


# Each case is one compiled program (~5 s of CPU): uneven layer counts ride on cases that
# also check a schedule and a stage count. 1F1B on 2 stages: test_3d_mesh_train_step.
# Interleaved and ZB-V with whole chunks
# on each stage's storage (``StageLayers.routed``: chunks moved to compute order and their
# gradients back, ``Pipeline._run``'s ``routes`` into the routed buffers) run the same
# routing under FSDP by layer, where a layer's gather is the only addition (without FSDP
# splits the gather is the identity): test_pipeline_fsdp_layer.py checks both against one
# device on pipe=2, 4 layers (routed), so their dp cases here are not compiled again; the
# cases kept here run M = 2S micro-batches (the steady state those cases had, which the
# by-layer ones, at M = S, do not reach). Compile cost hardly grows with M (one scan).
CASES = [  # (schedule, S, M, v)
    ("gpipe", 2, 2, 1),
    ("1f1b", 4, 8, 1),          # uneven: 6 layers on 4 stages (two identity pads)
    ("zb-h1", 4, 4, 1),         # the same padding, under the split backward
    ("zb-v", 4, 8, 1),          # V over 4 stages, uneven: 8 chunks for 6 layers (pads)
    ("interleaved", 2, 4, 2),   # uneven chunks: 4 chunks of 2 for 6 layers (two pads)
]


@pytest.mark.parametrize("kind,S,M,v", CASES)
def test_loss_and_grads_match_unpipelined(reference, kind, S, M, v):
    cfg, params, batch, loss0, grads0 = reference
    tr = Trainer(cfg, make_mesh(pipe=S, devices=jax.devices()[:S]), "dp",
                 pipeline=PipelineConfig(kind, M, v))
    assert tr.pipeline.schedule.microbatches == M
    assert not tr.pipeline.layout.routed     # routed: test_pipeline_fsdp_layer.py
    (loss, _), grads = tr.grads(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)
    assert_trees_close(grads, grads0, rtol=1e-5, atol=1e-6, what=f"{kind} grads")


# ---- the 3D mesh: one optimizer step, and its compiled program's collectives ----------

SIZES = {"data": 2, "pipe": 2, "tensor": 2}


@pytest.fixture(scope="module")
def step_3d(references, reference):
    """data=2 × tensor=2 × pipe=2 under fsdp_tp, the default schedule: one optimizer step
    from the one-device init state the reference's params came from (placed: no init
    compile for this mesh), and that step's compiled program (lowered on the same
    arguments: a cache hit), which the collective tests read."""
    cfg, _, batch, _, _ = reference
    tr = Trainer(cfg, make_mesh(**SIZES), "fsdp_tp", pipeline=PipelineConfig())
    state, m = tr.step(tr.place(references.init_state(L)), batch)
    compiled = tr.lower(batch).compile()
    return tr, state, jax.device_get(m), collectives_from_compiled(compiled, tr.mesh)


def test_3d_mesh_train_step(reference, step_3d):
    """The step matches one device: loss, gradient norm, and the gradients, read back from
    Adam's first moment (``step_grads``), so the step's one compile checks them all."""
    _, _, _, loss0, grads0 = reference
    tr, state, m, _ = step_3d
    assert tr.pipeline.schedule.kind.value == "1f1b"                  # the default schedule
    assert_trees_close(first_step_grads(tr, state, m), grads0, rtol=1e-5, atol=1e-6,
                       what="3D grads")
    np.testing.assert_allclose(float(m["loss"]), loss0, rtol=1e-5)
    norm0 = np.sqrt(sum(np.sum(np.square(g)) for g in jax.tree.leaves(grads0)))
    np.testing.assert_allclose(float(m["grad_norm"]), norm0, rtol=1e-5)


def _axes(entry):
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _ideal_gathers(tr) -> list[int]:
    """Per-device bytes of each weight as the stage uses it, for the weights FSDP splits over
    data: the global size over the stages (blocks) and over every other axis it is split on."""
    out = []
    for row in tr.placement():
        axes = [a for e in row.spec for a in _axes(e)]
        if "data" not in axes:
            continue
        split = math.prod(SIZES[a] for a in axes if a != "data")
        out.append(math.prod(row.global_shape) * 4 // split)
    return sorted(out)


def test_no_weight_is_gathered_over_tensor(step_3d):
    colls = step_3d[3]
    assert [c for c in colls if c.kind == "all-gather" and "tensor" in c.axes] == []


def test_gathers_over_data_are_fsdp_ideal_and_weights_stay_split_over_tensor(step_3d):
    tr, *_, colls = step_3d
    gathers = sorted(c.bytes_per_device for c in colls if c.kind == "all-gather"
                     for _ in range(c.count))
    assert all(c.axes == ("data",) for c in colls if c.kind == "all-gather")
    # Each gathered weight is its stage's share over tensor: wq [Lc, D, N, H] at N/tensor, …
    assert gathers == _ideal_gathers(tr)
    # and together they are a stage's weights over tensor (blocks) plus the pieces'.
    blocks = sum(math.prod(r.global_shape) * 4 // SIZES["pipe"] for r in tr.placement()
                 if r.path.startswith("blocks/") and "data" in r.spec)
    pieces = sum(math.prod(r.global_shape) * 4 for r in tr.placement()
                 if not r.path.startswith("blocks/") and "data" in r.spec)
    assert sum(gathers) * SIZES["tensor"] == blocks + pieces
    # The gradients leave the same way: one reduce-scatter over data per gathered weight.
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    assert all(c.axes == ("data",) for c in scatters)
    assert sum(c.count * c.bytes_per_device for c in scatters) == sum(gathers)


# ---- forward only, and bad requests -----------------------------------------------------

def test_forward_only_matches(reference):
    cfg, params, batch, loss0, _ = reference
    mesh = make_mesh(data=2, pipe=4)
    fwd = Pipeline(cfg, mesh, "dp", PipelineConfig(microbatches=4)).forward
    loss, _ = jax.jit(fwd)(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)


def test_bad_batch_errors(reference):
    cfg, params, batch, _, _ = reference
    pp = Pipeline(cfg, make_mesh(data=2, pipe=4), "dp", PipelineConfig(microbatches=8))
    with pytest.raises(ScheduleError, match="batch 8 must split into 2 data shard.* x 8 micro"):
        jax.eval_shape(pp.loss_and_grad, params, batch)
    with pytest.raises(ScheduleError, match="M=6 is not a multiple of S=4"):
        Pipeline(cfg, make_mesh(data=2, pipe=4), "dp", PipelineConfig("interleaved", 6, 2))
    with pytest.raises(ScheduleError, match="pipe >= 2"):
        Pipeline(cfg, make_mesh(data=8), "dp")
