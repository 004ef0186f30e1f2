"""Uneven pipeline stages (``stage_layers``): loss and every gradient equal one device (fp32,
rtol 1e-5) under 1F1B (GPipe runs the same op kernels), and on a 3D mesh under FSDP + TP
(by layer: ``test_pipeline_fsdp_layer.py``'s 1F1B case runs uneven stages); a
short stage skips its padded slots at run time (padded with real layers, the loss is still
the model's) and in the compiled program (its ops' matmul FLOPs); bad counts are refused
naming the fix; the flag reaches the pipeline and the checkpointed config."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline import ScheduleError
from triax.pipeline.pipelined import PipelineConfig
from triax.pipeline.stage_counts import StageCountsError
from triax.pipeline.stage_layers import StageLayers
from triax.training.config import RunConfig
from triax.training.setup import build_run
from triax.training.step import Trainer
from triax.sharding.introspect.slot_flops import stage_op_flops
from pipeline_helpers import single_device_references

B, T = 8, 16


@pytest.fixture(scope="module")
def reference():
    """Per layer count: host params, batch, and the single-device loss and grads."""
    return single_device_references(B, T)


def trainer(cfg, kind, S, M, counts):
    return Trainer(cfg, make_mesh(pipe=S, devices=jax.devices()[:S]), "dp",
                   pipeline=PipelineConfig(kind, M, stage_layers=counts))


@functools.cache
def shared_trainer(cfg, kind, S, M, counts):
    """One trainer per configuration for the file: the compiled-FLOPs test reads the program
    the equivalence test ran (its jit's own cache, no second compile)."""
    return trainer(cfg, kind, S, M, counts)


# A short last stage (the head's), and a short first (the embedding's) and middle one; both
# 4 layers, so one one-device reference serves the file. GPipe runs 1F1B's op kinds
# (tick_kernels' F and B, each with its layer slots' conditional on this stage's count)
# and differs only in the tick program, a constant table the scan reads: a GPipe case
# would compile these kernels again (GPipe against one device: test_pipeline_executor.py).
@pytest.mark.parametrize("kind,S,M,counts", [
    ("1f1b", 2, 4, (3, 1)),
    ("1f1b", 3, 4, (1, 1, 2)),
])
def test_uneven_stages_equal_one_device(reference, kind, S, M, counts):
    cfg, params, batch, loss0, grads0 = reference(sum(counts))
    tr = shared_trainer(cfg, kind, S, M, counts)
    assert tr.pipeline.layout.counts == counts
    assert tr.pipeline.layout.per_chunk == max(counts)
    (loss, _), grads = tr.grads(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)
    assert_trees_close(grads, grads0, rtol=1e-5, atol=1e-6, what=f"{kind} {counts} grads")


def test_uneven_stages_on_a_3d_mesh_under_fsdp_tp(reference):
    """data=2 × tensor=2 × pipe=2: the stage's FSDP gather (once per step) and TP under
    uneven stages. The gather per layer inside the slot's conditional (``fsdp="layer"``) on
    this mesh and stages is test_pipeline_fsdp_layer.py's 1F1B case (three steps against one
    device), not compiled again here."""
    cfg, params, batch, loss0, grads0 = reference(4)
    tr = Trainer(cfg, make_mesh(data=2, tensor=2, pipe=2), "fsdp_tp",
                 pipeline=PipelineConfig("1f1b", 4, stage_layers=(3, 1)))
    (loss, _), grads = tr.grads(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)
    assert_trees_close(grads, grads0, rtol=1e-5, atol=1e-6, what="fsdp by stage grads")


def test_padded_slots_are_skipped_at_run_time(reference, monkeypatch):
    """The padded slots hold a real layer (layer 0's weights) instead of a zero block: only a
    stage that skips them computes the model's loss."""
    cfg, params, batch, loss0, _ = reference(4)
    monkeypatch.setattr(StageLayers, "_padding", lambda self, a, n: jnp.repeat(a[:1], n, 0))
    tr = trainer(cfg, "1f1b", 2, 2, (3, 1))
    pipe = tr.pipeline
    loss, _ = jax.jit(lambda p, b: pipe.forward(pipe.store(p), b))(params, batch)
    np.testing.assert_allclose(float(loss), loss0, rtol=1e-5)


def _compiled_grads(tr, params, batch):
    """The loss-and-gradient program ``tr.grads`` runs, compiled."""
    return tr.jitted_grads.lower(params, tr.shard_batch(batch)).compile()


def test_compiled_flops_show_the_short_stage_skips_its_padding(reference):
    """Per stage, the matmul FLOPs of one F and one B, read from the compiled loss and
    gradients: the layer slot's skip branch runs no matmul, so the 1-layer stage's F and B
    cost a third of the 3-layer stage's; the even split's stages each cost two layers'
    worth."""
    cfg, params, batch, _, _ = reference(4)
    # 1F1B (3, 1) on pipe=2: the first equivalence case's program, already compiled.
    compiled = _compiled_grads(shared_trainer(cfg, "1f1b", 2, 4, (3, 1)), params, batch)
    flops = stage_op_flops(compiled, (3, 1), 3)
    for op in ("F", "B"):
        long, short = flops[op]
        assert short > 0 and long == 3 * short, (op, flops[op])
    # The even layout runs every slot: no conditional. Read from its forward (F, the op a
    # slot conditional sits in; B's would be F's transposed), cheaper to compile than its
    # loss and gradients.
    pipe = trainer(cfg, "1f1b", 2, 4, None).pipeline
    even = jax.jit(pipe.forward).lower(params, batch).compile()
    with pytest.raises(ValueError, match="no layer-slot conditional"):
        stage_op_flops(even, (2, 2), 2)


@pytest.mark.parametrize("counts,kind,v,match", [
    ((3, 2), "1f1b", 1, r"add up to 5, but the model has 4 layers; make them add up to 4"),
    ((4,), "1f1b", 1, r"1 count\(s\) for 2 pipeline stage\(s\); give one per stage"),
    ((4, 0), "1f1b", 1, r"every stage needs at least 1 layer"),
    ((3, 1), "interleaved", 2, r"uneven stages run one chunk per stage; use virtual=1"),
    ((3, 1), "zb-h1", 1, r"split backward runs the padded layers too; use gpipe or 1f1b"),
])
def test_bad_counts_are_refused(counts, kind, v, match):
    cfg = config.TINY.replace(num_layers=4)
    with pytest.raises((StageCountsError, ScheduleError), match=match):
        Trainer(cfg, make_mesh(pipe=2, devices=jax.devices()[:2]), "dp",
                pipeline=PipelineConfig(kind, 4, v, stage_layers=counts))


def test_the_flag_reaches_the_pipeline_and_the_saved_config():
    run = RunConfig.of(model="tiny", num_layers=4, mesh="data=4,pipe=2", strategy="dp",
                       batch_size=16, seq_len=16, stage_layers="3,1")
    built = build_run(run)
    assert built.pipeline.stage_layers == (3, 1)
    assert built.trainer.pipeline.layout.counts == (3, 1)
    assert RunConfig.from_json(run.to_json()).pipeline.stage_counts() == (3, 1)   # what a checkpoint keeps
    with pytest.raises(ValueError, match=r"--stage-layers: .*add up to 5, but the model has "
                                         r"4 layers"):
        RunConfig.of(num_layers=4, stage_layers="3,2")
    with pytest.raises(ValueError, match=r"--stage-layers: stage_layers '3;1': give one layer "
                                         r"count per pipeline stage, comma-separated"):
        RunConfig.of(stage_layers="3;1")
    with pytest.raises(ValueError, match=r"--stage-layers fixes uneven stages, which --plan "
                                         r"auto lays out only for mixed generations: give "
                                         r"--plan-gpu"):
        run.replace(plan="auto")
    with pytest.raises(ValueError, match=r"--stage-layers 3,1 needs a pipelined mesh "
                                         r"\(pipe >= 2\), got pipe=1; add pipe=2"):
        build_run(run.replace(mesh="data=8"))
    with pytest.raises(ValueError, match=r"--stage-layers: .* 2 count\(s\) for 4 pipeline"):
        build_run(run.replace(mesh="data=2,pipe=4"))
