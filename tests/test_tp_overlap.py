"""``--tp-overlap``: sequence parallelism's all-gather → matmul and matmul → reduce-scatter
as collective matmuls (``sharding.collective_matmul``), read from the compiled HLO.

Per transformer block (the 2-layer step with its layer scans run once more, less as
compiled: ``tests/layer_collectives.py``): no all-gather over ``tensor`` and no reduction of
the residual stream over it, but ``n - 1`` permutes of one sequence chunk per ring, 8 rings
(forward: q/k/v in, attention out, MLP in, MLP out; backward: their transposes), the bytes
a ring all-gather or reduce-scatter sends. (Equality with one device: tests/test_equivalence.py.)
"""
import dataclasses

import pytest
from layer_collectives import with_one_more_layer

from triax.costs import hardware
from triax.costs.comm import traffic
from triax.costs.workload import Layout, Workload
from triax.mesh import make_mesh
from triax.planner import auto
from triax.planner.evaluate import evaluate
from triax.models import config
from triax.sharding.collective_matmul import overlap_reason
from triax.sharding.introspect import collectives_from_compiled, summarize
from triax.sharding.rules import get_strategy
from triax.training.config import RunConfig
from triax.training.setup import build_run
from triax.training.step import Trainer

B, T, DATA, TENSOR = 8, 16, 2, 4
# KV heads that tensor divides: no replicated K/V projections (their own all-reduces).
CFG = config.TINY.replace(num_kv_heads=4)


def step(overlap: bool):
    """The 2-layer step and its mesh."""
    mesh = make_mesh(data=DATA, tensor=TENSOR)
    st = dataclasses.replace(get_strategy("tp_sp"), tp_overlap=overlap)
    return Trainer(CFG.replace(num_layers=2), mesh, st).lower(B, T).compile(), mesh


@pytest.fixture(scope="module")
def blocks(devices):
    """The overlapped step's collectives per block, and the plain SP step of 2 blocks."""
    two, three = (summarize(c) for c in with_one_more_layer(*step(True), layers=2))
    zero = {"count": 0, "bytes": 0}
    per_block = {k: {f: three.get(k, zero)[f] - two.get(k, zero)[f] for f in ("count", "bytes")}
                 for k in set(two) | set(three)}
    return {True: per_block, False: summarize(collectives_from_compiled(*step(False))),
            "two": two}


def test_no_all_gather_on_the_path_and_the_same_bytes_as_permutes(blocks):
    zero = {"count": 0, "bytes": 0}
    on, off = blocks[True], blocks[False]
    residual = B // DATA * T * CFG.embed_dim * 4        # one device's whole B·T·D, fp32
    ring = (TENSOR - 1) * residual // TENSOR             # what one ring all-gather sends
    # Without the overlap XLA gathers the residual stream before each column-parallel
    # projection and the output gradient in the backward: 4 per block at least, 2 blocks.
    assert off[("all-gather", ("tensor",))]["bytes"] >= 2 * 4 * residual
    assert on.get(("all-gather", ("tensor",)), zero) == zero
    assert on.get(("reduce-scatter", ("tensor",)), zero) == zero
    # Left on `tensor`: the two norm scales' gradients (partial over the sequence chunks).
    assert on[("all-reduce", ("tensor",))] == {"count": 1, "bytes": 2 * CFG.embed_dim * 4}
    assert on[("collective-permute", ("tensor",))] == {"count": 8 * (TENSOR - 1),
                                                      "bytes": 8 * ring}


def test_planner_prices_the_rings(blocks):
    """costs.comm: the permutes of the compiled 2-layer step; planner.evaluate hides them
    under the matmuls, so the overlapped layout's step is shorter than plain SP's."""
    w = Workload.of(CFG.replace(num_layers=2), train=True, dtype="fp32", batch=B, seq=T,
                    backend="cpu")
    lay = Layout(data=DATA, tensor=TENSOR, strategy="tp_sp", tp_overlap=True)
    permutes = traffic(w, lay)["tensor"].payload_by_kind["collective-permute"]
    assert permutes == blocks["two"][("collective-permute", ("tensor",))]["bytes"]
    big = Workload.of(config.get("llama3-8b"), train=True, batch=8, seq=4096)
    cluster = hardware.cluster("h100-80gb", 8, 1)
    plain, ring = (evaluate(big, dataclasses.replace(lay, data=1, tensor=8, tp_overlap=o),
                            cluster) for o in (False, True))
    assert ring.step_time_s < plain.step_time_s
    # Same wire bytes on the residual stream (8 rings of (n−1)/n per block against 4
    # all-reduces of 2(n−1)/n); less only by the k/v input gradients' merged ring.
    assert ring.traffic["tensor"].wire < plain.traffic["tensor"].wire


def test_overlap_refuses_what_it_cannot_run(devices):
    sizes = {"data": 2, "tensor": 4}
    assert overlap_reason(sizes, get_strategy("tp_sp").rules) is None
    assert "sequence-parallel strategy" in overlap_reason(sizes, get_strategy("tp").rules)
    assert "tensor > 1" in overlap_reason({"data": 8}, get_strategy("tp_sp").rules)
    with pytest.raises(ValueError, match="pipeline stages"):
        build_run(RunConfig.of(model="tiny", num_layers=2, mesh="data=2,pipe=2,tensor=2",
                               strategy="tp_sp", tp_overlap=True, batch_size=8, seq_len=16))


def test_plan_auto_knows_the_overlap_and_takes_it_as_compiled(devices):
    """--plan auto: on tiny the model ranks plain SP first (24 permutes' latency per block
    outweigh what they hide), so it is chosen; with --tp-overlap given, the overlapped
    layout is chosen, compiled through build_run (its peak measured)."""
    run = RunConfig.of(model="tiny", num_layers=1, batch_size=8, seq_len=16, plan="auto",
                       mesh="data=2,tensor=4", strategy="tp_sp", data="markov")
    given = frozenset({"model", "num_layers", "batch_size", "seq_len", "plan", "mesh",
                       "strategy", "remat"})
    budget = auto.Budget(64 << 20, "a test budget")
    plain = auto.choose_train(run, given, budget=budget)
    assert not plain.run.layout.tp_overlap and plain.runner_up.layout.tp_overlap
    on = auto.choose_train(run.replace(tp_overlap=True), given | {"tp_overlap"}, budget=budget)
    assert on.run.layout.tp_overlap and on.plan.layout.tp_overlap
    assert on.compiled.peak_bytes <= budget.usable
