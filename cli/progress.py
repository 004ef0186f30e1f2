"""What a long-running command is doing, said as it goes: one ``triax CMD: ...`` line on
stderr per step, with the seconds it took (stdout stays the command's result, e.g. ``--json``).

    >>> say = Progress("serve", stream=sys.stdout, clock=iter([0.0, 1.5]).__next__)
    >>> with say("loading weights"):
    ...     pass
    triax serve: loading weights ...
    triax serve: loading weights: done in 1.5 s
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Optional, TextIO


class Progress:
    """Says each step of ``triax <command>`` as it starts and when it is done."""

    def __init__(self, command: str, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.prefix, self.stream, self.clock = f"triax {command}: ", stream, clock

    def line(self, text: str) -> None:
        """One line now (stderr unless a stream was given)."""
        print(self.prefix + text, file=self.stream or sys.stderr, flush=True)

    @contextmanager
    def __call__(self, what: str):
        """``with say("compiling"):`` prints ``what ...`` now and ``what: done in T s`` after."""
        self.line(f"{what} ...")
        t0 = self.clock()
        yield
        self.line(f"{what}: done in {self.clock() - t0:.1f} s")
