"""Drop gloo's one connection notice from standard output, and nothing else.

On CPU, multi-process collectives go through gloo, whose C++ writes
``[Gloo] Rank r is connected to n peer ranks. Expected number of connected peer ranks is : n``
to file descriptor 1 in every process when it first connects. Nothing configures it off, so
``drop_gloo_notices`` routes descriptor 1 through a pipe whose reader forwards every line
except exactly that one. At exit the pipe is flushed and descriptor 1 restored.
"""
from __future__ import annotations

import atexit
import os
import re
import sys
import threading

NOTICE = re.compile(rb"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
                    rb"Expected number of connected peer ranks is : \d+\r?\n")
_installed = False


def drop_gloo_notices() -> None:
    """Filter descriptor 1 of this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    sys.stdout.flush()
    real, restore = os.dup(1), os.dup(1)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump():
        with os.fdopen(read_end, "rb") as src, os.fdopen(real, "wb", buffering=0) as dst:
            for line in src:
                if not NOTICE.fullmatch(line):
                    dst.write(line)

    thread = threading.Thread(target=pump, name="gloo-notice-filter", daemon=True)
    thread.start()

    @atexit.register
    def _restore():
        sys.stdout.flush()
        os.dup2(restore, 1)          # closes the pipe's last writer: the pump sees the end
        os.close(restore)
        thread.join(timeout=5)
