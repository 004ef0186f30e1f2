"""A compiled step's collectives as if it had one more scanned layer, read from the one
program: the layer stack is a ``while`` loop (forward and backward scan) whose
``known_trip_count`` multiplies what its body runs (``sharding.introspect.hlo``), so raising
that count by one adds exactly one block's collectives. The step of ``L + 1`` layers compiles
the same loop bodies (checked against a real 3-layer step when this helper was written:
identical per-(kind, axes) totals), so "per block" needs no second compile."""
import re

from triax.sharding.introspect.hlo import parse_collectives
from triax.sharding.introspect.hlo_text import compiled_text

_TRIP = '"known_trip_count":{{"n":"{}"}}'


def with_one_more_layer(compiled, mesh, layers: int, loops: int = 2):
    """``(as compiled, with one more layer)``: two lists of ``Collective``. ``loops``: how many
    loops of ``layers`` trips the step holds (2: forward and backward scans; 1: a forward).
    Fails when another loop shares the layer count, which would be raised too."""
    text = compiled_text(compiled)
    found = text.count(_TRIP.format(layers))
    assert found == loops, f"{found} loops of {layers} trips, expected {loops} (the layer scans)"
    more = text.replace(_TRIP.format(layers), _TRIP.format(layers + 1))
    axes, shape = mesh.axis_names, mesh.devices.shape
    return parse_collectives(text, axes, shape), parse_collectives(more, axes, shape)
