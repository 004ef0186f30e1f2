"""The planner's search works out what its candidates share once: each op's dependencies per
schedule family (``pipeline.schedules._dep_keys``), each parameter leaf's local size per
(rules, mesh) (``costs.param_layout.LeafElements``). Pure Python: no compile."""
from triax.costs import hardware, param_layout
from triax.costs.workload import Workload
from triax.models import config
from triax.pipeline import generators, schedules
from triax.planner.search import search


def _counting(monkeypatch, module, name):
    """Patch ``module.name`` with a wrapper counting its calls; returns the count list."""
    calls, real = [], getattr(module, name)

    def counted(*args):
        calls.append(args)
        return real(*args)
    monkeypatch.setattr(module, name, counted)
    return calls


def test_each_ops_dependencies_are_worked_out_once(monkeypatch):
    """Placing, validating and pricing a 1F1B table asks each op's dependencies once (they
    were asked per op per tick it waited, and again by the validator and the cost model)."""
    generators._build.cache_clear()
    schedules._dep_keys.cache_clear()
    calls = _counting(monkeypatch, schedules, "prerequisites")
    S, M = 4, 8
    sched = generators.build("1f1b", stages=S, microbatches=M)
    bubble = sched.bubble_fraction()
    assert sched.bubble_fraction() == bubble
    ops = {op for row in sched.table for op in row if op is not None}
    assert len(ops) == 2 * S * M                  # F and B of each (micro-batch, chunk)
    assert len(calls) == len(ops), (len(calls), len(ops))
    assert len(set(calls)) == len(calls)


def test_candidates_share_their_leaf_sizes(monkeypatch):
    """A training search (one-layer tiny: no pipeline stage keeps a layer, so nothing is
    traced) resolves each parameter leaf's local size about once per (rules, mesh), not once
    per candidate and term: what repeats is a leaf read both as the model has it and as a
    stack is stored, or through ``local_elements``. Without the sharing a search resolves each
    (leaf, rules, mesh) about 14 times over (11,540 resolutions of 834, against 1,076)."""
    w = Workload.of(config.get("tiny", num_layers=1), train=True, batch=8, seq=64)
    cluster = hardware.cluster("h100-80gb", 8, 2)
    search(w, cluster)                                # param_leaves: warm
    for f in (param_layout._leaf_elements, param_layout._param_sum,
              param_layout._block_elements):
        f.cache_clear()
    calls = _counting(monkeypatch, param_layout, "_local_elements")
    res = search(w, cluster)
    assert len(res.fitting) + len(res.overflowing) > 100
    assert len(calls) < 1.5 * len(set(calls)), (len(calls), len(set(calls)))
