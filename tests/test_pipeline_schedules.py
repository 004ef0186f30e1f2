"""Schedule tables: formulas, completeness, validator rejections, request errors (pure Python)."""
import dataclasses

import pytest

from triax.pipeline import (Op, OpKind, ScheduleError, ScheduleKind, build, closed_form_bubble,
                            validate)
from triax.pipeline.schedules import in_flight_profile

GRID = [(S, M) for S in (2, 3, 4, 8) for M in (1, 2, 4, 8, 16, 32) if M >= 1]


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "forward-only"])
@pytest.mark.parametrize("S,M", GRID)
def test_bubble_equals_closed_form(kind, S, M):
    s = build(kind, S, M)
    assert s.bubble_fraction() == pytest.approx((S - 1) / (M + S - 1), abs=1e-12)
    assert s.ticks == (M + S - 1) * (1 if kind == "forward-only" else 2)


@pytest.mark.parametrize("S,M,v", [(2, 2, 2), (2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 16, 3),
                                   (3, 6, 4)])
def test_interleaved_bubble_and_forward_only(S, M, v):
    for kind in ("interleaved", "forward-only"):
        s = build(kind, S, M, v)
        assert s.bubble_fraction() == pytest.approx((S - 1) / (v * M + S - 1), abs=1e-12)
        assert s.bubble_fraction() == pytest.approx(closed_form_bubble(s.kind, S, M, v))


@pytest.mark.parametrize("S,M", [(S, M) for S, M in GRID if M >= 2 * S])
def test_peak_in_flight(S, M):
    assert build("1f1b", S, M).peak_in_flight == S
    assert build("gpipe", S, M).peak_in_flight == M
    assert build("forward-only", S, M).peak_in_flight == 0
    # ZB-H1 keeps residuals until W, and still holds 1F1B's S on every stage.
    assert in_flight_profile(build("zb-h1", S, M)) == [S] * S
    # ZB-V: 2S chunks of half a stage each, counted until W: 1F1B's S whole-stage ones.
    assert in_flight_profile(build("zb-v", S, M)) == [2 * S] * S
    # Megatron's interleaved warm-up: 2(S-1) + (v-1)S + 1 chunk-micro-batches on stage 0.
    if M % S == 0:
        assert build("interleaved", S, M, 2).peak_in_flight == 2 * (S - 1) + S + 1


@pytest.mark.parametrize("S,M", [(4, 8), (4, 16), (4, 32), (8, 32)])
def test_zb_h1_bubble_about_a_third_of_1f1b(S, M):
    zb, ofob = build("zb-h1", S, M).bubble_fraction(), build("1f1b", S, M).bubble_fraction()
    assert zb == pytest.approx((S - 1) / (3 * M + S - 1), abs=1e-12)
    assert build("zb-h1", S, M).ticks == 3 * M + S - 1
    assert 0.3 < zb / ofob < 0.5


@pytest.mark.parametrize("S,M", [(2, 4), (2, 8), (2, 16), (2, 32), (4, 8), (4, 16), (4, 32),
                                 (3, 6), (8, 32)])
def test_zb_v_bubble_near_zero_from_m_2s(S, M):
    """6M+S-1 unit ticks (S ≤ 4): the last stage idles only until its first input arrives,
    half ZB-H1's bubble and a sixth of 1F1B's at M ≫ S."""
    zbv, zbh1 = build("zb-v", S, M), build("zb-h1", S, M)
    assert zbv.virtual == 2
    if S <= 4:
        assert zbv.ticks == 6 * M + S - 1
        assert zbv.bubble_fraction() == pytest.approx((S - 1) / (6 * M + S - 1), abs=1e-12)
    assert zbv.bubble_fraction() < 0.6 * zbh1.bubble_fraction()
    assert zbv.bubble_fraction() <= 0.1


@pytest.mark.parametrize("kind,v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2),
                                    ("zb-h1", 1), ("zb-v", 2), ("forward-only", 1),
                                    ("forward-only", 2)])
