"""The HLO collective parser on hand-written HLO covering every replica-group format."""
from triax.sharding.introspect import parse_collectives

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
