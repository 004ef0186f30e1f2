"""Two local processes × 4 simulated CPU devices (gloo on 127.0.0.1): training plus a save and
restore gives the losses of the single-process run on 8 devices."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np

from triax.training.loop import train
from two_process_run import BASE, free_port

WORKER = textwrap.dedent("""
    import json, sys
    from triax.training import distributed
    coordinator, pid, ckdir, base = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    distributed.initialize(coordinator, 2, pid)
    import jax
    from triax.training.config import RunConfig
    from triax.training.loop import train
    base = RunConfig.from_json(json.loads(base))
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    first = train(base.replace(steps=2, checkpoint_dir=ckdir), note=lambda *_: None)
    rest = train(base.replace(checkpoint_dir=ckdir, resume=True), note=lambda *_: None)
    print("LOSSES " + json.dumps(first.losses + rest.losses), flush=True)
""")


def test_two_processes_match_single_process(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    coord = f"127.0.0.1:{free_port()}"
    base = json.dumps(BASE.to_json())
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, coord, str(i), str(tmp_path / "c"),
                               base], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    reference = train(BASE, note=lambda *_: None).losses  # overlaps the workers' start-up
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    losses = [json.loads(line[7:]) for out, _ in outs for line in out.splitlines()
              if line.startswith("LOSSES ")]
    assert len(losses) == 2 and losses[0] == losses[1]
    np.testing.assert_allclose(losses[0], reference, rtol=1e-5)
    assert sorted(os.listdir(tmp_path / "c")) == ["2", "4"]
