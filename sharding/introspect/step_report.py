"""One report per compiled step: communication, memory and placement, as JSON or tables.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> from triax.training.step import Trainer
    >>> trainer = Trainer(config.TINY, make_mesh(data=2, tensor=4), "fsdp_tp")
    >>> report = inspect_trainer(trainer, batch_size=8, seq_len=32)
    >>> print(report.to_text().splitlines()[0])
    mesh data=2 × tensor=4   strategy fsdp_tp   attention reference
    >>> report.memory.peak_bytes > 0
    True
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from triax.mesh.build import describe
from triax.models.attention import resolve
from triax.sharding.introspect.branch_costs import op_costs
from triax.sharding.introspect.hlo import Collective, collectives_from_compiled, summarize
from triax.sharding.introspect.memory import MemoryReport, memory_from_compiled
from triax.sharding.introspect.placement import ParamPlacement, placement_table
from triax.units import human_bytes


@dataclass(frozen=True)
class StepReport:
    """What ``triax.inspect`` found in one compiled step: placement, collectives, memory."""

    mesh: str
    strategy: str
    collectives: list[Collective]
    memory: MemoryReport
    params: list[ParamPlacement] = field(default_factory=list)
    # Pipelined steps: {op kind: {"flops", "bytes"}} for one execution of that op on stage 0
    # (the tick switch's branch, measured on the compiled HLO); {} for an unpipelined step.
    op_costs: dict[str, dict] = field(default_factory=dict)
    attention: str = ""   # the attention implementation the step runs ("auto" resolved)

    def to_json(self) -> dict:
        """The report as plain JSON values (the CLI's ``--json``)."""
        return {"mesh": self.mesh, "strategy": self.strategy,
                "collectives": [c.to_json() for c in self.collectives],
                "memory": self.memory.to_json(),
                "params": [p.to_json() for p in self.params],
                "op_costs": self.op_costs, "attention": self.attention}

    def dumps(self) -> str:
        """``to_json`` as an indented JSON string."""
        return json.dumps(self.to_json(), indent=2)

    def to_text(self) -> str:
        """The report as the tables ``triax inspect`` prints."""
        head = f"mesh {self.mesh}   strategy {self.strategy}"
        if self.attention:
            head += f"   attention {self.attention}"
        lines = [head, "",
                 "communication per step (per device)",
                 f"  {'kind':<20}{'axes':<18}{'ops':>6}{'bytes/op':>14}{'bytes/step':>14}"]
        unknown = [c for c in self.collectives if not c.frequency_known]
        for c in self.collectives:
            if c.frequency_known:
                lines.append(f"  {c.kind:<20}{','.join(c.axes):<18}{c.count:>6}"
                             f"{human_bytes(c.bytes_per_device):>14}"
                             f"{human_bytes(c.bytes_per_device * c.count):>14}")
        if unknown:
            lines += ["", "  per branch execution (how often the branch runs is not known)"]
        for c in unknown:
            most = "no bound" if c.at_most is None else f"branch runs ≤ {c.at_most}×/step"
            lines.append(f"  {c.kind:<20}{','.join(c.axes):<18}{c.count:>6}"
                         f"{human_bytes(c.bytes_per_device):>14}   per run of {c.branch}; "
                         f"{most}")
        if not self.collectives:
            lines.append("  (none: nothing crosses devices)")
        lines += ["", "  totals by kind and axes"]
        for (kind, axes), s in sorted(summarize(self.collectives).items()):
            lines.append(f"  {kind:<20}{','.join(axes):<18}{s['count']:>6}{'':>14}"
                         f"{human_bytes(s['bytes']):>14}")
        if self.op_costs:
            lines += ["", "cost of one pipeline op on stage 0 (matmul FLOPs, bytes accessed)",
                      f"  {'op':<8}{'GFLOP':>12}{'bytes':>14}"]
            for kind, c in self.op_costs.items():
                lines.append(f"  {kind:<8}{c['flops'] / 1e9:>12.4f}{human_bytes(c['bytes']):>14}"
                             + (f"   at least: loops of unknown trip count counted once "
                                f"({', '.join(c['unknown_loops'])})"
                                if c.get("unknown_loops") else ""))
        m = self.memory
        terms = (("arguments", m.argument_bytes), ("outputs", m.output_bytes),
                 ("temporaries", m.temp_bytes), ("aliased", m.alias_bytes),
                 ("peak", m.peak_bytes))
        lines += ["", "memory per device",
                  "  " + "   ".join(f"{k} {human_bytes(v)}" for k, v in terms)]
        if self.params:
            lines += ["", "placement",
                      f"  {'parameter':<34}{'logical axes':<34}{'spec':<28}{'shard':<20}"
                      f"{'bytes/dev':>10}"]
            for p in self.params:
                spec = "P(" + ", ".join(repr(e) for e in p.spec) + ")"
                lines.append(f"  {p.path:<34}{','.join(str(a) for a in p.logical_axes):<34}"
                             f"{spec:<28}{'x'.join(map(str, p.shard_shape)):<20}"
                             f"{human_bytes(p.bytes_per_device):>10}")
        return "\n".join(lines)


def analyze(compiled, mesh, strategy_name: str = "", params=(),
            branch_kinds: tuple[str, ...] = (), attention: str = "") -> StepReport:
    """Report for any compiled program on ``mesh``. ``branch_kinds``: a pipelined step's
    tick-switch branches in order (``Pipeline.branch_kinds``), to measure each op's cost;
    ``attention``: the attention implementation it runs, when known."""
    costs = op_costs(compiled, branch_kinds) if branch_kinds else {}
    costs.pop("idle", None)
    return StepReport(mesh=describe(mesh), strategy=strategy_name,
                      collectives=collectives_from_compiled(compiled, mesh),
                      memory=memory_from_compiled(compiled), params=list(params),
                      op_costs=costs, attention=attention)


def inspect(trainer, batch, seq_len=None) -> StepReport:
    """Compile ``trainer``'s step on abstract inputs (no allocation) and report placement,
    collectives and memory — for the built-in model or any ``Trainer.for_model`` — and, for
    a pipelined step, what one execution of each op kind costs.

    ``batch``: a batch of arrays or ``ShapeDtypeStruct``s (only shapes and dtypes are used),
    or, for the built-in language model, ``batch_size`` with ``seq_len``.
    """
    compiled = trainer.lower(batch, seq_len).compile()
    rows = placement_table(trainer.abstract, trainer.mesh, trainer.strategy)
    kinds = () if trainer.pipeline is None else trainer.pipeline.branch_kinds
    return analyze(compiled, trainer.mesh, trainer.strategy.name, rows, kinds,
                   resolve(trainer.exe.attention))


def inspect_trainer(trainer, batch_size: int, seq_len: int) -> StepReport:
    """:func:`inspect` for the built-in language model's token batches."""
    return inspect(trainer, batch_size, seq_len)
