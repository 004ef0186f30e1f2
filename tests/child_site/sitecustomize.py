"""Imported at start by every Python process of the suite: ``tests/suite_env.py`` puts this
folder first on ``PYTHONPATH`` (and imports it in the test processes), so CLI runs,
multi-process workers and notebook kernels get it too.

Python's cyclic GC runs at a threshold of 50,000 allocations, not 700. At 700, tracing and
lowering set off ~7,000 young and ~30 full collections per few test files, each full one
walking every object JAX, flax and the suite hold (measured with gc.callbacks: 10 of 105
CPU-s). At 50,000 the GC costs ~1 CPU-s and full collections still run, so memory stays
bounded (peak RSS +40 MB).
"""
import gc

gc.set_threshold(50_000, 10, 10)
