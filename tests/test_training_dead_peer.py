"""A dead peer in a real 2-process run (`triax train` × 2, gloo on 127.0.0.1): SIGKILL one
mid-training; the survivor exits non-zero within the heartbeat timeout naming the lost
process, and restarting both with --resume continues from the last committed step with the
losses of an uninterrupted run: the killed run's own, logged before the kill (the same two
processes and layout; that they equal one process's on 8 devices is
tests/test_training_multiprocess.py's check)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import orbax.checkpoint as ocp
import pytest

from triax.checkpoint import Checkpointer
from triax.training.loop import train
from two_process_run import BASE, free_port

BASE = BASE.replace(steps=100_000, checkpoint_every=3)   # runs until killed
HEARTBEAT_S = 5
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _launch(tmp_path, steps, resume=False):
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    coord = f"127.0.0.1:{free_port()}"
    # BASE as flags
    flags = ["--model", "tiny", "--num-layers", "1", "--data", "markov", "--batch-size", "8",
             "--seq-len", "16", "--mesh", "data=4,tensor=2", "--strategy", "fsdp_tp",
             "--lr", "1e-2", "--lr-warmup-steps", "1", "--lr-decay-steps", "4", "--seed", "5",
             "--eval-batches", "0", "--no-progress", "--checkpoint-every", "3",
             "--steps", str(steps), "--checkpoint-dir", str(tmp_path / "c"),
             "--log-json", str(tmp_path / "log.jsonl")] + (["--resume"] if resume else [])
    return [subprocess.Popen([sys.executable, "-m", "triax", "train", *flags, "--coordinator",
                              coord, "--num-processes", "2", "--process-id", str(i),
                              "--heartbeat-timeout", str(HEARTBEAT_S)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for i in range(2)]


def _committed(tmp_path):
    """Steps whose save has committed on disk (a save in flight is not one of them)."""
    d = tmp_path / "c"
    return ocp.utils.checkpoint_steps(str(d)) if d.is_dir() else []


def _logged(tmp_path):
    p = tmp_path / "log.jsonl"
    return [json.loads(line) for line in p.read_text().splitlines()] if p.exists() else []


@pytest.mark.slow
def test_dead_peer_stops_the_survivor_and_resume_matches(tmp_path):
    procs = _launch(tmp_path, BASE.loop.steps)
    deadline = time.time() + 600
    # Past step 6 and its save committed: the save is async, and one in flight when the peer
    # dies never commits, so waiting on the log alone makes the resume step a race. And two
    # steps past the last commit logged: the uninterrupted losses the resume must reproduce.
    while (max(_committed(tmp_path), default=0) < 6
           or len(_logged(tmp_path)) < max(_committed(tmp_path)) + 2):
        assert all(p.poll() is None for p in procs), procs[0].communicate()[1][-3000:]
        assert time.time() < deadline, "the 2-process run never committed step 6"
        time.sleep(0.2)
    procs[1].send_signal(signal.SIGKILL)
    killed = time.time()
    _, err = procs[0].communicate(timeout=HEARTBEAT_S + 90)
    waited = time.time() - killed
    procs[1].wait()
    before = _logged(tmp_path)                    # the run up to the kill, step by step
    assert procs[0].returncode != 0
    assert waited < HEARTBEAT_S + 60, f"the survivor took {waited:.0f}s to notice"
    # JAX names the lost task in one of two words, depending on which check fires first.
    assert ("unhealthy (stopped sending heartbeats):\n1" in err
            or "Task 1 heartbeat timeout" in err), err[-3000:]

    last = Checkpointer(str(tmp_path / "c"), read_only=True).steps()[-1]
    assert last >= 6
    procs = _launch(tmp_path, last + 2, resume=True)
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, e) in zip(procs, outs):
        assert p.returncode == 0, e[-3000:]
    assert f"resumed step {last}" in outs[0][1]
    resumed = _logged(tmp_path)[len(before):]
    assert [r["step"] for r in resumed] == [last + 1, last + 2], resumed
    uninterrupted = {r["step"]: r["loss"] for r in before}
    if last + 2 not in uninterrupted:
        # A save committed in the instant between the wait and the kill, past the steps logged
        # then (rare): the uninterrupted losses from one process, as the run's config gives.
        uninterrupted = dict(enumerate(train(BASE.replace(steps=last + 2, checkpoint_every=0),
                                             note=lambda *_: None).losses, start=1))
    np.testing.assert_allclose([r["loss"] for r in resumed],
                               [uninterrupted[last + 1], uninterrupted[last + 2]], rtol=1e-5)
