"""A memo on disk for the planner's abstract traces, shared by every process that plans.

The planner prices a pipelined layout from traced shapes (``pipeline.buffer_sizes``) and
weighs schedules by op costs read from a compiled probe step (``planner.op_costs``) and by
their tables (ZB-V's greedy orders: ``pipeline.generators``). Each is a pure function of its
arguments and of the code, costs about a second, and is asked again
by every process that plans the same model: the suite's two workers, its notebook kernels,
a CLI run. ``on_disk`` keeps the results in ``$TRIAX_CACHE_DIR`` (unset: memory only, as
before), keyed by the function, the ``repr`` of its arguments (frozen dataclasses, enums,
numbers: stable across processes) and a fingerprint of the code that could change the
answer: triax's own source files and the jax/jaxlib versions. A changed line anywhere in
triax, or another JAX, misses the old entries; nothing is ever read that this code would not
compute. So only what depends on nothing else may be memoised: not on the process's devices
or environment (``planner.op_costs`` checks its devices outside the memo).

    >>> import os, tempfile
    >>> previous = os.environ.get(ENV)
    >>> os.environ[ENV] = tempfile.mkdtemp()
    >>> calls = []
    >>> @on_disk
    ... def square(n):
    ...     calls.append(n)
    ...     return n * n
    >>> square(3), square(3), calls       # the second call reads the first's answer back
    (9, 9, [3])
    >>> del os.environ[ENV]
    >>> if previous: os.environ[ENV] = previous
"""
from __future__ import annotations

import functools
import hashlib
import os
import pickle
import tempfile
from pathlib import Path

ENV = "TRIAX_CACHE_DIR"
_ROOT = Path(__file__).resolve().parent
_NOT_CODE = ("tests", "notebooks")     # change often and decide no memoised answer


@functools.lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """Hash of triax's source and the jax/jaxlib versions: what a memoised answer depends on."""
    import jax
    import jaxlib
    h = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    dirs = [d for d in _ROOT.iterdir()
            if (d / "__init__.py").exists() and d.name not in _NOT_CODE]
    files = sorted(p for d in dirs for p in d.rglob("*.py")) + sorted(_ROOT.glob("*.py"))
    for p in files:
        h.update(str(p.relative_to(_ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:20]


def _path(fn, args, kwargs) -> Path | None:
    root = os.environ.get(ENV)
    key = repr((args, sorted(kwargs.items())))
    if not root or " at 0x" in key:      # an argument without a stable repr: memory only
        return None
    digest = hashlib.sha256(f"{code_fingerprint()} {key}".encode()).hexdigest()[:32]
    return Path(root) / f"{fn.__module__}.{fn.__qualname__}" / f"{digest}.pkl"


def on_disk(fn):
    """Memoise ``fn`` (pure, picklable result) in ``$TRIAX_CACHE_DIR``. A missing, partly
    written or unreadable entry is computed again; entries are written whole (a temporary file
    renamed into place), so concurrent processes at worst compute the same answer twice."""
    @functools.wraps(fn)
    def memoised(*args, **kwargs):
        path = _path(fn, args, kwargs)
        if path is not None and path.exists():
            try:
                return pickle.loads(path.read_bytes())
            except Exception:       # truncated or from an incompatible pickle: recompute
                pass
        out = fn(*args, **kwargs)
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
                pickle.dump(out, f)
            os.replace(f.name, path)
        return out
    return memoised
