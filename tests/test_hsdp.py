"""HSDP: FSDP within each `replica` group, replicated across groups.

The compiled step's collectives per mesh axis equal the count made from the parameters'
shapes: the gathers and gradient reductions stay on `data` (the shard group) and the only
traffic on `replica` is one all-reduce of each gradient shard. The planner puts `replica`
on the inter-node links. FSDP's HSDP step, the one read here, and the pipelined one equal one
device (fsdp_tp's HSDP equality: tests/test_equivalence.py).
"""
import math

import jax
import numpy as np
import pytest
from step_grads import first_step_grads
from tree_checks import assert_trees_close

from triax.costs import hardware
from triax.costs.comm import axis_links, traffic
from triax.costs.workload import Layout, Workload
from triax.mesh import make_hybrid_mesh, make_mesh
from triax.models import config
from triax.pipeline.pipelined import PipelineConfig
from triax.planner.evaluate import evaluate
from triax.planner.search import hsdp_variants
from triax.sharding.introspect import collectives_from_compiled
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
B, T = 8, 16
REPLICA, DATA = 2, 4


def _bytes(cols, kind, axes):
    """Bytes per device per step of the ``kind`` ops whose groups span exactly ``axes``."""
    return sum(c.bytes_per_device * c.count for c in cols if c.kind == kind and c.axes == axes)


@pytest.fixture(scope="module")
def hsdp(devices):
    """The HSDP step compiled once: its collectives read here, the program the equality
    test runs."""
    mesh = make_mesh(replica=REPLICA, data=DATA)
    trainer = Trainer(CFG, mesh, "fsdp")
    compiled = trainer.lower(B, T).compile()
    return trainer, collectives_from_compiled(compiled, mesh), compiled


def run(trainer, init, step=None, n_steps=3):
    """Step 0's loss and gradients (read from the optimizer: ``step_grads``), every step's
    loss and the parameters after ``n_steps``, from ``init`` (a host state) placed."""
    state, losses = trainer.place(init), []
    for i in range(n_steps):
        state, m = (step or trainer.step)(state, trainer.shard_batch(
            trainer.example_batch(B, T, seed=i)))
        losses.append(float(m["loss"]))
        if i == 0:
            grads = first_step_grads(trainer, state, m)
    return losses[0], grads, losses, jax.device_get(state["params"])


@pytest.fixture(scope="module")
def reference(devices):
    """One device's run and its initial state on the host (every run's start)."""
    one = Trainer(CFG, make_mesh(devices=devices[:1]), "dp")
    init = jax.device_get(one.init(seed=0))
    return init, run(one, init)


def test_hsdp_fsdp_matches_single_device(hsdp, reference):
    """FSDP within each replica group of the batch, replicated across groups: loss, every
    gradient and the parameters after 3 steps equal one device's (fp32)."""
    trainer, _, compiled = hsdp
    assert "replica" in str(trainer.batch_sharding().spec)     # the batch split over groups
    init, (ref_loss, ref_grads, ref_losses, ref_params) = reference
    loss, grads, losses, params = run(trainer, init, step=compiled)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what="HSDP fsdp gradients")
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-6, what="HSDP fsdp params")


def _analytic(trainer):
    """fp32 bytes of the parameters the rules split over `data` (whole, by where they live:
    the layer stack, the head, the embedding table) and of those they keep whole (norms)."""
    out = {"blocks": 0, "head": 0, "table": 0, "whole": 0}
    params = trainer.abstract_state()["params"]
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        name = jax.tree_util.keystr(path)
        nbytes = math.prod(leaf.shape) * 4
        split = any("data" in (e if isinstance(e, tuple) else (e,))
                    for e in leaf.sharding.spec if e is not None)
        where = ("whole" if not split else "blocks" if "blocks" in name
                 else "table" if "embed" in name else "head")
        out[where] += nbytes
    return out


