"""The suite's environment (tests/suite_env.py) reaches the processes the tests start."""
import gc
import os
import subprocess
import sys


def test_child_processes_get_the_gc_threshold():
    """CLI runs, multi-process workers and notebook kernels import child_site/sitecustomize.py
    through PYTHONPATH, as the test process does (measured in notebook 05's kernel: 4.0 CPU-s
    in the collector at the default threshold, 0.8 at this one)."""
    out = subprocess.run([sys.executable, "-c", "import gc; print(gc.get_threshold())"],
                         env=dict(os.environ), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(gc.get_threshold()) == "(50000, 10, 10)"


def test_child_processes_write_bytecode():
    """Each process the suite starts reads the bytecode the first one wrote, whatever
    PYTHONDONTWRITEBYTECODE the suite was started with (suite_env.apply drops it)."""
    out = subprocess.run([sys.executable, "-c", "import sys; print(sys.dont_write_bytecode)"],
                         env=dict(os.environ), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False" and not sys.dont_write_bytecode


def test_a_program_on_other_devices_loads_the_first_ones_executable(tmp_path):
    """suite_env.share_programs_across_devices: a second replica's program is a persistent-
    cache hit, and it runs on its own devices with its own values (a collective program).
    The child process gets it as every process of the suite does, from
    child_site/sitecustomize.py as JAX loads (the test processes also call it: conftest)."""
    script = r'''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P
hits = []
jax.monitoring.register_event_listener(lambda e, **k: hits.append(e) if "cache_hits" in e else None)
for devs in (jax.devices()[0:2], jax.devices()[2:4], jax.devices()[5:7]):
    mesh = Mesh(np.array(devs), ("t",), axis_types=(AxisType.Auto,))
    x_np = np.arange(8.0).reshape(2, 4) + devs[0].id
    x = jax.device_put(x_np, NamedSharding(mesh, P("t")))
    y = jax.jit(lambda x: x @ x.T + x.sum(), out_shardings=NamedSharding(mesh, P()))(x)
    assert {d.id for d in y.devices()} == {d.id for d in devs}, y.devices()
    np.testing.assert_array_equal(np.asarray(y), x_np @ x_np.T + x_np.sum())
print(len(hits))
'''
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(tmp_path), JAX_NUM_CPU_DEVICES="8",
               JAX_PLATFORMS="cpu", JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "2", "the programs on devices 2-3 and 5-6 compiled again"
