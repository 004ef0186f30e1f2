"""A user who did nothing wrong sees only triax's own lines: no library notices on stderr
(Orbax's read-only warnings, errors at exit) and no gloo notices in multi-process runs.

The commands run as a user runs them, in fresh processes, on 2 simulated CPU devices with a
one-layer model for two steps.
"""
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The one line of triax's that is not prefixed: its progress bar (tqdm, redrawn with \r).
PROGRESS = re.compile(r"\s*\d+%\|")


def _env(devices: int) -> dict:
    return dict(os.environ, JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES=str(devices),
                PYTHONPATH=str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))


def _triax(*args, cwd) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "triax", *args], cwd=cwd, env=_env(2),
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _foreign(stderr: str) -> list[str]:
    lines = [seg for line in stderr.splitlines() for seg in line.split("\r") if seg.strip()]
    return [s for s in lines if not (s.startswith("triax") or PROGRESS.match(s))]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("run")
    done = _triax("train", "--model", "tiny", "--num-layers", "1", "--data", "markov",
                  "--mesh", "data=2", "--strategy", "dp", "--steps", "2", "--batch-size", "4",
                  "--seq-len", "16", "--eval-batches", "0", "--checkpoint-dir", "ck",
                  "--checkpoint-every", "2", cwd=cwd)
    return cwd, done


def test_train_stderr_holds_only_triax_lines(trained):
    _, done = trained
    assert "triax train:" in done.stderr              # the check sees triax's own lines
    assert not _foreign(done.stderr), done.stderr


def test_generate_from_checkpoint_stderr_holds_only_triax_lines(trained):
    cwd, _ = trained
    done = _triax("generate", "--checkpoint", "ck", "--prompt", "ab", "--max-new-tokens", "2",
                  "--mesh", "data=2", "--slots", "2", cwd=cwd)   # a row per shard: 2 programs
    assert "ab" in done.stdout
    assert not _foreign(done.stderr), done.stderr
    # It says what it does as it goes: the load, then each program compiled, with times.
    assert re.search(r"^triax generate: loading ck: done in [\d.]+ s$",
                     done.stderr, re.M), done.stderr
    assert re.search(r"^triax generate: replica 1/1: compiled decode \d+ rows \((\d+)/\1\) "
                     r"in [\d.]+ s$", done.stderr, re.M), done.stderr


def test_serve_fails_fast_on_a_busy_port(tmp_path):
    """The port is bound before anything is built: a busy one is refused at once, naming
    it, with no weights loaded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "triax", "serve", "--model", "tiny",
                               "--port", str(port)], cwd=tmp_path, env=_env(2),
                              capture_output=True, text=True, timeout=600)
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"--port {port}: cannot listen there" in done.stderr
    assert "loading" not in done.stderr, done.stderr


WORKER = textwrap.dedent("""
    import sys
    from triax.training import distributed
    distributed.initialize(sys.argv[1], 2, int(sys.argv[2]))
    import jax, jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Explicit,))
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P("data")), jnp.ones((1,)))
    print("sum", float(jax.jit(jnp.sum)(x)))
""")


def test_two_processes_print_only_their_own_lines(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        coordinator = f"127.0.0.1:{s.getsockname()[1]}"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, coordinator, str(i)], cwd=tmp_path,
                              env=_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out == "sum 2.0\n", out                 # gloo's "[Gloo] Rank r is connected"
        assert not err, err