def test_every_microbatch_once_per_chunk(kind, v):
    s = build(kind, 4, 8, v)
    ops = [op for row in s.table for op in row if op is not None]
    assert len(ops) == len(set(ops))
    split = {OpKind.F, OpKind.B_IN, OpKind.W}
    kinds = {ScheduleKind.ZB_H1: split, ScheduleKind.ZB_V: split,
             ScheduleKind.FORWARD_ONLY: {OpKind.F}}.get(s.kind, {OpKind.F, OpKind.B})
    assert {op.kind for op in ops} == kinds
    assert len(ops) == len(kinds) * 8 * 4 * v
    for op in ops:  # circular placement, or ZB-V's V: down the stages, then back up
        stage = next(st for row in s.table for st, o in enumerate(row) if o == op)
        assert stage == (7 - op.chunk if kind == "zb-v" and op.chunk >= 4 else op.chunk % 4)


def test_zb_v_turns_on_the_last_stage_and_ends_on_the_first():
    """The V: chunk S-1 hands to chunk S on stage S-1 (no message between stages), and the
    last chunk (head and loss) runs on stage 0, beside the embedding."""
    s = build("zb-v", 4, 8)
    assert s.stage_of(3) == s.stage_of(4) == 3 and s.stage_of(7) == s.stage_of(0) == 0
    t3, _ = _where(s, Op(OpKind.F, 0, 3))
    assert _where(s, Op(OpKind.F, 0, 4)) == (t3 + 1, 3)


def _broken(sched, t, s, op):
    rows = [list(r) for r in sched.table]
    rows[t][s] = op
    return dataclasses.replace(sched, table=tuple(tuple(r) for r in rows))


def _where(sched, op):
    return next((t, s) for t, row in enumerate(sched.table) for s, o in enumerate(row) if o == op)


def test_validator_rejects_early_forward():
    s = build("1f1b", 2, 2)
    t, st = _where(s, Op(OpKind.F, 0, 1))
    # move stage 1's F(0) to tick 0, before stage 0 has produced its activation
    bad = _broken(_broken(s, t, st, None), 0, 1, Op(OpKind.F, 0, 1))
    with pytest.raises(ScheduleError, match=r"tick 0, stage 1, op F\(mb=0, chunk=1\): needs "
                                            r"F\(mb=0, chunk=0\)"):
        validate(bad)


def test_validator_rejects_backward_before_next_stage():
    s = build("gpipe", 2, 2)
    t, st = _where(s, Op(OpKind.B, 0, 0))
    t1, _ = _where(s, Op(OpKind.B, 0, 1))
    bad = _broken(_broken(s, t, st, None), t1, 0, Op(OpKind.B, 0, 0))
    with pytest.raises(ScheduleError, match=rf"tick {t1}, stage 0, op B\(mb=0, chunk=0\): "
                                            r"needs B\(mb=0, chunk=1\)"):
        validate(bad)


