"""``Trainer.for_model(plan="auto")``: a user's model (the MLP-Mixer of ``user_models``) laid
out by compiling every strategy × data × tensor mesh of 8 simulated devices; the choice fits
its budget and trains like one device. One search, shared through a module fixture."""
import numpy as np
import pytest
from user_models import MIXER_RULES, Mixer, MixerConfig, mixer_batch, mixer_loss

import triax
from triax.mesh import make_mesh
from triax.planner import auto_model
from triax.planner.auto import NoPlanFits

MIXER = MixerConfig(layers=1)
BATCHES = [mixer_batch(MIXER, 8, seed=i) for i in range(3)]


def make(rngs):
    return Mixer(MIXER, rngs)


def _auto(device_memory):
    return triax.Trainer.for_model(make, mixer_loss, rules=MIXER_RULES, plan="auto",
                                   example_batch=BATCHES[0], device_memory=device_memory)


def _losses(trainer):
    state = trainer.init(seed=0)
    out = []
    for b in BATCHES:
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
    np.testing.assert_allclose(_losses(trainer), _losses(one), rtol=1e-5)


def test_second_call_compiles_nothing_and_too_small_a_budget_is_refused(searched):
    before = auto_model.COUNTS["compiles"]
    again = _auto(f"{searched[1].auto.budget.bytes}B")
    assert auto_model.COUNTS["compiles"] == before
    assert again.auto.chosen == searched[1].auto.chosen
    with pytest.raises(NoPlanFits, match=r"nothing fits: the smallest layout.* needs .* "
                                         r"per device \(compiled\).*more devices"):
        _auto("1KiB")
    assert auto_model.COUNTS["compiles"] == before
