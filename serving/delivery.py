"""Generated tokens from the serving thread to the event loop, one wakeup per engine phase.

``Server`` calls each request's ``on_token`` from its serving thread, a token at a time. A
``call_soon_threadsafe`` per token costs the loop a wakeup (a self-pipe write, an ``epoll``
return, a callback) for every token of every row. A ``Mailbox`` instead buffers what the
serving thread posts and hands it to the loop in one callback when the server ends a
prefill or decode phase (``Server.phase_listeners``): one wakeup per phase for all rows.
An end of a request (its future's done-callback, which may run on any thread: a cancel, a
failure) is posted and flushed at once, after the tokens posted before it, so a run never
hears its end before its last tokens.

    >>> import asyncio
    >>> async def demo():
    ...     box, got = Mailbox(), []
    ...     loop = asyncio.get_running_loop()
    ...     for t in (1, 2, 3):
    ...         box.post(loop, got.append, t)   # buffered: no wakeup yet
    ...     box.flush()                         # the phase ends: one wakeup
    ...     await asyncio.sleep(0)
    ...     return got, box.wakeups
    >>> asyncio.run(demo())
    ([1, 2, 3], 1)
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable


class Mailbox:
    """Items for event loops, buffered until ``flush``: then one ``call_soon_threadsafe``
    per loop delivers them in posting order. Thread-safe; ``wakeups`` counts the callbacks
    scheduled (what tests read)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: list[tuple[asyncio.AbstractEventLoop, Callable[[Any], None], Any]] = []
        self.wakeups = 0

    def post(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None],
             item: Any) -> None:
        """Buffer ``deliver(item)`` to run on ``loop`` at the next ``flush``."""
        with self._lock:
            self._items.append((loop, deliver, item))

    def post_now(self, loop: asyncio.AbstractEventLoop, deliver: Callable[[Any], None],
                 item: Any) -> None:
        """Post and flush: for what no phase end may follow (a request's end)."""
        self.post(loop, deliver, item)
        self.flush()

    def flush(self) -> None:
        """Hand everything posted so far to its loop(s): one callback per loop."""
        with self._lock:
            if not self._items:
                return
            items, self._items = self._items, []
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for loop, deliver, item in items:
            by_loop.setdefault(loop, []).append((deliver, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, batch)
                self.wakeups += 1
            except RuntimeError:   # that loop is closed: nobody listens any more
                pass


def _deliver(batch: list[tuple[Callable[[Any], None], Any]]) -> None:
    for deliver, item in batch:
        deliver(item)
