"""The HLO collective parser on hand-written HLO covering every replica-group format,
async start/done pairs, conditional branches and loops of unknown trip count."""
import pytest

from triax.sharding.introspect import bytes_over, parse_collectives

AXES, SHAPE = ("data", "pipe", "expert", "tensor"), (2, 1, 1, 4)

HLO = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %ar = f32[4,8]{1,0} all-reduce(%g), channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use_global_device_ids=true, to_apply=%add
  %ag = f32[8,8]{1,0} all-gather(%g2), channel_id=2, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}, use_global_device_ids=true
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %ar)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8] parameter(0)
  %w = (s32[], f32[4,8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %rs = bf16[2,8]{1,0} reduce-scatter(%a), channel_id=3, replica_groups={{0,4},{1,5},{2,6},{3,7}}, dimensions={0}, to_apply=%add
  %cp = f32[4,8]{1,0} collective-permute(%a), channel_id=4, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %one = f32[4,8]{1,0} all-reduce(%a), channel_id=5, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, to_apply=%add
  ROOT %r = f32[4,8] copy(%a)
}
"""


def test_parse_every_format_with_trip_counts():
    got = {(c.kind, c.axes): (c.bytes_per_device, c.count)
           for c in parse_collectives(HLO, AXES, SHAPE)}
    assert got == {
        ("all-reduce", ("tensor",)): (4 * 8 * 4, 5),       # inside the 5-trip loop
        ("all-gather", ("data",)): (8 * 8 * 4, 5),         # iota groups {0,4},{1,5},...
        ("reduce-scatter", ("data",)): (2 * 8 * 2 * 2, 1),  # full input = output × group
        ("collective-permute", ("tensor",)): (4 * 8 * 4, 1),
    }


def test_mesh_groups_with_device_ids():
    """`device_ids=` reorders devices over the replica-group mesh (seen with an expert axis)."""
    hlo = HLO.replace(
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
        "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_1'}")
    got = {(c.kind, c.axes) for c in parse_collectives(hlo, AXES, SHAPE)}
    # ids [[0,2,4,6],[1,3,5,7]]: groups vary data and tensor's high bit → spans both.
    assert ("all-reduce", ("data", "tensor")) in got
    explicit = HLO.replace(
        "replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}",
        "replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=(0,1,2,3,4,5,6,7) {'axis_1'}")
    got = {(c.kind, c.axes) for c in parse_collectives(explicit, AXES, SHAPE)}
    assert ("all-reduce", ("tensor",)) in got


# Async pairs, a conditional in a counted loop, and a loop XLA gives no trip count.
BRANCHY = """
HloModule m

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}

%idle (p: f32[4,8]) -> f32[4,8] {
  ROOT %p = f32[4,8] parameter(0)
}

%work (p: f32[4,8]) -> f32[4,8] {
  %p = f32[4,8] parameter(0)
  %ars = f32[4,8]{1,0} all-reduce-start(%p), channel_id=7, replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %ard = f32[4,8]{1,0} all-reduce-done(%ars)
}

%pick (t: s32[6,2], i: s32[], s: s32[]) -> s32[] {
  %t = s32[6,2]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %s = s32[] parameter(2)
  %d = s32[1,1]{1,0} dynamic-slice(%t, %i, %s), dynamic_slice_sizes={1,1}
  ROOT %b = s32[] bitcast(%d)
}

%body (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,8] get-tuple-element(%p), index=1
  %table = s32[6,2]{1,0} constant({ {0, 0}, {1, 0}, {0, 1}, {1, 0}, {0, 1}, {0, 0} })
  %stage = s32[] partition-id()
  %k = s32[] fusion(%table, %i, %stage), kind=kLoop, calls=%pick
  %c = f32[4,8] conditional(%k, %x, %x), branch_computations={%idle, %work}
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %c)
}

%cond (p: (s32[], f32[4,8])) -> pred[] {
  %p = (s32[], f32[4,8]) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

%body2 (p: (s32[], f32[4,8])) -> (s32[], f32[4,8]) {
  %p = (s32[], f32[4,8]) parameter(0)
  %x = f32[4,8] get-tuple-element(%p), index=1
  %ags = (f32[4,8], f32[8,8]) all-gather-start(%x), channel_id=8, replica_groups=[4,2]<=[2,4]T(1,0), dimensions={0}
  %agd = f32[8,8]{1,0} all-gather-done(%ags)
  ROOT %t = (s32[], f32[4,8]) tuple(%i, %x)
}

ENTRY %main (a: f32[4,8]) -> f32[4,8] {
  %a = f32[4,8] parameter(0)
  %w = (s32[], f32[4,8]) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"6"}}
  %w2 = (s32[], f32[4,8]) while(%t0), condition=%cond, body=%body2
  %cps = (f32[4,8], f32[4,8]) collective-permute-start(%a), channel_id=9, source_target_pairs={{0,1},{1,0}}
  %cpd = f32[4,8]{1,0} collective-permute-done(%cps)
  ROOT %r = f32[4,8] copy(%a)
}
"""


def _by_kind(cols):
    return {c.kind: c for c in cols}


def test_async_pairs_count_once_with_their_payload():
    """`-start` carries the op (payload: the output half for all-gather, the buffer for
    a permute); `-done` is not a second collective."""
    got = _by_kind(parse_collectives(BRANCHY, AXES, SHAPE))
    assert set(got) == {"all-reduce", "all-gather", "collective-permute"}
    assert got["collective-permute"].bytes_per_device == 4 * 8 * 4
    assert got["collective-permute"].count == 1
    assert got["all-gather"].bytes_per_device == 8 * 8 * 4     # the gathered output only
    assert got["all-reduce"].bytes_per_device == 4 * 8 * 4


def test_branch_weighted_by_table_lookup():
    """The switch index is table[i, stage]: branch 1 runs on 2 of the 6 iterations at every
    stage, so the branch's all-reduce counts 2 per step, not 6."""
    ar = _by_kind(parse_collectives(BRANCHY, AXES, SHAPE))["all-reduce"]
    assert (ar.count, ar.frequency_known, ar.axes) == (2, True, ("tensor",))


