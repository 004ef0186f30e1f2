"""How triax prints sizes: one binary formatter (``human_bytes``: reports, summaries,
benches, what ``memory_analysis`` measures) and one decimal (``decimal_bytes``: the planner,
whose devices' memory is sold in GB).

    >>> human_bytes(3 * 2**20)
    '3.0 MiB'
    >>> human_bytes(512)
    '512 B'
    >>> decimal_bytes(81e9, ".0f"), decimal_bytes(1.26e9), decimal_bytes(160.4e9, None)
    ('81 GB', '1.3 GB', '160 GB')
    >>> parse_bytes("5GB"), parse_bytes("2MiB"), parse_bytes("1000")
    (5000000000, 2097152, 1000)
    >>> human_count(481725137), human_count(5367), human_count(12)
    ('482M', '5.37k', '12')
"""
from __future__ import annotations

from typing import Optional


def human_bytes(n: float) -> str:
    """Binary units (KiB, MiB, …): the unit ``memory_analysis`` and device memory use."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_count(n: float) -> str:
    """A count or rate in three significant figures with a decimal prefix (k, M, G, T)."""
    for unit in ("", "k", "M", "G"):
        if abs(n) < 999.5:
            return f"{n:.3g}{unit}"
        n /= 1000
    return f"{n:.3g}T"


GB = 1e9   # a decimal gigabyte, the conservative reading of a device's "80 GB"


def decimal_bytes(n: float, spec: Optional[str] = ".1f") -> str:
    """Decimal gigabytes, the number formatted by ``spec`` (None: three significant
    figures, whole gigabytes from 10 GB)."""
    if spec is None:
        spec = ",.0f" if n >= 10 * GB else ".3g"
    return f"{n / GB:{spec}} GB"


def mib(n: float) -> float:
    """Bytes as MiB, for tables that share one unit per column."""
    return n / 2**20


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """``"5GB"`` (decimal, as Hugging Face's ``max_shard_size``) or ``"5GiB"`` (binary)."""
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    try:
        return int(float(num) * _UNITS[s[len(num):]])
    except (KeyError, ValueError):
        raise ValueError(f"size {text!r}: give a number with an optional unit (B, KB, MB, "
                         f"GB, TB, or KiB, MiB, GiB, TiB), e.g. 5GB") from None


def device_memory_bytes(text: Optional[str]) -> Optional[int]:
    """``--device-memory`` in bytes (None: not given), refused naming the flag; the one check
    ``train`` (``RunConfig``) and ``serve`` (``ServeConfig``) share."""
    if text is None:
        return None
    try:
        n = parse_bytes(text)
    except ValueError as e:
        raise ValueError(f"--device-memory: {e}") from None
    if n <= 0:
        raise ValueError(f"--device-memory {text}: must be > 0, e.g. --device-memory 40GiB")
    return n
