"""The planner knows DualPipeV from the pipeline's own tables: its bubble and peak in flight
(``costs.pipeline_math``), its op costs (F&B = F + B, ``planner.op_costs``), its permutes
(each buffer both ways per tick, ``costs.comm``), and the search proposes it where the
generator runs it (M >= 2S)."""
import pytest

from triax.costs import comm
from triax.costs.pipeline_math import bubble_fraction, microbatch_constraint, peak_in_flight
from triax.costs.workload import Layout, Workload
from triax.models import config
from triax.pipeline import DEFAULT_COSTS, OpKind, ScheduleKind, build
from triax.planner.op_costs import op_costs_for, work_factor

DPV, ZBV = ScheduleKind.DUALPIPE_V, ScheduleKind.ZB_V


def test_bubble_and_peak_are_the_tables():
    for S, M in [(2, 4), (4, 8), (4, 16)]:
        table = build("dualpipev", S, M)
        assert peak_in_flight(DPV, S, M) == (2 * S + 1) / 2     # 2S+1 half-stage chunks
        assert bubble_fraction(DPV, S, M) == table.bubble_fraction(DEFAULT_COSTS)
    assert "microbatches >= 2 x stages" in microbatch_constraint(DPV, 4, 4)


def test_op_costs_price_f_and_b_as_f_plus_b(devices):
    c = op_costs_for(DPV)
    costs = c.as_dict()
    assert set(costs) == {OpKind.F, OpKind.B, OpKind.B_IN, OpKind.W, OpKind.FB}
    assert costs[OpKind.FB] == costs[OpKind.F] + costs[OpKind.B]
    assert costs[OpKind.B] == op_costs_for(ScheduleKind.ONE_F_ONE_B).as_dict()[OpKind.B]
    # A micro-batch's work is one forward and one backward, as ZB-H1's.
    assert work_factor(DPV) == pytest.approx(work_factor(ScheduleKind.ZB_H1))


def test_permutes_count_both_ways():
    """DualPipeV's executor permutes each buffer up and down every tick: twice ZB-V's
    messages per tick, over its own (longer) table."""
    w = Workload.of(config.get("tiny", num_layers=8), train=True, batch=32, seq=16)
    sent = {}
    for kind in (DPV, ZBV):
        lay = Layout(pipe=4, strategy="dp", schedule=kind, microbatches=8)
        sent[kind] = comm.traffic(w, lay)["pipe"].messages_by_kind["collective-permute"]
    ticks = {k: build(k.value, 4, 8).ticks for k in (DPV, ZBV)}
    moves = sent[ZBV] - 2 * ticks[ZBV]     # the chunks' moving rounds, the same for both
    assert sent[DPV] - moves == 2 * 2 * ticks[DPV]


def test_search_proposes_dualpipev_where_it_runs():
    from triax.planner.search import _schedules
    w = Workload.of(config.get("tiny", num_layers=8), train=True, batch=32, seq=16)
    got = {(m, why is None) for kind, m, v, why in _schedules(w, 4, 32) if kind is DPV}
    assert got == {(8, True), (16, True), (32, True)}, got   # M = S < 2S is not proposed
    # With no count it can run, its one refusal is listed (the search never hides a schedule).
    got = {(m, why is None) for kind, m, v, why in _schedules(w, 4, 4) if kind is DPV}
    assert got == {(4, False)}, got
