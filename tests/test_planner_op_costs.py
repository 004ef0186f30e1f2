"""The planner weighs pipeline bubbles by op costs measured on the compiled executor
(``planner.op_costs``: per-layer matmul FLOPs of the tick switch's branches), not by the
unit costs ``pipeline.DEFAULT_COSTS``; where it cannot measure, it says so."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from triax.models import config
from triax.pipeline import DEFAULT_COSTS, OpKind, ScheduleKind, build
from triax.costs import hardware
from triax.planner.recommend import evaluate, plan
from triax.planner.op_costs import op_costs_for
from triax.costs.workload import Layout, Workload

F, B, B_IN, W = OpKind.F, OpKind.B, OpKind.B_IN, OpKind.W
S, M = 4, 8
# tiny (4 layers) on 8 devices: pipe=4 × data=2, 16 sequences per replica, M=8.
LAYOUT = Layout(data=2, pipe=4, strategy="dp", schedule=ScheduleKind.ZB_H1, microbatches=M)


def _plan_zb_h1():
    w = Workload.of(config.get("tiny"), train=True, batch=32, seq=128)
    return plan(w, hardware.cluster("h100-80gb", 8, 1), layout=LAYOUT)


def test_one_f_one_b_backward_costs_two_forwards(devices):
    c = op_costs_for(ScheduleKind.ONE_F_ONE_B)
    assert c.measured and c.source.startswith("measured from the compiled executor")
    costs = c.as_dict()
    assert set(costs) == {F, B} and costs[F] == 1.0
    assert costs[B] == pytest.approx(2.0, rel=0.02)
    # GPipe and interleaved run the same F and B branches: the same measurement.
    assert op_costs_for(ScheduleKind.GPIPE) is c and op_costs_for(ScheduleKind.INTERLEAVED) is c


def test_zb_h1_w_costs_the_weight_gradient_half(devices):
    """With the split backward (pipeline.split_backward) W runs only the weight-gradient
    matmuls (≈ F) and B_in the input gradient (≈ F): together one backward (B ≈ 2F), where
    W used to rerun the whole pullback (W ≈ B)."""
    costs = op_costs_for(ScheduleKind.ZB_H1).as_dict()
    assert set(costs) == {F, B_IN, W} and costs[F] == 1.0
    assert costs[B_IN] == pytest.approx(1.0, rel=0.15)
    assert costs[W] == pytest.approx(1.0, rel=0.15)
    assert costs[B_IN] + costs[W] == pytest.approx(
        op_costs_for(ScheduleKind.ONE_F_ONE_B).as_dict()[B], rel=0.02)


def test_planner_zb_h1_bubble_is_the_measured_one(devices):
    """The planner's zb-h1 bubble is the table's under the measured costs; with the unit
    costs (W = 1) it would be a different, idealised figure."""
    measured = op_costs_for(ScheduleKind.ZB_H1)
    table = build("zb-h1", S, M)
    want = table.bubble_fraction(costs=measured.as_dict())
    idealised = table.bubble_fraction(costs=DEFAULT_COSTS)
    assert abs(want - idealised) > 0.01          # the check below can tell them apart
    rec = _plan_zb_h1()
    assert rec.plans[0].bubble == pytest.approx(want, abs=1e-9)
    assert any(r.startswith("Pipeline bubbles weigh each op by its cost: F=1, ")
               and "(zb-h1 remat=none)" in r and "measured from the compiled executor" in r
               for r in rec.reasoning)
    out = rec.to_json()["op_costs"]["zb-h1 remat=none"]
    assert out["measured"] and out["W"] == pytest.approx(measured.as_dict()[W])


def test_without_two_cpu_devices_the_unit_costs_are_said():
    """A process whose JAX has one CPU device cannot compile the probe step: the planner
    falls back to DEFAULT_COSTS and its reasoning says so (never silently)."""
    script = textwrap.dedent(f"""
        import json
        from triax.models import config
        from triax.pipeline import DEFAULT_COSTS, ScheduleKind, build
        from triax.costs import hardware
        from triax.planner.recommend import plan
        from triax.costs.workload import Layout, Workload
        w = Workload.of(config.get("tiny"), train=True, batch=32, seq=128)
        rec = plan(w, hardware.cluster("h100-80gb", 8, 1), layout=Layout(
            data=2, pipe=4, strategy="dp", schedule=ScheduleKind.ZB_H1, microbatches={M}))
        print(json.dumps({{"bubble": rec.plans[0].bubble, "reasoning": rec.reasoning,
                           "unit": build("zb-h1", {S}, {M}).bubble_fraction(DEFAULT_COSTS)}}))
    """)
    env = dict(os.environ, JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bubble"] == pytest.approx(got["unit"], abs=1e-12)
    said = [r for r in got["reasoning"]
            if r.startswith("Pipeline bubbles weigh each op by its cost") and "zb-h1" in r]
    assert said and "assumed unit costs, not measured" in said[0] \
        and "1 CPU device(s)" in said[0]


def test_zb_h1_compute_counts_what_its_ops_cost(devices):
    """Model FLOPs count F + B per micro-batch; ZB-H1 runs F + B_in + W, measured. Its
    compute time is the same layout's 1F1B compute time scaled by that ratio (1 with the
    split backward; about 1.35 when W reran the whole pullback)."""
    zb = op_costs_for(ScheduleKind.ZB_H1).as_dict()
    ofob = op_costs_for(ScheduleKind.ONE_F_ONE_B).as_dict()
    ratio = (zb[F] + zb[B_IN] + zb[W]) / (ofob[F] + ofob[B])
    assert ratio == pytest.approx(1.0, rel=0.02)
    w = Workload.of(config.get("tiny"), train=True, batch=32, seq=128)
    cluster = hardware.cluster("h100-80gb", 8, 1)
    one_f_one_b = plan(w, cluster, layout=dataclasses.replace(
        LAYOUT, schedule=ScheduleKind.ONE_F_ONE_B)).plans[0]
    assert _plan_zb_h1().plans[0].compute_time_s == pytest.approx(
        one_f_one_b.compute_time_s * ratio, rel=1e-9)


def test_llama3_70b_zb_h1_costs_what_its_table_says(devices):
    """llama3-70b training on 4×8 H100, on the best plan's layout: with the split backward
    ZB-H1 computes exactly what 1F1B does (W ≈ the weight-gradient half of B; when W reran
    the whole pullback its compute was ~1.35× 1F1B's) in a smaller bubble. What it pays is
    a little memory: the pieces of B_in's cut for W that find no free cell in their
    micro-batch's stash slot (``StageBackward.layout``)."""
    w = Workload.of(config.get("llama3-70b"), train=True, batch=64, seq=4096)
    cluster = hardware.cluster("h100-80gb", 8, 4)
    best = plan(w, cluster, top=1).plans[0].layout
    one, zb = (evaluate(w, dataclasses.replace(best, schedule=s, virtual=1), cluster)
               for s in (ScheduleKind.ONE_F_ONE_B, ScheduleKind.ZB_H1))
    assert zb.compute_time_s == pytest.approx(one.compute_time_s, rel=0.02)
    assert zb.bubble < one.bubble
    assert zb.memory.activations > one.memory.activations
