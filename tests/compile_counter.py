"""The XLA programs a block of code compiles, read off JAX's monitoring events: for tests that
assert a path compiles nothing new (serving after its warm-up, a checkpoint's save)."""
from contextlib import contextmanager

import jax


@contextmanager
def compiles_during():
    """Yield a list that gets one entry per backend compile started inside the block."""
    compiles = []

    def listen(event, secs, **_):
        if "backend_compile" in event:
            compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
