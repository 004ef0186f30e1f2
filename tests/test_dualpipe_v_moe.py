"""DualPipeV with MoE under expert parallelism: ``tiny-moe`` (4 layers: one per chunk of the
V) on data=2 × pipe=2 × expert=2 equals one device over 3 optimizer steps (loss, auxiliary
losses, gradients, parameters), and in the compiled step the overlapped F&B branch holds
the expert all-to-alls of one micro-batch beside the other's matmuls: one tick, one branch,
with no data between them, for the scheduler to overlap."""
import re

import jax
import pytest

from test_pipeline_moe import CFG, M, SIZES, _microbatch_rows, _reference_loss, _run, _with_grads
from tree_checks import assert_trees_close
from triax.mesh import make_mesh
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.sharding.introspect.branch_costs import OP_SCOPE
from triax.sharding.introspect.hlo_text import compiled_text, parse_module
from triax.training.step import Trainer


@pytest.fixture(scope="module")
def runs(devices):
    one = make_mesh(devices=devices[:1])
    am = Trainer(CFG, one, "dp").abstract
    loss = _reference_loss(am, _microbatch_rows())
    lg = lambda p, b: jax.value_and_grad(loss, has_aux=True)(p, b)  # noqa: E731
    ref = Trainer(CFG, one, "dp", loss_and_grad=_with_grads(lg))
    init = jax.device_get(ref.init(0))   # one init compile: the pipelined run starts here too
    reference = _run(ref, init)
    mesh = make_mesh(**SIZES)
    pipe = Pipeline(CFG, mesh, "dp", PipelineConfig("dualpipev", M))
    tr = Trainer(CFG, mesh, pipe.strategy, loss_and_grad=_with_grads(pipe.loss_and_grad))
    return _run(tr, init), reference


def test_dualpipev_moe_equals_one_device(runs):
    (metrics, params, _), (ref_metrics, ref_params, _) = runs
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        assert sorted(m) == sorted(r)
        assert m["moe_lb_loss"] > 0 and m["moe_z_loss"] > 0
        assert_trees_close(m, r, rtol=1e-5, atol=1e-6, what=f"dualpipev step {i} metrics+grads")
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-5, what="dualpipev params")


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


def test_overlapped_branch_holds_one_microbatchs_all_to_all_and_the_others_matmuls(runs):
    (_, _, compiled), _ = runs
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
