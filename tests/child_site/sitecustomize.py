"""Imported at start by every Python process of the suite: ``tests/suite_env.py`` puts this
folder first on ``PYTHONPATH`` (and imports it in the test processes), so CLI runs,
multi-process workers and notebook kernels get it too.

Python's cyclic GC runs at a threshold of 50,000 allocations, not 700. At 700, tracing and
lowering set off ~7,000 young and ~30 full collections per few test files, each full one
walking every object JAX, flax and the suite hold (measured with gc.callbacks: 10 of 105
CPU-s). At 50,000 the GC costs ~1 CPU-s and full collections still run, so memory stays
bounded (peak RSS +40 MB).

And as JAX loads, the persistent compilation cache is keyed without the device assignment
(``suite_env.share_programs_across_devices``): a ``triax serve`` child's second and third
replica, or a notebook's, load the first one's programs. JAX itself is not imported here
(a notebook sets its devices before it imports JAX).
"""
import gc
import importlib.abc
import importlib.util
import sys
from pathlib import Path

gc.set_threshold(50_000, 10, 10)


class _KeyWithoutDevices(importlib.abc.MetaPathFinder):
    """Runs ``suite_env.keyed_without_devices`` on ``jax._src.cache_key`` once it has loaded."""

    def find_spec(self, name, path=None, target=None):
        if name != "jax._src.cache_key":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            where = Path(__file__).resolve().parents[1] / "suite_env.py"
            env = importlib.util.spec_from_file_location("_triax_suite_env", where)
            suite_env = importlib.util.module_from_spec(env)
            env.loader.exec_module(suite_env)
            suite_env.keyed_without_devices(module)
        spec.loader.exec_module = exec_module
        return spec


if "jax._src.cache_key" not in sys.modules:
    sys.meta_path.insert(0, _KeyWithoutDevices())
