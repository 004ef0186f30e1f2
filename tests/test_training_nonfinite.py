"""--on-nonfinite stop|skip|rollback, each with a NaN injected into one batch: an input token
id past the vocabulary makes the embedding lookup (``jnp.take``, fill mode) NaN, the way a
corrupt shard would. The data position and the step counter stay consistent, so a resume
from any checkpoint written after the fault reproduces the run."""
import shutil

import jax
import numpy as np
import pytest
import tiny_runs

from triax.checkpoint import Checkpointer
from triax.mesh import make_mesh
from triax.training.config import RunConfig
from triax.training.data import Batches
from triax.training.loop import NonFiniteLoss, train
from triax.training.step import Trainer

BAD = 4   # the batch index that carries the NaN: consumed by step 5
BASE = RunConfig.of(**tiny_runs.DP, steps=8, seed=6, progress=False, checkpoint_every=1,
                    keep_checkpoints=20)
QUIET = dict(note=lambda *_: None)
_clean_batch = Batches.numpy_batch


def _poisoned(self, index, rows=slice(None)):
    batch = _clean_batch(self, index, rows)
    if index == BAD:
        batch["inputs"][0, 0] = 10 ** 6
    return batch


def _shifted(self, index, rows=slice(None)):
    """The clean data with batch BAD left out: what rollback must train on after step 4."""
    return _clean_batch(self, index + (index >= BAD), rows)


def _meta(d, step):
    return Checkpointer(str(d), read_only=True).read_meta(step)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("nf")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batches, "numpy_batch", _shifted)
        out["shifted"] = train(BASE, **QUIET).losses
        mp.setattr(Batches, "numpy_batch", _poisoned)
        with pytest.raises(NonFiniteLoss) as e:
            train(BASE.replace(checkpoint_dir=str(d / "stop")), **QUIET)
        out["stop"] = str(e.value)
        for mode in ("skip", "rollback"):
            notes = []
            res = train(BASE.replace(on_nonfinite=mode, checkpoint_dir=str(d / mode)),
                        note=notes.append)
            out[mode] = res, "\n".join(notes)
    return d, out


def test_stop_names_step_and_batch(runs):
    """The default mode: the run stops naming the step, the batch, the last good checkpoint
    (kept, finite) and the fixes. Also the path a diverging run takes (a NaN loss is a NaN
    loss, whatever made it)."""
    d, out = runs
    assert "loss nan at step 5 (batch 4); stopped without saving; the last good checkpoint " \
           "(step 4)" in out["stop"]
    assert "Try a lower --lr or --precision fp32, or --on-nonfinite skip|rollback" in out["stop"]
    ck = Checkpointer(str(d / "stop"), read_only=True)
    assert ck.steps() == [1, 2, 3, 4]
    abstract = Trainer(BASE.model_config(), make_mesh(data=8), "dp").abstract_state()
    state, _ = ck.restore(4, abstract)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state["params"]))


def test_skip_drops_the_update_and_keeps_counting(runs):
    d, out = runs
    res, said = out["skip"]
    assert res.skipped == [(5, BAD)] and len(res.losses) == 7
    assert "loss nan at step 5 (batch 4); update dropped" in said
    assert res.losses[:4] == out["shifted"][:4]
    ck = Checkpointer(str(d / "skip"), read_only=True)
    abstract = res.trainer.abstract_state()
    before, m4 = ck.restore(4, abstract)
    after, m5 = ck.restore(5, abstract)
    for part in ("params", "opt_state"):   # the optimizer state is unchanged, bit for bit
        for a, b in zip(jax.tree.leaves(before[part]), jax.tree.leaves(after[part])):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (int(after["step"]), m5["step"], m5["data_position"]) == (5, 5, 5)
    assert (m4["data_position"], _meta(d / "skip", 8)["data_position"]) == (4, 8)


def test_rollback_restores_and_skips_the_bad_window(runs):
    d, out = runs
    res, said = out["rollback"]
    assert res.rollbacks == [(5, BAD, 4)]
    assert "rolled back to step 4 and skipped the data up to batch 4" in said
    # Steps 5-8 trained on batches 5-8: the clean run without batch 4 (an independent run).
    assert res.losses == out["shifted"]
    m = _meta(d / "rollback", 8)
    assert (m["step"], m["data_position"]) == (8, 9)


@pytest.mark.parametrize("mode", ["skip", "rollback"])
def test_resume_after_the_fault_is_deterministic(runs, tmp_path, mode):
    d, out = runs
    shutil.copytree(d / mode, tmp_path / "c")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Batches, "numpy_batch", _poisoned)
        res = train(BASE.replace(on_nonfinite=mode, checkpoint_dir=str(tmp_path / "c"),
                                 resume_from=6), **QUIET)
    assert res.losses == out[mode][0].losses[-2:]
