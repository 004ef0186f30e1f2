"""Faults caught before a run starts (issue 17, items 5 and 6): nonsense hyperparameters, a
sequence past the model's context, and a step that would not fit in a device's memory
(predicted from the compiled step, before any state is allocated), for ``train`` and for
``generate``'s weights and KV cache. Through the in-process CLI entry point, so the messages
are what a user sees."""
import warnings

import jax
import pytest
import tiny_runs

from triax.cli.main import main
from triax.inference.engine import Engine, held_bytes_per_device
from triax.inference.generate import check_serving_memory, engine_config_for
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.introspect import memory_from_compiled
from triax.training.config import RunConfig, RunConfigWarning
from triax.costs.fits import MEMORY_ENV, device_capacity
from triax.training.memory_check import check_train_memory
from triax.training.setup import build_run
from triax.units import human_bytes

# One small program, compiled once: the CLI run below and build_run share it (step_cache),
# and the other files training tiny_runs.DP.
SMALL = dict(tiny_runs.DP, steps=2)


def _argv(**kw) -> list[str]:
    return [a for k, v in kw.items() for a in (f"--{k.replace('_', '-')}", str(v))]


@pytest.mark.parametrize("flag, value, fix", [
    ("--lr", "-1", "e.g. --lr 3e-3"),
    ("--lr", "0", "e.g. --lr 3e-3"),
    ("--steps", "0", "e.g. --steps 200"),
    ("--weight-decay", "-0.1", "use 0 for none"),
])
def test_nonsense_hyperparameters_are_refused_naming_flag_and_fix(capsys, flag, value, fix):
    assert main(["train", flag, value]) == 2
    err = capsys.readouterr().err
    assert f"{flag} {value}: must be" in err and fix in err


def test_a_config_file_gets_the_same_checks(tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text("lr = -0.5\n")
    assert main(["train", "--config", str(path)]) == 2
    assert "--lr -0.5: must be > 0" in capsys.readouterr().err


def test_warmup_longer_than_the_run_warns():
    with pytest.warns(RunConfigWarning, match=r"--lr-warmup-steps 20 is longer than the run "
                                              r"\(--steps 10\)"):
        RunConfig.of(steps=10, lr_warmup_steps=20)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RunConfig.of(steps=20, lr_warmup_steps=20)   # warmup ending on the last step: legal


def test_a_sequence_past_the_context_is_refused_up_front(capsys):
    assert main(["train", "--model", "tiny", "--seq-len", "100000"]) == 2
    err = capsys.readouterr().err
    assert "--seq-len 100000 is longer than tiny's context (max_seq_len 256)" in err
    assert "use --seq-len 256 or less" in err
    assert "or --max-seq-len 100000 to lengthen the context" in err   # the fix, named


def test_max_seq_len_lengthens_a_presets_context(capsys):
    """``--max-seq-len`` lengthens tiny's 256 tokens (RoPE needs no table): a sequence the
    preset refuses runs, split over the context axis."""
    long = ["train", "--model", "tiny", "--num-layers", "1", "--seq-len", "512", "--mesh",
            "context=8", "--strategy", "dp", "--batch-size", "2", "--steps", "2", "--data",
            "markov", "--eval-batches", "0", "--no-save", "--no-progress"]
    assert main(long) == 2
    assert "--max-seq-len 512" in capsys.readouterr().err
    assert main([*long, "--max-seq-len", "512"]) == 0
    assert RunConfig.of(max_seq_len=512).model_config().max_seq_len == 512


@pytest.fixture(scope="module")
def small_run():
    return build_run(RunConfig.of(**SMALL))


def test_a_step_that_does_not_fit_stops_before_allocating(small_run, tmp_path, monkeypatch,
                                                          capsys):
    peak = memory_from_compiled(small_run.compiled.step).peak_bytes
    monkeypatch.setenv(MEMORY_ENV, str(int(peak * 0.6)))   # a device with too little memory
    ckpt, log = tmp_path / "ckpt", tmp_path / "log.jsonl"
    assert main(["train", *_argv(**SMALL, checkpoint_dir=ckpt, log_json=log),
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"the training step needs {human_bytes(peak)} per device" in err
    assert f"({MEMORY_ENV}={int(peak * 0.6)})" in err
    assert "largest terms: temporaries" in err and "optimizer state" in err
    assert "the planner (triax plan, an analytic model) suggests --mesh" in err
    assert "--skip-memory-check" in err
    # Stopped before the checkpoints were opened and the first step ran.
    assert not ckpt.exists() and not log.exists()
    # The escape hatch runs it anyway (same compiled step, from the cache).
    assert main(["train", *_argv(**SMALL, log_json=log), "--no-progress",
                 "--skip-memory-check"]) == 0
    assert len(log.read_text().splitlines()) == SMALL["steps"]


def test_the_normal_small_run_passes_the_check(small_run):
    capacity = device_capacity()   # the real one: available host memory / 8 devices
    assert capacity is not None and "simulated devices" in capacity[1]
    mem = check_train_memory(small_run)
    assert 0 < mem.peak_bytes < capacity[0]


def test_generate_stops_before_loading_when_a_replica_does_not_fit(monkeypatch, capsys):
    monkeypatch.setenv(MEMORY_ENV, "64KiB")
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "4",
                 "--mesh", "tensor=2", "--replicas", "4", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""                      # nothing was generated
    err = captured.err
    assert "serving tiny (8 slots, a KV pool of 8 blocks × 16 positions) needs" in err
    assert "largest terms: weights" in err and "KV cache" in err
    assert "Instead: the planner" in err and "--skip-memory-check" in err


def test_a_small_replica_passes_the_serving_check_with_what_the_engine_then_holds(devices):
    cfg = config.get("tiny", num_layers=1)
    mesh = make_mesh(tensor=2, devices=devices[:2])
    ecfg = engine_config_for(cfg, {"tensor": 2}, 8, 8)
    held = held_bytes_per_device(cfg, mesh, "tp", ecfg)
    assert 0 < sum(held.values()) < device_capacity()[0]
    check_serving_memory(cfg, mesh, "tp", ecfg)            # fits: no error
    # The figures known before allocating are what the built engine holds on a device.
    eng = Engine.from_seed(cfg, mesh, seed=0, ecfg=ecfg)
    assert held["KV cache"] == sum(a.addressable_shards[0].data.nbytes
                                   for a in eng.cache.values())
    assert held["weights"] == sum(a.addressable_shards[0].data.nbytes
                                  for a in jax.tree.leaves(eng.params))
