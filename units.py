"""How triax prints sizes: the one byte formatter every report, summary and bench uses.

    >>> human_bytes(3 * 2**20)
    '3.0 MiB'
    >>> human_bytes(512)
    '512 B'
"""
from __future__ import annotations


def human_bytes(n: float) -> str:
    """Binary units (KiB, MiB, …): the unit ``memory_analysis`` and device memory use."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def mib(n: float) -> float:
    """Bytes as MiB, for tables that share one unit per column."""
    return n / 2**20
