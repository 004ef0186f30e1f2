"""``triax.auto_trainer``: a user's model (the MLP-Mixer and the ViT of
``user_models``) laid out by compiling every strategy × data × tensor mesh of 8 simulated
devices; the choice fits its budget and trains like one device. One search per model, shared
through a module fixture."""
import jax
import numpy as np
import pytest
from user_models import (MIXER_RULES, Mixer, MixerConfig, ViT, VitConfig, image_batch,
                         mixer_batch, mixer_loss, vit_loss)

import triax
from triax.mesh import make_mesh
from triax.planner import auto_model
from triax.planner.auto import NoPlanFits

MIXER = MixerConfig(layers=1)
BATCHES = [mixer_batch(MIXER, 8, seed=i) for i in range(3)]


def make(rngs):
    return Mixer(MIXER, rngs)


VIT = VitConfig(layers=1, dim=16, heads=4, mlp=32)
VIT_RULES = {"pixels": None, "classes": None}
VIT_BATCHES = [image_batch(VIT, 8, seed=i) for i in range(3)]


def make_vit(rngs):
    return ViT(VIT, rngs)


def _auto(device_memory):
    return triax.auto_trainer(make, mixer_loss, rules=MIXER_RULES, example_batch=BATCHES[0],
                              device_memory=device_memory)


def _losses(trainer, init, batches=BATCHES):
    """The losses of steps over ``batches`` from ``init`` (a host train state, placed: no
    init compile for the chosen mesh)."""
    state = trainer.place(init)
    out = []
    for b in batches:
        state, m = trainer.step(state, b)
        out.append(float(m["loss"]))
    return out


@pytest.fixture(scope="module")
def searched():
    """The budget sits below the replicated layouts' compiled peak: auto must shard."""
    first = _auto("1GiB").auto
    dp = next(x for x in [first.chosen, first.runner_up, *first.refused]
              if x and x.strategy == "dp" and dict(x.mesh)["data"] == 8)
    budget = f"{int(dp.peak * 0.95)}B"
    return dp, _auto(budget)


def test_for_model_auto_fits_and_equals_one_device(searched, devices):
    dp, trainer = searched
    c = trainer.auto
    assert c.chosen.peak <= c.budget.usable < dp.peak
    assert dict(trainer.mesh.shape) == {**dict(trainer.mesh.shape), **dict(c.chosen.mesh)}
    assert any("compiled peak" in r.why for r in c.refused)       # dp among the refused
    one = triax.Trainer.for_model(make, mixer_loss, make_mesh(devices=devices[:1]), "dp",
                                  rules=MIXER_RULES)
    init = jax.device_get(one.init(seed=0))
    np.testing.assert_allclose(_losses(trainer, init), _losses(one, init), rtol=1e-5)


def test_second_call_compiles_nothing_and_too_small_a_budget_is_refused(searched):
    before = auto_model.COUNTS["compiles"]
    again = _auto(f"{searched[1].auto.budget.bytes}B")
    assert auto_model.COUNTS["compiles"] == before
    assert again.auto.chosen == searched[1].auto.chosen
    with pytest.raises(NoPlanFits, match=r"nothing fits: the smallest layout.* needs .* "
                                         r"per device \(compiled\).*more devices"):
        _auto("1KiB")
    assert auto_model.COUNTS["compiles"] == before


def test_for_model_auto_on_the_vit_fits_and_equals_one_device(devices):
    """The ViT: its budget too sits below data=8 dp's compiled peak, so the choice shards."""
    def auto(budget):
        return triax.auto_trainer(make_vit, vit_loss, rules=VIT_RULES,
                                  example_batch=VIT_BATCHES[0], device_memory=budget)
    first = auto("1GiB").auto
    dp = next(x for x in [first.chosen, first.runner_up, *first.refused]
              if x and x.strategy == "dp" and dict(x.mesh)["data"] == 8)
    trainer = auto(f"{int(dp.peak * 0.95)}B")
    c = trainer.auto
    assert c.chosen.peak <= c.budget.usable < dp.peak
    one = triax.Trainer.for_model(make_vit, vit_loss, make_mesh(devices=devices[:1]), "dp",
                                  rules=VIT_RULES)
    init = jax.device_get(one.init(seed=0))
    np.testing.assert_allclose(_losses(trainer, init, VIT_BATCHES),
                               _losses(one, init, VIT_BATCHES), rtol=1e-5)
