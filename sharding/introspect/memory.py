"""Per-device memory of a compiled step, from XLA's own ``memory_analysis()``.

Arguments in the host's memory (``pinned_host``: ``training.offload``) are read off the
compiled program's entry layout, where XLA marks them with memory space ``S(5)``; the CPU
backend counts them in ``argument_size_in_bytes`` with the rest (its
``host_argument_size_in_bytes`` stays 0), so ``argument_bytes`` here is the device's share:
the total less the host's.

    >>> host_argument_bytes("HloModule m, entry_computation_layout={(f32[8,128]{1,0}, "
    ...                     "f32[8,128]{1,0:S(5)})->f32[8,128]{1,0}}")
    4096
"""
from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

import jax

from triax.sharding.introspect.hlo_text import DTYPE_BYTES

HOST_MEMORY_SPACE = "S(5)"   # XLA's memory space of host (pinned) buffers
# the parameters' layouts, then the rest of the line: the results' (no other attribute there
# has an array shape with a layout)
_ENTRY_LAYOUT = re.compile(r"entry_computation_layout=\{\((.*?)\)->(.*)$", re.M)
_ARG = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]\{([^}]*)\}")


@dataclass(frozen=True)
class MemoryReport:
    argument_bytes: int   # on the device (host-memory arguments not included)
    output_bytes: int
    temp_bytes: int
    alias_bytes: int      # outputs that reuse (donated) argument buffers
    code_bytes: int
    host_argument_bytes: int = 0   # arguments in the host's memory (offloaded state)

    @property
    def peak_bytes(self) -> int:
        """Live at once: arguments + temporaries + outputs not aliased onto arguments."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


def host_argument_bytes(hlo_text: str, outputs: bool = False) -> int:
    """Per-device bytes of the entry computation's parameters (``outputs``: its results)
    in host memory (``S(5)``)."""
    m = _ENTRY_LAYOUT.search(hlo_text)
    if m is None:
        return 0
    return sum(math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES[dt]
               for dt, dims, layout in _ARG.findall(m.group(2 if outputs else 1))
               if HOST_MEMORY_SPACE in layout)


def _has_host_buffers(compiled) -> bool:
    """Whether any argument or result of ``compiled`` is laid out in a host memory kind
    (only then is its HLO text read: printing a large program is not free)."""
    try:
        shardings = jax.tree.leaves((compiled.input_shardings, compiled.output_shardings))
    except (AttributeError, NotImplementedError):   # not a jax.stages.Compiled: read it
        return True
    return any(getattr(s, "memory_kind", None) not in (None, "device") for s in shardings)


def memory_from_compiled(compiled) -> MemoryReport:
    """Per-device memory of a ``jax.stages.Compiled`` (an SPMD program is per device)."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend gives no memory_analysis() for the compiled program")
    host = int(getattr(m, "host_argument_size_in_bytes", 0))
    args, out, alias = (int(m.argument_size_in_bytes), int(m.output_size_in_bytes),
                        int(m.alias_size_in_bytes))
    if host == 0 and int(getattr(m, "host_output_size_in_bytes", 0)) == 0 \
            and _has_host_buffers(compiled):
        # The backend counts host buffers with the device's (CPU): split them off. The host
        # results are the donated state written back, aliased onto its host arguments.
        text = compiled.as_text()
        host, host_out = host_argument_bytes(text), host_argument_bytes(text, outputs=True)
        args, out, alias = args - host, out - host_out, alias - min(alias, host_out)
    return MemoryReport(argument_bytes=args, output_bytes=out,
                        temp_bytes=int(m.temp_size_in_bytes), alias_bytes=alias,
                        code_bytes=int(getattr(m, "generated_code_size_in_bytes", 0)),
                        host_argument_bytes=host)
