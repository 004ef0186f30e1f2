"""A full disk during a save, on a real filesystem that fills up (a small tmpfs mounted by the
test, as root): the run stops with a clear message, the previous checkpoint stays intact and
the half-written step is never resumed from. A read-only --checkpoint-dir fails at start-up,
before the step compiles."""
import json
import os
import shutil
import subprocess

import pytest
import tiny_runs
from compile_counter import compiles_during

from triax.checkpoint import CheckpointError, Checkpointer
from triax.cli.main import main
from triax.training.config import RunConfig
from triax.training.faults import SaveFailed
from triax.training.loop import train

BASE = RunConfig.of(**tiny_runs.DP, steps=52, seed=7, progress=False, checkpoint_every=50)
QUIET = dict(note=lambda *_: None)


def _mount_tmpfs(where, *options):
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (this fault needs a filesystem that "
                    "really fills up)")
    os.makedirs(where, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs", str(where)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()}): no CAP_SYS_ADMIN")


@pytest.fixture
def mounts():
    done = []
    yield lambda where, *opts: (_mount_tmpfs(where, *opts), done.append(where))
    for where in done:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_stops_the_run_and_keeps_the_last_checkpoint(tmp_path, mounts):
    train(BASE.replace(steps=1, checkpoint_dir=str(tmp_path / "probe")), **QUIET)
    step_bytes = Checkpointer(str(tmp_path / "probe"), read_only=True).step_size_bytes(1)
    # Room for one step and a half: the save of step 50 fits, the one of step 100 does not.
    mounts(tmp_path / "disk", f"size={int(step_bytes * 1.5) // 4096 * 4096}")
    ckdir, log = tmp_path / "disk" / "c", tmp_path / "log.jsonl"
    with pytest.raises(SaveFailed, match=r"saving checkpoint step 100 to .* failed: No space "
                                         r"left on device \(.*\); training stopped rather than "
                                         r"run on without checkpoints\. The last committed "
                                         r"step 50 is intact") as e:
        train(BASE.replace(steps=1000, checkpoint_dir=str(ckdir), log_json=str(log)), **QUIET)
    assert "--resume" in str(e.value)
    # The background save's failure stopped the run within a few steps (each step checks),
    # not at the next save 50 steps later (hours, in a real run).
    last_step = json.loads(log.read_text().splitlines()[-1])["step"]
    assert 100 <= last_step < 150, last_step
    assert Checkpointer(str(ckdir), read_only=True).steps() == [50]
    # Resume where the disk has room again (a copy, with the half-written step in it).
    shutil.copytree(ckdir, tmp_path / "moved")
    assert [n for n in os.listdir(tmp_path / "moved") if "tmp" in n], "expected a partial save"
    notes = []
    res = train(BASE.replace(checkpoint_dir=str(tmp_path / "moved"), resume=True),
                note=notes.append)
    assert "resumed step 50" in "\n".join(notes) and len(res.losses) == 2


def test_read_only_checkpoint_dir_fails_at_start_up(tmp_path, mounts, capsys):
    mounts(tmp_path / "ro", "ro", "size=1m")
    with compiles_during() as compiles:
        with pytest.raises(CheckpointError, match=r"--checkpoint-dir .* is not writable "
                                                  r"\(Read-only file system\)"):
            train(BASE.replace(checkpoint_dir=str(tmp_path / "ro" / "c")), **QUIET)
        assert main(["train", "--checkpoint-dir", str(tmp_path / "ro"), "--steps", "2",
                     "--no-progress"]) == 2
    assert compiles == [], "the directory is checked before the step compiles"
    assert "is not writable (Read-only file system)" in capsys.readouterr().err
