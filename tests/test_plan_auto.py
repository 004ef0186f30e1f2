"""``--plan auto`` for training: the planner's ranking proved by compiling, on 8 simulated
devices (tiny, 1 layer, batch 8 × 16 tokens: every compile is one of the smallest steps, and
with one layer the search has no pipelined plans, so no pipeline probe runs).
The search runs once per process (``planner.auto._searched``) and the compiled steps are
shared through ``training.step_cache``, so later tests reuse the earlier ones' compiles."""
import dataclasses
import json
import math

import jax
import numpy as np
import pytest

from triax.cli.main import main
from triax.costs.workload import Workload
from triax.mesh import make_mesh
from triax.planner import auto
from triax.training.config import RunConfig
from triax.training.setup import build_run
from triax.training.step import Trainer

RUN = RunConfig.of(model="tiny", num_layers=1, batch_size=8, seq_len=16, steps=3, plan="auto",
                   data="markov", progress=False, eval_batches=0)
GIVEN = frozenset({"model", "num_layers", "batch_size", "seq_len", "steps", "plan"})
MIB = 1 << 20


def _choose(mib: float, run=RUN, given=GIVEN):
    return auto.choose_train(run, given, budget=auto.Budget(int(mib * MIB), "a test budget"))


def _state_bytes(run: RunConfig) -> int:
    """Bytes of parameters and optimizer state one device holds (from the shardings)."""
    state = build_run(run).trainer.abstract_state()
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(state))


def _losses(trainer: Trainer, init, n=3):
    """``n`` steps' losses from ``init`` (a host train state, placed: no init compile)."""
    state = trainer.place(init)
    out = []
    for i in range(n):
        state, m = trainer.step(state, trainer.example_batch(8, 16, seed=i))
        out.append(float(m["loss"]))
    return out


@pytest.fixture(scope="module")
def big():
    return _choose(64)


def test_big_budget_takes_the_models_fastest_and_equals_one_device(big, devices):
    cluster, _ = auto.present_cluster()
    fastest = auto._searched(Workload.of_run(RUN, backend=jax.devices()[0].platform), cluster,
                             ("none", "full"))[0]
    assert big.plan == fastest and not big.refused
    assert big.compiled.peak_bytes <= big.budget.usable
    assert build_run(big.run).mesh.devices.size == 8
    one = Trainer(RUN.model_config(), make_mesh(devices=devices[:1]), "dp",
                  optim=RUN.optim_config(), exe=RUN.exec_config(), total_steps=RUN.loop.steps)
    init = jax.device_get(one.init(seed=0))
    np.testing.assert_allclose(_losses(build_run(big.run).trainer, init), _losses(one, init),
                               rtol=1e-5)


def test_shrinking_budgets_shard_more_and_each_compiled_peak_fits(big):
    chosen = [big] + [_choose(mib) for mib in (1.2, 0.6)]
    peaks = [c.compiled.peak_bytes for c in chosen]
    held = [_state_bytes(c.run) for c in chosen]
    what = [(auto.label(c.plan), p, h) for c, p, h in zip(chosen, peaks, held)]
    # Each smaller budget moves the choice to a plan that peaks lower and holds no more
    # (dp → tp_sp → fsdp_tp_sp); the last holds less state per device: it shards more.
    assert peaks == sorted(set(peaks), reverse=True), what
    assert held == sorted(held, reverse=True) and held[-1] < held[0], what
    for c in chosen:
        assert c.compiled.peak_bytes <= c.budget.usable, auto.label(c.plan)


def test_the_compile_has_the_last_word(big, monkeypatch):
    """A model that halves one plan's memory (plain dp, the fastest): the compile refuses it,
    and the next plan is chosen (both compiles are the tests' above, shared)."""
    real = auto._searched

    def optimistic(*args):
        return tuple(dataclasses.replace(p, memory=dataclasses.replace(
            p.memory, overhead=-p.memory.modelled / 2)) if p == big.plan else p
            for p in real(*args))
    monkeypatch.setattr(auto, "_searched", optimistic)
    c = _choose(1.2)
    assert [auto.label(x.plan) for x in c.refused] == [auto.label(big.plan)]
    assert c.refused[0].compiled_peak > c.budget.usable >= c.compiled.peak_bytes


def test_nothing_fits_names_the_smallest_need_and_the_fixes():
    with pytest.raises(auto.NoPlanFits, match=r"nothing fits: the smallest plan .* needs "
                                              r".* per device .*more devices.*--seq-len.*LoRA"):
        _choose(0.1)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_nothing_fits_never_suggests_the_remat_it_has(remat):
    """The smallest plan already rematerialises fully: --remat full is no fix to offer."""
    from types import SimpleNamespace as NS
    smallest = NS(layout=NS(describe=lambda: "data=8 dp"), memory=NS(total=2**30),
                  workload=NS(remat=remat, run_label=f"remat {remat}"))
    text = auto._nothing_fits("tiny", "8 devices", auto.Budget(2**20, "test"), [], [smallest],
                              frozenset(), RunConfig())
    assert ("--remat full" in text) == (remat != "full"), text


def test_flags_the_user_gives_stay_fixed(capsys):
    assert main(["train", "--model", "tiny", "--num-layers", "1", "--batch-size", "8",
                 "--seq-len", "16", "--plan", "auto", "--strategy", "fsdp",
                 "--device-memory", "64MiB", "--dry-run", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["strategy"] == "fsdp" and got["compiled_peak_bytes"] <= got["usable_bytes"]
    assert got["budget_source"] == "--device-memory 64MiB"
    for key in ("mesh", "schedule", "microbatches", "remat", "loss_chunks",
                "context_attention", "predicted_peak_bytes", "budget_bytes"):
        assert key in got


def test_resume_keeps_the_plan(big, tmp_path):
    from triax.training.loop import train
    train(big.run.replace(checkpoint_dir=str(tmp_path), steps=1), note=lambda *_: None)
    # A smaller budget would choose another plan; the checkpoint's is kept.
    again = _choose(0.6, run=RUN.replace(checkpoint_dir=str(tmp_path), resume=True),
                    given=GIVEN | {"checkpoint_dir", "resume"})
    assert (again.run.layout.mesh, again.run.layout.strategy, again.run.compute.remat) == \
        (big.run.layout.mesh, big.run.layout.strategy, big.run.compute.remat)
    assert "kept the plan saved with checkpoint step 1" in again.describe()


def test_generate_auto_keeps_the_given_replicas_and_fits(capsys):
    """Serving: the split of each replica is searched, --replicas stays as given, and the
    chosen decode step's compiled peak is within the budget."""
    assert main(["generate", "--model", "tiny", "--num-layers", "1", "--prompt", "Hi",
                 "--max-new-tokens", "4", "--plan", "auto", "--replicas", "2",
                 "--device-memory", "2MiB", "--dry-run", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["replicas"] == 2 and math.prod(got["mesh"].values()) == 4
    assert got["compiled_peak_bytes"] <= got["usable_bytes"]
