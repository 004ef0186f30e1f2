"""``loop_bytes`` on hand-written HLO: an accumulator carried through a conditional nested in
an op's branch (B_in's ordering conditional) is in place where every inner branch passes it
through or updates it; an inner branch that returns a new buffer makes it fresh."""
import pytest

from triax.sharding.introspect.loop_bytes import loop_bytes

HLO = """
%add (p0: f32[64]) -> f32[64] {
  %p0 = f32[64]{0} parameter(0)
  ROOT %s = f32[64]{0} add(%p0, %p0)
}
%inner_run (p: (f32[64])) -> (f32[64]) {
  %p = (f32[64]{0}) parameter(0)
  %a = f32[64]{0} get-tuple-element(%p), index=0
  %s = f32[64]{0} fusion(%a), kind=kLoop, calls=%add
  ROOT %t = (f32[64]{0}) tuple(%s)
}
%inner_skip (p: (f32[64])) -> (f32[64]) {
  %p = (f32[64]{0}) parameter(0)
  %a = f32[64]{0} get-tuple-element(%p), index=0
  ROOT %t = (f32[64]{0}) tuple(%a)
}
%inner_zeros (p: (f32[64])) -> (f32[64]) {
  %p = (f32[64]{0}) parameter(0)
  %c = f32[] constant(0)
  %z = f32[64]{0} broadcast(%c), dimensions={}
  ROOT %t = (f32[64]{0}) tuple(%z)
}
%outer_skip (p: (s32[], f32[64])) -> (f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %a = f32[64]{0} get-tuple-element(%p), index=1
  ROOT %t = (f32[64]{0}) tuple(%a)
}
%outer_run (p: (s32[], f32[64])) -> (f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[64]{0} get-tuple-element(%p), index=1
  %o = (f32[64]{0}) tuple(%a)
  %c = (f32[64]{0}) conditional(%i, %o, %o), branch_computations={%SKIP, %inner_run}
  %r = f32[64]{0} get-tuple-element(%c), index=0
  ROOT %t = (f32[64]{0}) tuple(%r)
}
%body (p: (s32[], f32[64])) -> (s32[], f32[64]) {
  %p = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %a = f32[64]{0} get-tuple-element(%p), index=1
  %o = (s32[], f32[64]{0}) tuple(%i, %a)
  %c = (f32[64]{0}) conditional(%i, %o, %o), branch_computations={%outer_skip, %outer_run}
  %r = f32[64]{0} get-tuple-element(%c), index=0
  ROOT %t = (s32[], f32[64]{0}) tuple(%i, %r)
}
%cond (p: (s32[], f32[64])) -> pred[] {
  %p = (s32[], f32[64]{0}) parameter(0)
  ROOT %r = pred[] constant(true)
}
ENTRY %main (x: (s32[], f32[64])) -> (s32[], f32[64]) {
  %x = (s32[], f32[64]{0}) parameter(0)
  ROOT %w = (s32[], f32[64]{0}) while(%x), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
}
"""


@pytest.mark.parametrize("skip, fresh", [("inner_skip", 0), ("inner_zeros", 256)])
def test_accumulator_through_a_nested_conditional(skip, fresh):
    assert loop_bytes(HLO.replace("%SKIP", "%" + skip)).fresh_results == fresh
