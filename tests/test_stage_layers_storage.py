"""Uneven stages store their blocks stage by stage (``StageLayers.store``: ``[S·Lc, ...]``
split over ``pipe``): each pipe rank holds only its own stage's layers, read from the compiled
program's ``memory_analysis`` (abstract compile, no allocation); the train state's zero slots
stay zero; checkpoints hold the model's ``[L, ...]`` whatever the stages, so a run saved with
one layout of stages resumes into another (and into no pipeline) with the same loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.checkpoint import Checkpointer
from triax.checkpoint.layout import config_json
from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline.pipelined import PipelineConfig
from triax.training.checkpoint import restore_step
from triax.training.config import RunConfig
from triax.training.optim import OptimConfig
from triax.training.setup import build_run
from triax.training.step import Trainer


def _bytes(tree) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(tree))


def _param_bytes_per_device(trainer) -> int:
    """Per-device bytes of the train state's parameters as XLA lays them out: the arguments
    of a compiled program over them (``memory_analysis``; nothing is allocated)."""
    shapes = trainer.abstract_state()["params"]
    fn = jax.jit(lambda p: sum(jnp.sum(a[(0,) * a.ndim]) for a in jax.tree.leaves(p)),
                 in_shardings=(trainer.param_shardings,))
    return fn.lower(shapes).compile().memory_analysis().argument_size_in_bytes


def test_each_pipe_rank_holds_only_its_stage_on_small():
    """``--stage-layers 5,3`` on small (8 layers, pipe=2, dp): a device's parameter bytes are
    the larger stage's share (its 5 layers and the replicated embedding and head), not the
    whole stack's 8 layers (1.60× that share, as the stack was kept before)."""
    run = RunConfig.of(model="small", num_layers=8, mesh="data=4,pipe=2", strategy="dp",
                       batch_size=16, seq_len=16, stage_layers="5,3")
    tr = build_run(run).trainer
    model = tr.abstract.shapes
    layer = _bytes(model["blocks"]) // 8
    pieces = _bytes({k: v for k, v in model.items() if k != "blocks"})
    share = pieces + 5 * layer                # the larger stage's, from the model's shapes
    got = _param_bytes_per_device(tr)
    assert got <= 1.05 * share, (got, share, got / share)
    assert got >= share, (got, share)         # and nothing missing


@pytest.fixture(scope="module")
def saved_31(tmp_path_factory):
    """tiny, 4 layers, stages (3, 1) on pipe=2: a step, saved as the loop saves it; the
    batches of two more steps; the losses of those steps where it was saved."""
    cfg = config.TINY.replace(num_layers=4)
    tr = trainer(cfg, (3, 1))
    b0, b1, b2 = (tr.example_batch(8, 16, seed=s) for s in range(3))
    state, _ = tr.step(tr.init(0), b0)
    d = str(tmp_path_factory.mktemp("uneven") / "ck")
    with Checkpointer(d, async_save=False) as ck:
        ck.save(1, tr.to_saved(state), {"model": config_json(cfg)}, wait=True)
    pad = jax.device_get(state["params"]["blocks"])          # [S·Lc, ...] = [6, ...]
    losses = []
    for b in (b1, b2):
        state, m = tr.step(state, b)
        losses.append(float(m["loss"]))
    return cfg, d, (b1, b2), losses, pad


def trainer(cfg, counts, mesh=None):
    mesh = mesh or make_mesh(pipe=2, devices=jax.devices()[:2])
    pipeline = None if counts == "none" else PipelineConfig("1f1b", 2, stage_layers=counts)
    return Trainer(cfg, mesh, "dp", pipeline=pipeline, optim=OptimConfig(lr=1e-2))


def test_the_zero_slots_stay_zero(saved_31):
    """Stage 1's two padded slots (storage slots 4 and 5) after a step: still zero blocks
    (``StageLayers.store`` pads with zeros; skipped, they get zero gradients, and an all-zero
    block is a fixed point of AdamW even where it runs)."""
    *_, pad = saved_31
    for leaf in jax.tree.leaves(pad):
        assert leaf.shape[0] == 6 and not np.any(leaf[4:]), leaf.shape


@pytest.mark.parametrize("counts", [(2, 2), "none"])
def test_a_checkpoint_of_one_stage_layout_resumes_into_another(saved_31, counts):
    """Saved with stages (3, 1), resumed into (2, 2) and into no pipeline (one device): the
    next two steps' losses (the optimizer's moments too, in the second) equal those of the
    run that saved it."""
    cfg, d, batches, losses, _ = saved_31
    mesh = make_mesh(devices=jax.devices()[:1]) if counts == "none" else None
    tr = trainer(cfg, counts, mesh)
    with Checkpointer(d, read_only=True) as ck:
        state, _ = restore_step(ck, 1, cfg, tr)
    got = []
    for b in batches:
        state, m = tr.step(state, b)
        got.append(float(m["loss"]))
    np.testing.assert_allclose(got, losses, rtol=1e-5)
