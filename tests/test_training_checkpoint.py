"""Checkpoints: bit-identical resume, resharded resume, bad checkpoint dirs, SIGTERM, SIGKILL."""
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import tiny_runs
from compile_counter import compiles_during
from suite_env import strict_env

from triax.cli.main import main
from triax.checkpoint import CheckpointError, Checkpointer
from triax.training.config import RunConfig
from triax.training.loop import train

# fsdp: a sharded state (the resume tests reshard it; a dp one saves as cheaply since
# Checkpointer writes replicated arrays whole in one process).
# The SIGTERM child trains the same model and step, given as flags (and the test process's
# JAX settings, ``_child_env``): it compiles the programs the in-process runs did
# (persistent-cache hits, not cold compiles), as test_checkpoint_integrity's runs do.
RUN = dict(tiny_runs.FSDP, seed=3)
BASE = RunConfig.of(**RUN, steps=6, progress=False)
QUIET = dict(note=lambda *_: None)
# The directory that holds the `triax` package (the repo root is the package itself).
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A: 6 steps straight. B: 3 steps, saved (copied aside). C: B resumed to 6."""
    d = tmp_path_factory.mktemp("ck")
    straight = train(BASE, **QUIET).losses
    first = train(BASE.replace(steps=3, checkpoint_dir=str(d / "run")), **QUIET).losses
    shutil.copytree(d / "run", d / "at3")
    rest = train(BASE.replace(checkpoint_dir=str(d / "run"), resume=True), **QUIET).losses
    return d, straight, first, rest


def test_resume_is_bit_identical(runs):
    _, straight, first, rest = runs
    assert len(first) == 3 and len(rest) == 3
    assert first + rest == straight  # exact float equality, step by step


def test_resharded_resume_on_another_mesh_and_strategy(runs, tmp_path):
    d, straight, _, _ = runs
    shutil.copytree(d / "at3", tmp_path / "c")
    run = BASE.replace(mesh="data=2,tensor=2,pipe=2", strategy="fsdp_tp",
                       checkpoint_dir=str(tmp_path / "c"), resume=True)
    res = train(run, **QUIET)
    np.testing.assert_allclose(res.losses, straight[3:], rtol=1e-5)
    assert res.summary["pipeline"] == {"schedule": "1f1b", "stages": 2, "microbatches": 4,
                                       "virtual": 1}  # the pipelined step, restored
    meta = Checkpointer(str(tmp_path / "c"), read_only=True).read_meta(6)
    assert meta["mesh_sizes"] == {"replica": 1, "data": 2, "pipe": 2, "expert": 1, "context": 1,
                                  "tensor": 2}
    assert (meta["strategy"], meta["data_position"]) == ("fsdp_tp", 6)


def test_checkpoints_command_lists_steps_sizes_mesh(runs, capsys):
    d, *_ = runs
    assert main(["checkpoints", str(d / "run")]) == 0
    out = capsys.readouterr().out
    lines = [line.split() for line in out.splitlines()[1:]]
    assert [int(line[0]) for line in lines] == [3, 6]
    assert all("data=8" in line and "fsdp" in line and "tiny/L2" in line for line in lines)


def _meta_file(step_dir) -> str:
    """The JSON file Orbax keeps a step's meta item in (the one holding "run")."""
    for root, _, files in os.walk(step_dir / "meta"):
        for name in files:
            path = os.path.join(root, name)
            with open(path) as f:
                try:
                    if "run" in json.load(f):
                        return path
                except ValueError:
                    continue
    raise AssertionError(f"no meta JSON under {step_dir}")


def test_run_is_saved_in_sections_and_old_flat_runs_still_read(runs, tmp_path):
    """The run is saved section by section; a checkpoint from before the sections (its run
    flat) still reads: RunConfig.from_json, ``triax checkpoints``, --plan auto's kept plan."""
    from triax.cli.checkpoints_cmd import list_checkpoints
    from triax.configs import sections
    from triax.planner.auto import kept_plan
    d, *_ = runs
    c = shutil.copytree(d / "at3", tmp_path / "c")
    want = BASE.replace(steps=3, checkpoint_dir=str(d / "run"))
    saved = Checkpointer(str(c), read_only=True).read_meta(3)["run"]
    assert set(saved) == set(sections(RunConfig)) and saved["dataset"]["batch_size"] == 8
    assert RunConfig.from_json(saved) == want
    path = _meta_file(c / "3")
    with open(path) as f:
        meta = json.load(f)
    meta["run"] = want.flat()                        # as every checkpoint before held it
    with open(path, "w") as f:
        json.dump(meta, f)
    old = Checkpointer(str(c), read_only=True).read_meta(3)["run"]
    assert "batch_size" in old and "dataset" not in old
    assert RunConfig.from_json(old) == want
    listed = list_checkpoints(str(d / "at3")) + list_checkpoints(str(c))   # sectioned, flat
    assert [(r["data"], r["batch_size"], r["seq_len"]) for r in listed] == [("markov", 8, 16)] * 2
    kept, why = kept_plan(RunConfig.of(checkpoint_dir=str(c), resume=True, mesh="data=4"))
    assert (kept.layout.mesh, kept.layout.strategy) == ("data=8", "fsdp"), why


