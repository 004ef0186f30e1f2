"""MoE through the pipeline: ``tiny-moe`` on data=2 × pipe=2 × expert=2 equals one device
(loss, gradients, auxiliary losses, 3 optimizer steps) under 1F1B, with the expert
all-to-all inside the stages. The split backward's op kernels (B_in, W) run MoE against
the same one-device run in ``test_dualpipe_v_moe.py`` (DualPipeV runs F, B, B_in, W and
F&B), and a MoE chunk's B_in + W equal its full backward in ``test_split_backward.py``:
a ZB-H1 case here compiled those kernels a third time.

The auxiliary losses are per micro-batch (``pipeline.stage._with_aux``), so the one-device
reference runs the model on each micro-batch's rows (``_microbatch_rows``) and averages
them, with the cross-entropy over the whole batch."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tree_checks import assert_trees_close
from triax.mesh import make_mesh
from triax.models import config
from triax.models.loss import weighted_nll_sum
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.pipeline.schedules import ScheduleError
from triax.sharding.introspect import collectives_from_compiled
from triax.training.step import Trainer

# 4 layers (2 per stage): the one-device reference is test_dualpipe_v_moe.py's program too,
# which the suite's compile cache then holds once.
CFG = config.TINY_MOE.replace(num_layers=4)
B, T, M, STEPS = 16, 8, 4, 3
SIZES = dict(data=2, pipe=2, expert=2)


def _with_grads(loss_and_grad):
    """Report the gradients among the metrics, so one compile checks both."""
    def f(params, batch):
        (loss, aux), grads = loss_and_grad(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    return f


def _microbatch_rows() -> np.ndarray:
    """``[M, rows]``: the batch rows each micro-batch holds over both data shards. ``dp``
    stores the batch split over ``("expert", "data")``, expert-major; data shard ``d`` holds
    the rows of devices ``(e, d)`` in expert order and splits them into ``M`` micro-batches
    in order."""
    E, D = SIZES["expert"], SIZES["data"]
    on_device = np.arange(B).reshape(E, D, -1)                # rows on device (e, d)
    shards = on_device.transpose(1, 0, 2).reshape(D, M, -1)   # shard d's micro-batches
    return shards.transpose(1, 0, 2).reshape(M, -1)


def _reference_loss(am, rows):
    """The model on each micro-batch's rows in turn: a scan over ``rows``, so the program
    holds the model once (a Python loop would trace and compile it M times)."""
    def loss(params, batch):
        model = nnx.merge(am.graphdef, params)

        def microbatch(nll, xs):
            inputs, targets = xs
            logits, a = model(inputs)
            return nll + weighted_nll_sum(logits, targets, jnp.ones(targets.shape)), a
        nll, aux = jax.lax.scan(microbatch, jnp.zeros((), jnp.float32),
                                (batch["inputs"][rows], batch["targets"][rows]))
        aux = jax.tree.map(lambda v: jnp.sum(v) / M, aux)
        ce = nll / (B * T)
        return ce + aux["moe_loss_weighted"], {"ce": ce, **aux}
    return loss


def _run(tr, init):
    """Three steps from ``init`` (a host train state: the one-device trainer's, so one init
    compile serves every run); per-step metrics, final parameters, the compiled step."""
    compiled = tr.lower(B, T).compile()
    state, metrics = tr.place(init), []
    for i in range(STEPS):
        state, m = compiled(state, tr.shard_batch(tr.example_batch(B, T, seed=i)))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state["params"]), compiled


@pytest.fixture(scope="module")
def reference(devices):
    one = make_mesh(devices=devices[:1])
    am = Trainer(CFG, one, "dp").abstract
    rows = _microbatch_rows()
    assert sorted(rows.ravel()) == list(range(B))
    loss = _reference_loss(am, rows)
    lg = lambda p, b: jax.value_and_grad(loss, has_aux=True)(p, b)  # noqa: E731
    tr = Trainer(CFG, one, "dp", loss_and_grad=_with_grads(lg))
    init = jax.device_get(tr.init(0))
    return init, _run(tr, init)


@pytest.fixture(scope="module")
def pipelined(reference):
    mesh = make_mesh(**SIZES)
    pipe = Pipeline(CFG, mesh, "dp", PipelineConfig("1f1b", M))
    tr = Trainer(CFG, mesh, pipe.strategy, loss_and_grad=_with_grads(pipe.loss_and_grad))
    return "1f1b", tr, _run(tr, reference[0])


def test_pipelined_moe_equals_one_device(reference, pipelined):
    kind, _, (metrics, params, _) = pipelined
    ref_metrics, ref_params, _ = reference[1]
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        assert sorted(m) == sorted(r)
        assert m["moe_lb_loss"] > 0 and m["moe_z_loss"] > 0
        assert_trees_close(m, r, rtol=1e-5, atol=1e-6, what=f"{kind} step {i} metrics+grads")
    # Adam divides by sqrt(v): near-zero gradient entries show fp32 summation-order noise at
    # the learning-rate scale after 3 steps (as in test_moe_sharded).
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-5, what=f"{kind} params")


def test_all_to_all_over_expert_and_permutes_over_pipe_only(pipelined):
    kind, tr, (_, _, compiled) = pipelined
    colls = collectives_from_compiled(compiled, tr.mesh)
    a2a = [c for c in colls if c.kind == "all-to-all"]
    permutes = [c for c in colls if c.kind == "collective-permute"]
    assert a2a and all(c.axes == ("expert",) for c in a2a), a2a
    assert permutes and all(c.axes == ("pipe",) for c in permutes), permutes
    # The dispatch runs inside the tick loop: per micro-batch, dispatch + combine per layer
    # of the stage, forward (B/W redo it backward).
    fwd = 2 * (CFG.num_layers // SIZES["pipe"]) * M
    assert sum(c.count for c in a2a if c.frequency_known) >= 2 * fwd, a2a


def test_micro_batch_must_split_over_expert():
    pipe = Pipeline(CFG, make_mesh(**SIZES), "dp", PipelineConfig("1f1b", 8))
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("inputs", "targets")}
    with pytest.raises(ScheduleError, match="split over the expert axis"):
        jax.eval_shape(pipe.loss_and_grad, pipe.abstract.shapes, batch)
