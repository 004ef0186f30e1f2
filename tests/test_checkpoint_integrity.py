"""Damaged checkpoints: truncated files and arrays that decode but changed are found (naming
the step and the array), --resume falls back to the newest intact step and keeps the bad one,
--resume-from picks a step, `triax checkpoints --verify` reports every step."""
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tiny_runs
from compile_counter import compiles_during
from triax.checkpoint import CorruptCheckpoint, Checkpointer, checksums
from triax.cli.main import main
from triax.training.config import RunConfig
from triax.training.loop import train

# fsdp: the mesh is not the point here (a dp state saves without per-device programs too:
# test_one_process_saves_compile_no_slice_programs); test_training_checkpoint's run, so its
# programs (tiny_runs.FSDP).
BASE = RunConfig.of(**tiny_runs.FSDP, steps=6, seed=4, progress=False, checkpoint_every=3)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One 6-step run with steps 3 and 6 saved, and its losses."""
    d = tmp_path_factory.mktemp("ck")
    losses = train(BASE.replace(checkpoint_dir=str(d / "run")), note=lambda *_: None).losses
    return d / "run", losses


def _copy(saved, tmp_path):
    shutil.copytree(saved, tmp_path / "c")
    return tmp_path / "c"


def _truncate_arrays(step_dir):
    """Bit rot / a bad copy: every array data file of the step loses its second half."""
    for root, _, files in os.walk(step_dir / "state"):
        if os.sep + "d" in root:
            for f in files:
                p = os.path.join(root, f)
                os.truncate(p, os.path.getsize(p) // 2)


def _resume(c, notes, **kw):
    return train(BASE.replace(checkpoint_dir=str(c), resume=True, **kw), note=notes.append)


def test_truncated_step_falls_back_to_the_newest_intact_one(saved, tmp_path):
    src, straight = saved
    c = _copy(src, tmp_path)
    _truncate_arrays(c / "6")
    notes = []
    res = _resume(c, notes, steps=9, lr_decay_steps=6)
    said = "\n".join(notes)
    assert "checkpoint step 6" in said and "corrupt or incomplete" in said, said
    assert "falling back to step 3" in said and "resumed step 3" in said, said
    assert res.losses[:3] == straight[3:]           # the same run, from step 3
    assert (c / "6.corrupt").is_dir()              # set aside, never deleted
    assert Checkpointer(str(c), read_only=True).steps() == [3, 6, 9]   # 6 written afresh


def test_array_that_decodes_but_changed_is_named(saved, tmp_path):
    """Step 6's state replaced by step 3's: every file decodes, only the checksums differ."""
    src, _ = saved
    c = _copy(src, tmp_path)
    shutil.rmtree(c / "6" / "state")
    shutil.copytree(c / "3" / "state", c / "6" / "state")
    with pytest.raises(CorruptCheckpoint, match=r"checkpoint step 6 .* corrupt or incomplete "
                                                r"\(array opt_state\.\S+ .*does not match the "
                                                r"checksum saved with it"):
        _resume(c, [], resume_from=6)               # an explicit pick does not fall back
    assert (c / "6").is_dir()

    assert main(["checkpoints", str(c), "--verify"]) == 1


def test_checkpoints_verify_reports_each_step(saved, tmp_path, capsys):
    src, _ = saved
    c = _copy(src, tmp_path)
    assert main(["checkpoints", str(c), "--verify"]) == 0
    assert "every step is intact" in capsys.readouterr().out
    _truncate_arrays(c / "3")
    assert main(["checkpoints", str(c), "--verify"]) == 1
    lines = capsys.readouterr().out.splitlines()
    row3 = next(line for line in lines if line.split()[0] == "3")
    row6 = next(line for line in lines if line.split()[0] == "6")
    assert "DAMAGED: checkpoint step 3" in row3 and row6.endswith("intact")


def test_resume_from_an_older_step_sets_newer_ones_aside(saved, tmp_path):
    src, straight = saved
    c = _copy(src, tmp_path)
    notes = []
    res = _resume(c, notes, resume_from=3)
    assert res.losses == straight[3:]
    assert (c / "6.superseded").is_dir() and "set newer step 6 aside" in "\n".join(notes)


def test_host_arrays_sum_to_the_device_checksums():
    """``verify`` sums the host arrays it reads in numpy (no compile): the same numbers the
    save computed on the devices, for every width (bool, 8, 16, 32 and 64 bits), scalars,
    empty arrays and sums that wrap around 2**32."""
    rng = np.random.default_rng(0)
    host = {"f32": rng.standard_normal((3, 5)).astype(np.float32),
            "bf16": rng.standard_normal(7).astype(ml_dtypes.bfloat16),
            "i8": rng.integers(-128, 127, (4, 4), dtype=np.int8),
            "bool": rng.random(9) > 0.5, "u32": rng.integers(0, 2 ** 32, 100, np.uint32),
            "scalar": np.float32(3.5), "empty": np.zeros((0, 3), np.float32)}
    assert checksums(host) == checksums({k: jnp.asarray(v) for k, v in host.items()})
    with jax.enable_x64(True):
        wide = {"f64": rng.standard_normal((2, 3)), "i64": rng.integers(-2 ** 62, 2 ** 62, 5)}
        assert checksums(wide) == checksums({k: jnp.asarray(v) for k, v in wide.items()})


def test_one_process_saves_compile_no_slice_programs(devices, tmp_path):
    """In one process a replicated array is written whole: Orbax's replica-parallel saving
    would compile a slice program per device and shape (``checkpoint.checkpointer``)."""
    from jax.sharding import NamedSharding, PartitionSpec
    from triax.mesh import make_mesh
    rep = NamedSharding(make_mesh(data=8, devices=devices), PartitionSpec())
    state = {f"w{i}": jax.device_put(np.full((i + 3, 8), i, np.float32), rep)
             for i in range(3)}
    checksums(state)   # the save's checksum program, compiled before counting
    with compiles_during() as compiles, \
            Checkpointer(str(tmp_path / "c"), async_save=False) as ckpt:
        ckpt.save(1, state, {}, wait=True)
        assert ckpt.verify(1) is None
    assert compiles == [], f"{len(compiles)} programs compiled by the save"
