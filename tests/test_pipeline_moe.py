"""MoE through the pipeline: ``tiny-moe`` (4 layers: one per chunk of the V) on data=2 ×
pipe=2 × expert=2 under DualPipeV equals one device (loss, gradients, auxiliary losses,
parameters over 3 optimizer steps), with the expert all-to-all inside the stages; in the
compiled step the overlapped F&B branch holds the expert all-to-alls of one micro-batch
beside the other's matmuls: one tick, one branch, with no data between them, for the
scheduler to overlap.

One pipelined program serves every check: DualPipeV runs every op kernel the executor has
(``tick_kernels``' F and B, which are 1F1B's and GPipe's, the split backward's B_in and W,
which are ZB-H1's and ZB-V's, and F&B), so a 1F1B case here (once kept beside it) compiled
its F and B with MoE again and differed only in the tick table, a constant the scan reads;
a MoE chunk's B_in + W equal its full backward in ``test_split_backward.py``.

The auxiliary losses are per micro-batch (``pipeline.stage._with_aux``), so the one-device
reference runs the model on each micro-batch's rows (``_microbatch_rows``) and averages
them, with the cross-entropy over the whole batch."""
import re

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
from triax.sharding.introspect.branch_costs import OP_SCOPE
from triax.sharding.introspect.hlo_text import compiled_text, parse_module
from triax.training.step import Trainer

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
    pipe = Pipeline(CFG, mesh, "dp", PipelineConfig("dualpipev", M))
    tr = Trainer(CFG, mesh, pipe.strategy, loss_and_grad=_with_grads(pipe.loss_and_grad))
    return "dualpipev", tr, _run(tr, reference[0])


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
    # of the stage (its two chunks), forward (B/W redo it backward).
    fwd = 2 * (CFG.num_layers // SIZES["pipe"]) * M
    assert sum(c.count for c in a2a if c.frequency_known) >= 2 * fwd, a2a


def test_micro_batch_must_split_over_expert():
    pipe = Pipeline(CFG, make_mesh(**SIZES), "dp", PipelineConfig("1f1b", 8))
    batch = {k: jax.ShapeDtypeStruct((B, T), jnp.int32) for k in ("inputs", "targets")}
    with pytest.raises(ScheduleError, match="split over the expert axis"):
        jax.eval_shape(pipe.loss_and_grad, pipe.abstract.shapes, batch)


def _ops_under(m, comp: str, depth: int = 0) -> list[str]:
    """Every instruction run by one execution of ``comp`` (called computations, loop bodies
    and nested branches included, fusions opened), as its op; an all-to-all of floating
    values (the tokens dispatched and combined) as ``"all-to-all f"``."""
    out = []
    for ins in m.comps.get(comp, ()):
        floats = ins.op == "all-to-all" and re.match(r"\(?(f|bf)\d", ins.type_text)
        out.append("all-to-all f" if floats else ins.op)
        if depth < 32:
            for c in list(ins.branches) + [c for _, c in ins.calls]:
                out += _ops_under(m, c, depth + 1)
    return out


def test_overlapped_branch_holds_one_microbatchs_all_to_all_and_the_others_matmuls(pipelined):
    *_, (_, _, compiled) = pipelined
    m = parse_module(compiled_text(compiled))
    runs_by_label = {}
    for instrs in m.comps.values():
        for ins in instrs:
            name = re.search(r'op_name="([^"]*)"', ins.rest)
            label = re.search(re.escape(OP_SCOPE) + r"(\w+)", name.group(1)) if name else None
            if ins.op == "conditional" and len(ins.branches) == 2 and label:
                ops = _ops_under(m, ins.branches[1])   # the outermost, where nested share
                if len(ops) > len(runs_by_label.get(label.group(1), ())):   # the scope
                    runs_by_label[label.group(1)] = ops
    assert {"FB", "F", "B"} <= set(runs_by_label), sorted(runs_by_label)
    count = lambda label, op: sum(o == op for o in runs_by_label[label])  # noqa: E731
    # The tokens' all-to-alls: F dispatches and combines, B sends their cotangents back;
    # F&B runs both sets in its one branch. (The integer all-to-alls of the routing
    # bookkeeping, the same for every micro-batch, XLA runs once for both.)
    a2a = {k: count(k, "all-to-all f") for k in ("F", "B", "FB")}
    assert a2a["F"] > 0 and a2a["B"] > 0 and a2a["FB"] == a2a["F"] + a2a["B"], a2a
    # ... beside both micro-batches' matmuls, in the same branch.
    dots = {k: count(k, "dot") for k in ("F", "B", "FB")}
    assert dots["F"] > 0 and dots["FB"] == dots["F"] + dots["B"], dots