def test_hsdp_collectives_per_axis_equal_the_analytic_count(hsdp):
    trainer, cols, _ = hsdp
    a = _analytic(trainer)
    sharded = a["blocks"] + a["head"] + a["table"]
    tokens = B // (REPLICA * DATA) * T              # one device's tokens
    # The shard group (`data`): each block weight gathered for the forward and again for
    # the backward (the layer scan frees it), the head once; the group's token ids (int32)
    # gathered once for the exchanged embedding lookup.
    assert _bytes(cols, "all-gather", ("data",)) == (
        2 * a["blocks"] + a["head"] + DATA * tokens * 4)
    # Gradients reduced within the group (XLA's CPU backend lowers the reduce-scatter as an
    # all-reduce and a slice: same payload), plus the clipping's and the grad_norm metric's
    # partial sums of squares, one f32 each per sharded leaf.
    leaves = sum(1 for p, l in jax.tree_util.tree_flatten_with_path(
        trainer.abstract_state()["params"])[0] if "data" in str(l.sharding.spec))
    reduced = _bytes(cols, "reduce-scatter", ("data",)) + _bytes(cols, "all-reduce", ("data",))
    assert reduced == a["blocks"] + a["head"] + 2 * leaves * 4
    # The embedding lookup's activations exchanged forward and backward.
    assert _bytes(cols, "all-to-all", ("data",)) == 2 * tokens * CFG.embed_dim * 4
    # Across replicas: one all-reduce of each gradient shard, nothing else on `replica`
    # alone; the whole (unsplit) norm scales and the loss reduce over both axes at once.
    assert _bytes(cols, "all-reduce", ("replica",)) == sharded // DATA
    assert {c.kind for c in cols if c.axes == ("replica",)} == {"all-reduce"}
    assert _bytes(cols, "all-reduce", ("replica", "data")) == a["whole"] + 4
    assert {c.axes for c in cols} == {("data",), ("replica",), ("replica", "data")}


def test_comm_model_prices_the_replica_all_reduce(hsdp):
    """costs.comm: the replica axis moves the shard's gradients plus the whole leaves'
    (the compiled program's joint op, less its 4-byte loss)."""
    trainer, cols, _ = hsdp
    a = _analytic(trainer)
    w = Workload.of(CFG, train=True, dtype="fp32", batch=B, seq=T, backend="cpu")
    t = traffic(w, Layout(replica=REPLICA, data=DATA, strategy="fsdp"))["replica"]
    assert t.payload_by_kind == {"all-reduce": (a["blocks"] + a["head"] + a["table"]) // DATA
                                 + a["whole"]}


def test_hybrid_mesh_puts_each_replica_group_in_one_node(devices):
    mesh = make_hybrid_mesh(replica=2, data=4, num_nodes=2)
    for r in range(2):
        assert len({d.id // 4 for d in mesh.devices[r].flat}) == 1


def test_planner_puts_replica_on_the_inter_node_links():
    cluster = hardware.cluster("h100-80gb", gpus_per_node=8, nodes=4)
    lay = Layout(replica=4, data=8, strategy="fsdp")
    links = axis_links(lay, cluster)
    assert links["replica"] is cluster.inter and links["data"] is cluster.intra
    # The search offers HSDP forms of a sharded layout: replica dividing the node count.
    forms = [(h.replica, h.data) for h in hsdp_variants(Layout(data=32, strategy="fsdp"),
                                                         cluster)]
    assert forms == [(1, 32), (2, 16), (4, 8)]
    assert list(hsdp_variants(Layout(data=32, strategy="dp"), cluster)) == [
        Layout(data=32, strategy="dp")]
    # Priced: FSDP over all 32 devices runs its gathers on the inter-node links; HSDP keeps
    # them in the node, and its data axis costs less time than FSDP's.
    w = Workload.of(config.get("llama3-8b"), train=True, batch=64, seq=4096)
    flat = evaluate(w, Layout(data=32, strategy="fsdp"), cluster)
    hybrid = evaluate(w, lay, cluster)
    assert hybrid.comm_time_by_axis["data"] < flat.comm_time_by_axis["data"]
    assert hybrid.comm_time_by_axis["replica"] > 0


def test_pipelined_hsdp_gradients_match_single_device(reference):
    """The pipeline's executor makes `pipe` and `data` manual; `replica` stays an auto batch
    axis around it (each group runs its own pipeline on its rows, XLA sums the shards).
    Against one device's step 0 (the reference run's batch 0 at its initial parameters)."""
    init, (ref_loss, ref_grads, _, _) = reference
    tr = Trainer(CFG, make_mesh(replica=2, data=2, pipe=2), "fsdp",
                 pipeline=PipelineConfig("1f1b", 2))
    (loss, _), grads = tr.grads(init["params"], tr.example_batch(B, T, seed=0))
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    assert_trees_close(jax.device_get(grads), jax.device_get(ref_grads), rtol=1e-5, atol=1e-7,
                       what="pipelined HSDP gradients")
