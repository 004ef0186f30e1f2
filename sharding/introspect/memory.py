"""Per-device memory of a compiled step, from XLA's own ``memory_analysis()``."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class MemoryReport:
    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int      # outputs that reuse (donated) argument buffers
    code_bytes: int

    @property
    def peak_bytes(self) -> int:
        """Live at once: arguments + temporaries + outputs not aliased onto arguments."""
        return self.argument_bytes + self.temp_bytes + self.output_bytes - self.alias_bytes

    def to_json(self) -> dict:
        return {**asdict(self), "peak_bytes": self.peak_bytes}


def memory_from_compiled(compiled) -> MemoryReport:
    """Per-device memory of a ``jax.stages.Compiled`` (an SPMD program is per device)."""
    m = compiled.memory_analysis()
    if m is None:
        raise ValueError("this backend gives no memory_analysis() for the compiled program")
    return MemoryReport(argument_bytes=int(m.argument_size_in_bytes),
                        output_bytes=int(m.output_size_in_bytes),
                        temp_bytes=int(m.temp_size_in_bytes),
                        alias_bytes=int(m.alias_size_in_bytes),
                        code_bytes=int(getattr(m, "generated_code_size_in_bytes", 0)))
