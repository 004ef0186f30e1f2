"""The decision's sentences about context parallelism: why the best plan splits the
sequence over ``context`` (and by which scheme), or why it does not, from the searched
plans' own figures.

    >>> from triax.models import config
    >>> from triax.costs import hardware
    >>> from triax.planner.evaluate import evaluate
    >>> from triax.planner.search import SearchResult
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("llama3-8b"), train=True, batch=1, seq=262144, remat="full")
    >>> nodes = hardware.cluster("h100-80gb", 8, 4)
    >>> ring, gather = (evaluate(w, Layout(context=8, tensor=4, strategy="tp_sp",
    ...                                    context_attention=s), nodes)
    ...                 for s in ("ring", "all-gather"))
    >>> ring.fits, gather.fits
    (True, False)
    >>> why = context_reasoning(w, SearchResult(fitting=[ring], overflowing=[gather]), ring)
    >>> print(why[0])
    Context parallelism: each 262,144-token sequence is split over context=8, so a device keeps the activations of 32,768 tokens of it (18.3 GB); without it no plan fits.
    >>> why[1].startswith("Scheme ring: the ring passes each layer's K/V blocks on")
    True
"""
from __future__ import annotations

from triax.planner.evaluate import PlanResult
from triax.units import decimal_bytes


def _plan(p: PlanResult) -> str:
    return f"{p.layout.describe()} ({p.workload.run_label})"


def _scheme_sentence(best: PlanResult, plans: list[PlanResult]) -> str:
    lay = best.layout
    what = ("the ring passes each layer's K/V blocks on C−1 times each way, overlapping "
            "the attention they feed, and keeps no T×S scores nor more than two K/V blocks"
            if lay.context_attention == "ring" else
            "all-gather gathers each layer's whole K/V for its attention kernel (one "
            "layer's at a time) and reduce-scatters their gradients, both exposed")
    other = [p for p in plans if p.layout.context_attention != lay.context_attention
             and p.layout.sizes == lay.sizes and p.layout.strategy == lay.strategy
             and p.workload.remat == best.workload.remat
             and p.workload.loss_chunks == best.workload.loss_chunks]
    if not other:
        return f"Scheme {lay.context_attention}: {what}."
    o = other[0]
    alt = (f"{o.step_time_s * 1e3:.1f} ms per step, {decimal_bytes(o.memory.total)} per device"
           if o.fits else f"does not fit: {o.overflow}")
    return (f"Scheme {lay.context_attention}: {what}; {o.layout.context_attention} on the "
            f"same mesh {alt}.")


def context_reasoning(w, res, best: PlanResult) -> list[str]:
    """Sentences for the recommendation (``res``: the ``SearchResult``; ``best``: the ranked
    first plan). Nothing when no context layout was searched."""
    plans = res.fitting + res.overflowing
    cp = [p for p in plans if p.layout.context > 1]
    if not cp:
        return []
    flat = [p for p in res.fitting if p.layout.context == 1]        # fastest first
    if best.layout.context > 1:
        C = best.layout.context
        s = (f"Context parallelism: each {w.seq:,}-token sequence is split over "
             f"context={C}, so a device keeps the activations of {w.seq // C:,} tokens of "
             f"it ({decimal_bytes(best.memory.activations)})")
        if flat:
            alt = flat[0]
            s += (f"; the best plan without it, {_plan(alt)}, takes "
                  f"{alt.step_time_s * 1e3:.1f} ms per step "
                  f"({alt.step_time_s / best.step_time_s - 1:.0%} slower)")
        else:
            over = sorted((p for p in res.overflowing if p.layout.context == 1),
                          key=lambda p: p.memory.total)
            s += "; without it no plan fits"
            if over:
                s += (f" (activations do not fit: the smallest, {_plan(over[0])}, "
                      f"{over[0].overflow})")
        return [s + ".", _scheme_sentence(best, plans)]
    sizes = sorted({p.layout.context for p in cp})
    tried = ", ".join(map(str, sizes))
    fit = [p for p in res.fitting if p.layout.context > 1]
    if fit:
        p = fit[0]
        return [f"Context parallelism (context ∈ {{{tried}}}) was searched; its best plan, "
                f"{_plan(p)}, takes {p.step_time_s * 1e3:.1f} ms per step "
                f"({p.step_time_s / best.step_time_s - 1:.0%} slower than the best)."]
    p = min(cp, key=lambda p: p.memory.total)
    return [f"Context parallelism (context ∈ {{{tried}}}) was searched but no such plan "
            f"fits: the smallest, {_plan(p)}, {p.overflow}."]
