"""Expert parallelism equals the single-device run; the HLO's dispatch is all-to-all over
``expert`` with exactly the predicted bytes."""
import jax
import pytest

from tree_checks import assert_trees_close
from triax.mesh import make_mesh
from triax.models import config
from triax.models.config import MoEConfig
from triax.sharding.experts import all_to_all_bytes
from triax.sharding.introspect import collectives_from_compiled
from triax.training.step import Trainer

B, T, STEPS = 8, 8, 3
DROPLESS = config.TINY_MOE.replace(num_layers=2)
CAPACITY = DROPLESS.replace(moe=MoEConfig(num_experts=8, top_k=2, mlp_dim=64,
                                          capacity_factor=1.0, z_loss_weight=1e-3))
# Each case compiles its own step. data=2 × expert=4 under dp is no case of its own: the
# runner's path there (shard_map manual over expert × data, expert weights pcast over data,
# all-to-all over expert) is ep2_fsdp's and dp2_ep2_pipe2's, and an all-to-all over more
# than 2 expert ranks is ep8's.
CASES = {  # name: (cfg, mesh sizes, strategy)
    "ep2_fsdp": (DROPLESS, dict(data=4, expert=2), "fsdp"),
    "ep8": (DROPLESS, dict(expert=8), "dp"),
    "dp2_ep2_tp2_capacity": (CAPACITY, dict(data=2, expert=2, tensor=2), "tp"),
    # Without a pipeline schedule the layer stack is only stored split over `pipe` and XLA
    # gathers each layer when the scan reaches it (pipelined MoE: test_pipeline_moe.py).
    "dp2_ep2_pipe2": (DROPLESS, dict(data=2, expert=2, pipe=2), "dp"),
}


def _trainer(cfg, mesh, strategy):
    """A Trainer whose metrics also carry the gradients, so one compile checks both."""
    def loss_and_grad(params, batch):
        (loss, aux), grads = jax.value_and_grad(tr.loss_fn(), has_aux=True)(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    tr = Trainer(cfg, mesh, strategy, loss_and_grad=loss_and_grad)
    return tr


def _run(cfg, mesh, strategy, init_state=None):
    """Three steps; returns per-step metrics (with grads), final params, compiled step."""
    tr = _trainer(cfg, mesh, strategy)
    compiled = tr.lower(B, T).compile()
    state = tr.init(0) if init_state is None else tr.place(init_state)
    metrics = []
    for i in range(STEPS):
        state, m = compiled(state, tr.shard_batch(tr.example_batch(B, T, seed=i)))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state["params"]), compiled, tr


@pytest.fixture(scope="module")
def reference(devices):
    one = make_mesh(devices=devices[:1])
    init = jax.device_get(_trainer(DROPLESS, one, "dp").init(0))  # same tree for CAPACITY
    return {cfg: (init, _run(cfg, one, "dp", init)) for cfg in (DROPLESS, CAPACITY)}


@pytest.fixture(scope="module")
def sharded(reference):
    return {name: _run(cfg, make_mesh(**sizes), strategy, reference[cfg][0])
            for name, (cfg, sizes, strategy) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_equals_single_device(name, reference, sharded):
    cfg = CASES[name][0]
    ref_metrics, ref_params, _, _ = reference[cfg][1]
    metrics, params, _, _ = sharded[name]
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        assert_trees_close(m, r, rtol=1e-5, atol=1e-6, what=f"{name} step {i} metrics+grads")
    # Adam divides by sqrt(v): on near-zero gradient entries fp32 summation-order noise shows
    # at the learning-rate scale (3e-3), hence atol 1e-5 on parameters after 3 steps.
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-5, what=f"{name} params")
    if cfg is CAPACITY:  # capacity is per sequence: what drops does not depend on the mesh
        assert all(m["moe_dropped_tokens"] > 0 for m in metrics)
    else:
        assert all(m["moe_dropped_tokens"] == 0 for m in metrics)


@pytest.mark.parametrize("name", list(CASES))
def test_dispatch_is_all_to_all_over_expert_only(name, sharded):
    cfg, sizes, strategy = CASES[name]
    _, _, compiled, tr = sharded[name]
    colls = collectives_from_compiled(compiled, tr.mesh)
    want = all_to_all_bytes(cfg, B, T, tr.mesh, tr.strategy.rules)
    a2a = [c for c in colls if c.kind == "all-to-all"]
    dispatch = [c for c in a2a if c.bytes_per_device == want["buffer_bytes"]]
    assert dispatch and all(c.axes == ("expert",) for c in dispatch), a2a
    # dispatch + combine, forward + backward, in each of the scanned layers
    assert sum(c.count for c in dispatch) == want["count"] == 4 * cfg.num_layers
    # Any other all-to-all runs outside the layers, once per step each: FSDP's embedding
    # lookup and (XLA since JAX 0.12) its gradient's scatter-add, both over `data`.
    others = [c for c in a2a if c not in dispatch]
    assert sum(c.count for c in others) <= 2 and all(c.axes == ("data",) for c in others), a2a
    # The tokens are split over expert × data, so every rank dispatches its own sequences.
    assert tr.batch_sharding().spec == jax.sharding.PartitionSpec(
        tuple(a for a in ("expert", "data") if sizes.get(a, 1) > 1) or None)
