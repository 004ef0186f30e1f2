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
