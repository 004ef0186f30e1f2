"""Sharded HF load on 2 processes × 4 simulated CPU devices: each process reads only its own
half of the weights (bytes counted by the reader), with ``data`` (FSDP) or ``pipe`` (the
layers) across the processes, and the forward still equals the logits ``transformers``
computed."""
import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np

from hf_fixtures import fixture
from triax.hf import read_model_config
from triax.hf.files import Checkpoint
from triax.hf.load import expected_tensors

WORKER = textwrap.dedent("""
    import json, sys
    from triax.training import distributed
    coordinator, pid, model_dir, tests = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    distributed.initialize(coordinator, 2, pid)
    import jax
    import numpy as np
    sys.path.insert(0, tests)
    jax.config.update("jax_default_matmul_precision", "highest")
    from hf_fixtures import forward_logits, golden, prompts
    from triax.hf import load
    from triax.mesh import make_mesh
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    mesh = make_mesh(data=2, tensor=4)   # data spans the processes; fsdp splits embed over it
    cfg, params, report = load(model_dir, mesh, "fsdp_tp")
    g = golden("llama")
    rows = prompts(g)[:2]
    err = max(float(np.abs(l - g[f"logits_{i}"]).max())
              for i, l in enumerate(forward_logits(cfg, params, mesh, "fsdp_tp", rows)))
    # pipe spanning the processes: each reads only its own stage's layers
    _, _, by_stage = load(model_dir, make_mesh(pipe=2, tensor=4), "tp")
    print("RESULT " + json.dumps({"bytes": report.bytes_read, "err": err,
                                  "pipe_bytes": by_stage.bytes_read}), flush=True)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_each_read_half(tmp_path):
    tests = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(tests))
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    coord = f"127.0.0.1:{_free_port()}"
    d = fixture("llama")
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, coord, str(i), d, tests], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=400) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    results = [json.loads(line[7:]) for out, _ in outs for line in out.splitlines()
               if line.startswith("RESULT ")]
    assert len(results) == 2
    # Every tensor but the RMSNorm scales has an `embed` dimension, which fsdp splits over
    # data (= the two processes); the scales are replicated, so both processes read them.
    headers = Checkpoint(d).headers
    nbytes = {n: int(np.prod(headers[n][0])) * 4 for n in expected_tensors(
        read_model_config(d))}
    scales = sum(b for n, b in nbytes.items() if n.endswith("norm.weight"))
    split = sum(nbytes.values()) - scales
    unstacked = sum(b for n, b in nbytes.items() if not n.startswith("model.layers."))
    stacked = sum(nbytes.values()) - unstacked
    for r in results:
        assert r["err"] < 1e-5, r
        assert r["bytes"] == split // 2 + scales, (r, split, scales)
        assert r["bytes"] < 0.52 * sum(nbytes.values())
        assert r["pipe_bytes"] == stacked // 2 + unstacked, (r, stacked, unstacked)