def test_validator_rejects_w_before_b_in_duplicates_missing_and_two_ops():
    s = build("zb-h1", 2, 2)
    t, st = _where(s, Op(OpKind.W, 1, 1))
    tb, _ = _where(s, Op(OpKind.B_IN, 1, 1))
    with pytest.raises(ScheduleError, match=r"W\(mb=1, chunk=1\): needs B_IN\(mb=1, chunk=1\)"):
        validate(_broken(_broken(s, t, st, None), tb - 1 if s.table[tb - 1][1] is None else 0,
                         1, Op(OpKind.W, 1, 1)))
    with pytest.raises(ScheduleError, match=r"op W\(mb=1, chunk=1\) never runs"):
        validate(_broken(s, t, st, None))
    last = len(s.table) - 1
    dup = dataclasses.replace(s, table=s.table + ((Op(OpKind.W, 1, 0), None),))
    with pytest.raises(ScheduleError, match=rf"tick {last + 1}, stage 0, op W\(mb=1, chunk=0\): "
                                            r"runs twice"):
        validate(dup)
    two = _broken(s, 0, 0, (Op(OpKind.F, 0, 0), Op(OpKind.F, 1, 0)))
    with pytest.raises(ScheduleError, match="tick 0, stage 0: .* at most one op per tick"):
        validate(two)
    wrong_stage = _broken(s, 0, 1, Op(OpKind.F, 1, 0))
    with pytest.raises(ScheduleError, match="tick 0, stage 1.*chunk 0 lives on stage 0"):
        validate(wrong_stage)
    v = build("zb-v", 2, 2)    # chunk 2 runs on stage 1 in the V, not on stage 0 (2 % 2)
    t, st = _where(v, Op(OpKind.F, 0, 2))
    with pytest.raises(ScheduleError, match=r"stage 0, op F\(mb=0, chunk=2\): chunk 2 lives on "
                                            r"stage 1 \(the V"):
        validate(_broken(_broken(v, t, st, None), t, 0, Op(OpKind.F, 0, 2)))
    with pytest.raises(ScheduleError, match="zb-v uses B_IN \\+ W for backwards, not B"):
        validate(_broken(v, *_where(v, Op(OpKind.B_IN, 0, 0)), Op(OpKind.B, 0, 0)))


def test_request_errors_name_the_constraint():
    with pytest.raises(ScheduleError, match="M=6 is not a multiple of S=4"):
        build("interleaved", 4, 6, 2)
    with pytest.raises(ScheduleError, match="needs --virtual v >= 2"):
        build("interleaved", 4, 8, 1)
    with pytest.raises(ScheduleError, match="needs --kind interleaved"):
        build("1f1b", 4, 8, 2)
    with pytest.raises(ScheduleError, match="unknown schedule 'pipedream'"):
        build("pipedream", 4, 8)
    with pytest.raises(ScheduleError, match="must be >= 1"):
        build("gpipe", 0, 8)
    with pytest.raises(ScheduleError, match="zb-v runs exactly 2 chunks per stage"):
        build("zb-v", 4, 8, 3)


def test_schedule_cli_json_png_and_errors(tmp_path, capsys):
    import json

    from triax.cli.main import main
    png = tmp_path / "t.png"
    assert main(["schedule", "--kind", "gpipe", "--stages", "4", "--microbatches", "8",
                 "--json", "--png", str(png)]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert facts["ticks"] == 22 and facts["peak_in_flight"] == 8
    assert facts["bubble_fraction"] == pytest.approx(3 / 11)
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["schedule", "--kind", "interleaved", "--stages", "4", "--microbatches", "6",
                 "--virtual", "2"]) == 2
    assert "M=6 is not a multiple of S=4" in capsys.readouterr().err
    assert main(["schedule", "--kind", "1f1b", "--stages", "2", "--microbatches", "2",
                 "--png", str(tmp_path / "t.jpg")]) == 2
    capsys.readouterr()
    assert main(["schedule", "--kind", "zb-v", "--stages", "4", "--microbatches", "8",
                 "--json"]) == 0
    facts = json.loads(capsys.readouterr().out)
    assert (facts["virtual"], facts["ticks"], facts["peak_in_flight"]) == (2, 51, 8)


def test_timeline_svg(tmp_path):
    from triax.pipeline.timeline import save
    out = save(build("interleaved", 2, 4, 2), tmp_path / "il.svg")
    assert out.read_text().lstrip().startswith("<?xml")
    assert save(build("zb-v", 2, 4), tmp_path / "v.svg").read_text().lstrip().startswith("<?xml")


def test_schedules_import_without_jax():
    import subprocess
    import sys
    code = ("import sys, triax.pipeline, triax.pipeline.timeline; "
            "b = triax.pipeline.build('zb-h1', 4, 8); "
            "assert not any(m == 'jax' or m.startswith('jax.') for m in sys.modules), 'jax'")
    subprocess.run([sys.executable, "-c", code], check=True)
