"""Structural facts of the compiled pipeline step: memory_analysis and HLO collectives."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline.pipelined import Pipeline, PipelineConfig
from triax.sharding.introspect import collectives_from_compiled, memory_from_compiled

CFG = config.TINY.replace(num_layers=2)
b, T = 2, 16  # micro-batch size fixed, so the global batch grows with M


def compile_step(kind, M, mesh):
    pp = Pipeline(CFG, mesh, "dp", PipelineConfig(kind, M))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype), pp.abstract.shapes)
    batch = {k: jax.ShapeDtypeStruct((b * M * pp.data, T), jnp.int32)
             for k in ("inputs", "targets")}
    return pp, jax.jit(pp.loss_and_grad).lower(params, batch).compile()


@pytest.fixture(scope="module")
def steps():
    """1F1B and GPipe at M = 2S and 8S on data=2 × pipe=2, compiled: the temporaries of
    each, and 1F1B M=4's program, whose collectives and loop the structural test reads
    (one compile fewer than a pipe-only mesh for the temporaries: the schedules' memory
    does not depend on data, whose micro-batch per device is the same ``b``)."""
    mesh = make_mesh(data=2, pipe=2, devices=jax.devices()[:4])
    out = {(k, M): compile_step(k, M, mesh) for k in ("1f1b", "gpipe") for M in (4, 16)}
    return mesh, out


@pytest.fixture(scope="module")
def temps(steps):
    return {key: memory_from_compiled(compiled).temp_bytes
            for key, (_, compiled) in steps[1].items()}


def test_1f1b_temporaries_below_gpipe(temps):
    for M in (4, 16):  # M = 2S and 8S
        assert temps[("1f1b", M)] < temps[("gpipe", M)]


def test_1f1b_flat_while_gpipe_grows(temps):
    assert temps[("1f1b", 16)] < 1.1 * temps[("1f1b", 4)]
    assert temps[("gpipe", 16)] > 2 * temps[("gpipe", 4)]


def test_pipe_carries_only_permutes_and_the_scan_is_not_unrolled(steps):
    mesh, programs = steps
    pp, compiled = programs[("1f1b", 4)]
    ticks = pp.schedule.ticks
    colls = collectives_from_compiled(compiled, mesh)
    over_pipe = [c for c in colls if "pipe" in c.axes]
    D = CFG.embed_dim
    # Activations forward and gradients backward: one permute each per tick, b*T*D fp32.
    permutes = [c for c in over_pipe if c.kind == "collective-permute"]
    assert [(c.bytes_per_device, c.count) for c in permutes] == [(b * T * D * 4, 2 * ticks)]
    # The only other traffic over pipe: the loss, and the gradients of the parameters that
    # live on one stage only (embedding on the first, final norm and head on the last).
    others = [c for c in over_pipe if c.kind != "collective-permute"]
    assert {c.kind for c in others} == {"all-reduce"}
    pieces = sum(int(np.prod(s.shape)) * 4 for k, v in pp.abstract.shapes.items()
                 if k != "blocks" for s in jax.tree.leaves(v))
    assert sorted(c.count * c.bytes_per_device for c in others) == [4, pieces]
    # Data-parallel gradient reduction: once per step, not per micro-batch.
    over_data = [c for c in colls if c.axes == ("data",)]
    assert [c.count for c in over_data] == [1] and over_data[0].kind == "all-reduce"
    # The tick loop is one while loop: two permute instructions in the text, run `ticks` times.
    text = compiled.as_text()
    assert len(re.findall(r"\scollective-permute(?:-start)?\(", text)) == 2
    assert f'"known_trip_count":{{"n":"{ticks}"}}' in text
