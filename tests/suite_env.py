"""The environment every test process starts with, written once: ``tests/conftest.py`` and
``notebooks/conftest.py`` apply it before JAX starts, and the processes tests spawn (CLI
runs, multi-process workers, notebook kernels) inherit it through ``os.environ``."""
import os
import sys
from pathlib import Path

# LLVM's optimisation level for the CPU code XLA emits. The suite checks results, HLO,
# collectives, schedules and buffer assignment, all decided before LLVM runs; its programs
# are tiny, so compiling them dominates and -O0 codegen roughly halves it (measured: the
# dp-8 equivalence test 30 s -> 16 s). Benchmarks and users keep XLA's default.
BACKEND_OPT = "--xla_backend_optimization_level=0"
CHILD_SITE = Path(__file__).resolve().parent / "child_site"


# The strict JAX settings of the test processes (tests/conftest.py applies them). The
# matmul precision is part of every compiled dot, so a child process that should compile the
# test process's very programs (persistent-cache hits, not cold compiles) needs them too: as
# the environment variables JAX reads at start (``strict_env``).
STRICT_JAX = {"jax_numpy_rank_promotion": "raise", "jax_default_matmul_precision": "highest",
              "jax_threefry_partitionable": True}


def strict_env(env: dict) -> dict:
    """``env`` (a child process's environment) with ``STRICT_JAX`` as JAX's variables."""
    return {**env, **{name.upper(): str(value) for name, value in STRICT_JAX.items()}}


def apply(devices: bool = True) -> None:
    """Set the suite's environment; ``devices=False`` (notebooks) leaves the device count and
    platform to the code under test, as a reader's kernel would."""
    # child_site/sitecustomize.py (the cyclic GC's threshold) for this process and, through
    # PYTHONPATH, every Python process it starts.
    if str(CHILD_SITE) not in sys.path:
        sys.path.insert(0, str(CHILD_SITE))
        import sitecustomize  # noqa: F401  (Python's own attempt at start found none)
    path = os.environ.get("PYTHONPATH", "")
    if str(CHILD_SITE) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHILD_SITE), path) if p)
    # Bytecode for the sources the processes import: where the environment forbids writing
    # it (PYTHONDONTWRITEBYTECODE), each CLI run, worker and kernel compiles triax's modules
    # from source again (0.15 CPU-s a process, measured on `import triax.cli, ...`).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False
    if devices:
        os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # One persistent compilation cache for the run's workers and the processes they start:
    # many tests, docstrings and notebooks compile the same step.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                          str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax"))
    # The planner's abstract traces and op-cost probe (memo_on_disk), shared the same way.
    os.environ.setdefault("TRIAX_CACHE_DIR",
                          str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "triax"))
    # Cache every compile, however quick: at -O0 most of the suite's compile in under the
    # 1 s default threshold, and the other worker or a spawned process may compile it again.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    flags = os.environ.get("XLA_FLAGS", "")
    for flag in (BACKEND_OPT,):
        if flag.split("=")[0] not in flags:
            flags = f"{flags} {flag}".strip()
    os.environ["XLA_FLAGS"] = flags


def share_programs_across_devices() -> None:
    """Key the persistent compilation cache without the device assignment, as JAX already
    does on GPU (``jax._src.cache_key.get``: ``strip_device_assignment`` is GPU-only). On the
    CPU the same program on other devices (a second serving replica, a step on a sub-mesh
    of other devices) then loads the first one's executable instead of compiling it again;
    the assignment still comes from the compile options at load, so it runs on its own
    devices (``tests/test_suite_env.py`` checks the values and devices of a collective
    program loaded this way). Called by ``tests/conftest.py`` once JAX is imported, and in
    every other process of the suite by ``child_site/sitecustomize.py`` as JAX loads."""
    from jax._src import cache_key
    keyed_without_devices(cache_key)


def keyed_without_devices(cache_key) -> None:
    """``share_programs_across_devices`` on the module ``jax._src.cache_key``."""
    hash_options = cache_key._hash_serialized_compile_options
    if getattr(hash_options, "strips_devices", False):
        return

    def without_devices(hash_obj, compile_options, strip_device_assignment=False):
        return hash_options(hash_obj, compile_options, strip_device_assignment=True)
    without_devices.strips_devices = True
    cache_key._hash_serialized_compile_options = without_devices
