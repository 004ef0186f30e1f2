"""DualPipeV (``pipeline.dualpipe_v``): its table against DeepSeek's published figures, and
its executor run against one device.

The table: the overlapped F&B cell, the bubble per device ``(S-1)(F&B + B - 3W)`` (DualPipe's
``(PP/2-1)(F&B + B - 3W)``, ``PP = 2S`` stages on ``S`` devices) and ``2S+1`` chunks in flight
(``PP+1``), computed from the table. The executor: tiny on data=2 × tensor=2 × pipe=2
(``fsdp_tp``) and data=2 × pipe=4 (``fsdp``) equals one device over 3 optimizer steps (loss,
gradients, parameters; fp32), and F&B's compiled branch runs exactly F's and B's matmuls."""
import jax
import numpy as np
import pytest

from tree_checks import assert_trees_close
from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline import ScheduleError, build
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.pipeline.schedules import DEFAULT_COSTS, OpKind
from triax.sharding.introspect import op_branch_costs
from triax.training.step import Trainer

F, B, B_IN, W, FB = OpKind.F, OpKind.B, OpKind.B_IN, OpKind.W, OpKind.FB
BATCH, T, STEPS = 16, 8, 3


def _costs(f, b, w, fb):
    """Op durations with B_in = F (the zero-bubble papers' and DualPipe's assumption)."""
    return {F: f, B: b, B_IN: f, W: w, FB: fb}


@pytest.mark.parametrize("S", [2, 3, 4, 8])
@pytest.mark.parametrize("extra", [0, 1, 5])
def test_bubble_and_activations_are_dualpipes(S, extra):
    M = 2 * S + extra
    sched = build("dualpipev", S, M)
    cells = [op for row in sched.table for op in row if op is not None]
    assert sched.virtual == 2 and any(op.kind is FB for op in cells)
    # F&B overlaps two micro-batches: its F's is always newer than its B's.
    assert all(op.mb > op.b_mb for op in cells if op.kind is FB)
    assert sched.peak_in_flight == 2 * S + 1                       # PP + 1
    for f, b, w, fb in [(1, 2, 1, 3), (1, 2, 1, 2.5), (2, 3, 1, 5), (2, 3, 1, 4), (3, 4, 1, 6)]:
        idle = sched.idle_times(_costs(f, b, w, fb))
        assert max(idle) == pytest.approx((S - 1) * (fb + b - 3 * w)), (f, b, w, fb, idle)
    # At the default costs (F = B_in = W = 1, F&B = F + B) every device idles exactly that.
    assert sched.idle_times() == pytest.approx([(S - 1) * 2.0] * S)
    assert DEFAULT_COSTS[FB] == DEFAULT_COSTS[F] + DEFAULT_COSTS[B]


def test_requests_it_cannot_run_are_refused():
    with pytest.raises(ScheduleError, match="microbatches >= 2 x stages"):
        build("dualpipev", 4, 7)
    with pytest.raises(ScheduleError, match="exactly 2 chunks per stage"):
        build("dualpipev", 2, 4, virtual=3)


def test_schedule_command_takes_the_kind_positionally(capsys):
    from triax.cli.main import main
    assert main(["schedule", "dualpipev", "--stages", "2", "--microbatches", "4",
                 "--table"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("dualpipev: S=2 M=4 v=2") and "peak in flight   5" in out
    assert "X" in out   # the table draws F&B cells as X


# ---- the executor against one device ---------------------------------------------------

# Both meshes run one 8-layer model on the same batches, so one one-device run serves
# both; on pipe=2 each of the V's chunks holds 2 layers, on pipe=4 one.
CFG = config.TINY.replace(num_layers=8)
MESHES = {  # name: (mesh sizes, strategy, micro-batches)
    "pipe2-fsdp-tp": (dict(data=2, tensor=2, pipe=2), "fsdp_tp", 4),
    "pipe4-fsdp": (dict(data=2, pipe=4), "fsdp", 8),
}


def _with_grads(loss_and_grad):
    """Report the gradients among the metrics, so one compile checks both."""
    def f(params, batch):
        (loss, aux), grads = loss_and_grad(params, batch)
        return (loss, {**aux, "grads": grads}), grads
    return f


def _run(tr, init):
    """Three steps from ``init`` (a host train state: the one-device trainer's, so one init
    compile serves both runs)."""
    compiled = tr.lower(BATCH, T).compile()
    state, metrics = tr.place(init), []
    for i in range(STEPS):
        state, m = compiled(state, tr.shard_batch(tr.example_batch(BATCH, T, seed=i)))
        metrics.append(jax.device_get(m))
    return metrics, jax.device_get(state["params"]), compiled


@pytest.fixture(scope="module")
def reference(devices):
    """The one-device run, and its initial train state on the host (the pipelined runs')."""
    one = make_mesh(devices=devices[:1])
    loss = Trainer(CFG, one, "dp").loss_fn()
    lg = lambda p, b: jax.value_and_grad(loss, has_aux=True)(p, b)  # noqa: E731
    tr = Trainer(CFG, one, "dp", loss_and_grad=_with_grads(lg))
    init = jax.device_get(tr.init(0))
    return init, _run(tr, init)


@pytest.fixture(scope="module", params=sorted(MESHES))
def runs(request, reference):
    """The pipelined run and the one-device run of the same model and batches."""
    sizes, strategy, M = MESHES[request.param]
    mesh = make_mesh(**sizes)
    pipe = Pipeline(CFG, mesh, strategy, PipelineConfig("dualpipev", M))
    assert pipe.schedule.kind.value == "dualpipev" and pipe.schedule.microbatches == M
    tr = Trainer(CFG, mesh, pipe.strategy, loss_and_grad=_with_grads(pipe.loss_and_grad))
    init, ref_run = reference
    return request.param, _run(tr, init), ref_run


def test_dualpipev_equals_one_device(runs):
    name, (metrics, params, _), (ref_metrics, ref_params, _) = runs
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        np.testing.assert_allclose(m["loss"], r["loss"], rtol=1e-5, err_msg=f"{name} step {i}")
        assert_trees_close(m["grads"], r["grads"], rtol=1e-5, atol=1e-6,
                           what=f"dualpipev {name} step {i} grads")
    assert_trees_close(params, ref_params, rtol=1e-5, atol=1e-5, what=f"dualpipev {name} params")


def test_overlapped_branch_runs_exactly_f_and_b(runs):
    """F&B's conditional, read from the compiled step, runs F's matmuls and B's: the same
    FLOPs and dots as one F and one B, at the head's costliest and cheapest alike."""
    name, (_, _, compiled), _ = runs
    ops = op_branch_costs(compiled)
    assert {"F", "B", "B_in", "W", "FB"} <= set(ops), sorted(ops)
    f, b, fb = ops["F"], ops["B"], ops["FB"]
    assert f.flops > 0 and b.flops > 0
    assert (fb.flops, fb.dots) == (f.flops + b.flops, f.dots + b.dots), name
    for pick in ("costliest", "cheapest"):
        one, two, both = (getattr(c, pick)() for c in (f, b, fb))
        assert (both.flops, both.dots) == (one.flops + two.flops, one.dots + two.dots), pick