def test_model_config_mismatch_names_the_fields(runs, tmp_path):
    d, *_ = runs
    shutil.copytree(d / "at3", tmp_path / "c")
    run = BASE.replace(num_layers=1, checkpoint_dir=str(tmp_path / "c"), resume=True)
    with compiles_during() as compiles, pytest.raises(
            CheckpointError, match=r"different model \(num_layers: checkpoint 2 vs requested 1\)"):
        train(run, **QUIET)
    assert compiles == [], "the saved model is checked before the step compiles"
    assert Checkpointer(str(tmp_path / "c"), read_only=True).steps() == [3]


def test_existing_checkpoints_without_resume_are_not_overwritten(runs):
    d, *_ = runs
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(steps \[3\]\); pass "
                                              r"--resume"):
        train(BASE.replace(checkpoint_dir=str(d / "at3")), **QUIET)


def test_corrupt_checkpoint_is_a_clear_error_and_kept(runs, tmp_path):
    d, *_ = runs
    shutil.copytree(d / "at3", tmp_path / "c")
    state_dir = tmp_path / "c" / "3" / "state"
    for name in os.listdir(state_dir):
        if name != "_METADATA":
            p = state_dir / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    run = BASE.replace(checkpoint_dir=str(tmp_path / "c"), resume=True)
    with pytest.raises(CheckpointError, match=r"no intact checkpoint in .* \(step 3: "):
        train(run, **QUIET)
    assert (tmp_path / "c" / "3").is_dir()  # nothing deleted or moved: no step to fall back on


def _child_env():
    env = strict_env(dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8",
                          PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")))
    return env


def test_sigterm_saves_commits_and_exits_cleanly(tmp_path):
    flags = [f for k, v in RUN.items() for f in (f"--{k.replace('_', '-')}", str(v))]
    cmd = [sys.executable, "-m", "triax", "train", *flags, "--steps", "100000", "--no-progress",
           "--checkpoint-dir", str(tmp_path / "c"), "--log-json", str(tmp_path / "m.jsonl")]
    proc = subprocess.Popen(cmd, env=_child_env(), stderr=subprocess.PIPE, text=True)
    log, deadline = tmp_path / "m.jsonl", time.time() + 240
    # A step's record written: the loop runs (its handler in place), the signal lands mid-run.
    while time.time() < deadline and not (log.exists() and log.read_text()):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err
    steps = Checkpointer(str(tmp_path / "c"), read_only=True).steps()
    assert len(steps) == 1 and f"received SIGTERM at step {steps[0]}; saved checkpoint step " \
                               f"{steps[0]}" in err and "(committed)" in err


KILL_CHILD = textwrap.dedent("""
    import asyncio, sys, time
    import jax.numpy as jnp
    from orbax.checkpoint._src.path import atomicity
    from triax.checkpoint import Checkpointer
    ck = Checkpointer(sys.argv[1])
    ck.save(1, {"w": jnp.arange(4096.0)}, {"step": 1}, wait=True)
    async def stalled_commit(self):  # the data is written; the commit never comes
        open(sys.argv[2], "w").close()
        await asyncio.sleep(600)
    atomicity.AtomicRenameTemporaryPath.finalize = stalled_commit
    ck.save(2, {"w": jnp.arange(4096.0) + 1}, {"step": 2})
    time.sleep(600)
""")


def test_sigkill_during_save_keeps_previous_checkpoint(tmp_path):
    marker = tmp_path / "saving"
    proc = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(tmp_path / "c"), str(marker)],
                            env=_child_env())
    deadline = time.time() + 120
    while not marker.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    assert marker.exists(), "child never reached the save"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    leftovers = [n for n in os.listdir(tmp_path / "c") if "tmp" in n]
    assert leftovers, "expected a partial save directory"
    assert "2" not in os.listdir(tmp_path / "c")
    import jax
    import jax.numpy as jnp
    ck = Checkpointer(str(tmp_path / "c"))  # opening for writing cleans partial saves up
    assert ck.steps() == [1]
    target = {"w": jax.ShapeDtypeStruct((4096,), jnp.float32,
                                        sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0]))}
    state, meta = ck.restore(1, target)
    np.testing.assert_array_equal(np.asarray(state["w"]), np.arange(4096.0))
    assert meta["step"] == 1 and list(meta["checksums"]) == ["w"]
    assert not [n for n in os.listdir(tmp_path / "c") if "tmp" in n]
    ck.close()
