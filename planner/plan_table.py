"""Human-readable plan tables (the ``--json`` form is ``Recommendation.to_json``).

Sizes print in binary units (``triax.units.human_bytes``), as ``triax inspect`` and the
training summary do.
"""
from __future__ import annotations

from typing import Optional

from triax.planner.recommend import Recommendation
from triax.units import human_bytes, human_count

_COLUMNS = ("per dev", "params", "grads", "optim", "acts", "kv")


def text_report(rec: Recommendation, verified: Optional[list] = None,
                notes: tuple[str, ...] = ()) -> str:
    """The plans as one screen: what was planned on what, why, the table, the checks.
    ``notes``: lines the caller adds under the heading (the devices' memory, time model)."""
    w = rec.workload
    lines = [f"triax plan: {w.name} ({'train' if w.train else 'inference'}, {w.dtype}, "
             f"batch {w.batch} × seq {w.seq}) on {rec.cluster.describe()}",
             *notes, f"min devices for weights: {rec.min_devices}",
             f"assumptions: {rec.assumptions.describe()}", "", "Reasoning:"]
    lines += [f"  - {s}" for s in rec.reasoning]
    lines += ["", f"{'#':>2} {'plan':<42} {'remat':<5} {'fits':<4} "
                  + " ".join(f"{c:>10}" for c in _COLUMNS)
                  + f" {'step ms':>9} {'MFU':>5} {'tokens/s':>9}"]
    for i, p in enumerate(rec.plans, 1):
        m = p.memory
        sizes = (m.total, m.params, m.grads, m.optimizer, m.activations, m.kv_cache)
        name = p.layout.describe() + (f", loss/{p.workload.loss_chunks}"
                                      if p.workload.loss_chunks > 1 else "")
        lines.append(f"{i:>2} {name:<42} {p.workload.remat:<5} "
                     f"{'yes' if p.fits else 'NO':<4} "
                     + " ".join(f"{human_bytes(b):>10}" for b in sizes)
                     + f" {p.step_time_s * 1e3:>9,.1f} {p.mfu:>5.0%}"
                     + f" {human_count(p.tokens_per_s):>9}")
        comm = ", ".join(f"{a} {human_bytes(t.wire)} ({p.comm_time_by_axis[a] * 1e3:.2f} ms)"
                         for a, t in p.traffic.items()) or "none"
        lines.append(f"   comm per device per step: {comm}")
        if p.offload is not None:
            c = p.offload
            lines.append(f"   host offload ({','.join(c.targets)}, {c.update}): host "
                         f"{human_bytes(c.host_bytes)} per device; host link "
                         f"{human_bytes(c.link_bytes)} per step ({c.link_s * 1e3:.3g} ms"
                         + (f", host update {c.host_s * 1e3:.3g} ms" if c.host_s else "") + ")")
        if not p.fits:
            lines.append(f"   does not fit: {p.overflow}")
    if verified is not None:
        lines += ["", "Verify (compiled on simulated CPU devices, per device):"]
        for v in verified:
            m = v["memory"]
            lines.append(f"  {v['plan']}: memory predicted {human_bytes(m['predicted'])} vs "
                         f"compiled {human_bytes(m['compiled'])}; state predicted "
                         f"{human_bytes(m['predicted_state'])} vs {human_bytes(m['compiled_state'])}"
                         + (f"; host predicted {human_bytes(m['predicted_host'])} vs compiled "
                            f"{human_bytes(m['compiled_host'])}" if m["predicted_host"] else ""))
            for a, c in v["comm"].items():
                lines.append(f"    {a}: predicted {human_bytes(c['predicted'])} vs HLO "
                             f"{human_bytes(c['compiled'])}")
    return "\n".join(lines)
