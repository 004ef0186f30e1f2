"""Human-readable plan tables (the ``--json`` form is ``Recommendation.to_json``)."""
from __future__ import annotations

from typing import Optional

from triax.planner.decide import Recommendation


def gb(x: float) -> str:
    return f"{x / 1e9:.2f}" if x < 1e10 else f"{x / 1e9:.0f}"


def human_bytes(x: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if x >= k:
            return f"{x / k:.1f} {unit}"
    return f"{x:.0f} B"


def text_report(rec: Recommendation, verified: Optional[list] = None) -> str:
    w = rec.workload
    lines = [f"triax plan: {w.name} ({'train' if w.train else 'inference'}, {w.dtype}, "
             f"batch {w.batch} × seq {w.seq}) on {rec.cluster.describe()}",
             f"min devices for weights: {rec.min_devices}", "", "Reasoning:"]
    lines += [f"  - {s}" for s in rec.reasoning]
    lines += ["", f"{'#':>2} {'plan':<42} {'remat':<5} {'fits':<4} {'GB/dev':>7} "
                  f"{'params':>7} {'grads':>7} {'optim':>7} {'acts':>7} {'kv':>6} "
                  f"{'step ms':>9} {'MFU':>5} {'tok/s':>9}"]
    for i, p in enumerate(rec.plans, 1):
        m = p.memory
        lines.append(f"{i:>2} {p.layout.describe():<42} {p.workload.remat:<5} "
                     f"{'yes' if p.fits else 'NO':<4} {gb(m.total):>7} {gb(m.params):>7} "
                     f"{gb(m.grads):>7} {gb(m.optimizer):>7} {gb(m.activations):>7} "
                     f"{gb(m.kv_cache):>6} {p.step_time_s * 1e3:>9.1f} {p.mfu:>5.0%} "
                     f"{p.tokens_per_s:>9.0f}")
        comm = ", ".join(f"{a} {human_bytes(t.wire)} ({p.comm_time_by_axis[a] * 1e3:.2f} ms)"
                         for a, t in p.traffic.items()) or "none"
        lines.append(f"   comm per device per step: {comm}")
        if not p.fits:
            lines.append(f"   does not fit: {p.overflow}")
    if verified is not None:
        lines += ["", "Verify (compiled on simulated CPU devices, per device):"]
        for v in verified:
            m = v["memory"]
            lines.append(f"  {v['plan']}: memory predicted {human_bytes(m['predicted'])} vs "
                         f"compiled {human_bytes(m['compiled'])}; state predicted "
                         f"{human_bytes(m['predicted_state'])} vs {human_bytes(m['compiled_state'])}")
            for a, c in v["comm"].items():
                lines.append(f"    {a}: predicted {human_bytes(c['predicted'])} vs HLO "
                             f"{human_bytes(c['compiled'])}")
        if not verified:
            lines.append("  (no unpipelined plan among the top ones; pipelined plans are "
                         "verified once triax.pipeline's executor is on main)")
    return "\n".join(lines)