def test_branch_frequency_unknown_is_reported_per_execution():
    """An index that is no table lookup: the op is per run of its named branch, bounded by
    the 6 runs of the conditional, never multiplied into a per-step count."""
    hlo = BRANCHY.replace("%k = s32[] fusion(%table, %i, %stage), kind=kLoop, calls=%pick",
                          "%k = s32[] add(%i, %stage)")
    ar = _by_kind(parse_collectives(hlo, AXES, SHAPE))["all-reduce"]
    assert (ar.count, ar.frequency_known, ar.at_most) == (1, False, 6)
    assert ar.branch == "work (branch 1 of c)"
    assert bytes_over([ar], axis="tensor") == 0
    assert bytes_over([ar], axis="tensor", unknown="at_most") == 6 * 4 * 8 * 4
    # The caller may say how often each branch runs (a pipeline's tick table).
    given = _by_kind(parse_collectives(hlo, AXES, SHAPE, branch_counts=[(3, 3)]))
    assert (given["all-reduce"].count, given["all-reduce"].frequency_known) == (3, True)


def test_table_differing_by_device_is_not_averaged():
    """If stages ran a branch a different number of times the per-device count is not one
    number: reported per execution rather than guessed."""
    hlo = BRANCHY.replace("{ {0, 0}, {1, 0}, {0, 1}, {1, 0}, {0, 1}, {0, 0} }",
                          "{ {0, 0}, {1, 0}, {1, 1}, {1, 0}, {0, 1}, {0, 0} }")
    ar = _by_kind(parse_collectives(hlo, AXES, SHAPE))["all-reduce"]
    assert not ar.frequency_known and ar.at_most == 6


def test_unknown_trip_count_is_reported_unknown():
    ag = _by_kind(parse_collectives(BRANCHY, AXES, SHAPE))["all-gather"]
    assert (ag.count, ag.frequency_known, ag.at_most) == (1, False, None)
    assert "while w2 (trip count unknown)" in ag.branch
    with pytest.raises(ValueError, match="no bound"):
        bytes_over([ag], unknown="at_most")


# A pipeline-like op conditional whose "run" branch has a counted and an uncounted loop.
COSTLY = """
HloModule m

%lbody (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %x = f32[8,16]{1,0} get-tuple-element(%p), index=1
  %w = f32[16,16]{1,0} constant({...})
  %d = f32[8,16]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %t = (s32[], f32[8,16]) tuple(%i, %d)
}

%lcond (p: (s32[], f32[8,16])) -> pred[] {
  %p = (s32[], f32[8,16]) parameter(0)
  ROOT %r = pred[] constant(true)
}

%skip (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  ROOT %p = (s32[], f32[8,16]) parameter(0)
}

%run (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %a = (s32[], f32[8,16]) while(%p), condition=%lcond, body=%lbody, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %b = (s32[], f32[8,16]) while(%a), condition=%lcond, body=%lbody
}

%tick (p: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %p = (s32[], f32[8,16]) parameter(0)
  %k = s32[] get-tuple-element(%p), index=0
  ROOT %c = (s32[], f32[8,16]) conditional(%k, %p, %p), branch_computations={%skip, %run}, metadata={op_name="while/body/pipeline_op_F/cond"}
}

ENTRY %main (a: (s32[], f32[8,16])) -> (s32[], f32[8,16]) {
  %a = (s32[], f32[8,16]) parameter(0)
  ROOT %w = (s32[], f32[8,16]) while(%a), condition=%lcond, body=%tick, backend_config={"known_trip_count":{"n":"4"}}
}
"""


def test_op_cost_loop_of_unknown_trip_count_is_said():
    """One execution of the op: the counted loop's dot 3 times, the uncounted one once —
    and the JSON says which loop was counted once (a lower bound), never silently."""
    from triax.sharding.introspect import op_costs
    costs = op_costs(COSTLY, ("idle", "F"))
    dot = 2 * 8 * 16 * 16
    assert costs["F"]["flops"] == (3 + 1) * dot
    assert costs["F"]["unknown_loops"] == ["b"]
    assert set(costs["idle"]) == {"flops", "bytes"}      # nothing unknown: the plain contract
