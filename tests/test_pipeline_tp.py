"""Tensor parallelism survives the pipeline: under ``fsdp_tp`` the executor's FSDP gather runs
over ``data`` only, and each weight stays split over ``tensor`` inside the stage.

Equality with one device under the same layout: ``test_pipeline_executor.py::
test_3d_mesh_train_step``."""
import math

import pytest

from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline.pipelined import PipelineConfig
from triax.sharding.introspect.hlo import collectives_from_compiled
from triax.training.step import Trainer

SIZES = {"data": 2, "pipe": 2, "tensor": 2}


@pytest.fixture(scope="module")
def step():
    mesh = make_mesh(**SIZES)
    tr = Trainer(config.TINY.replace(num_layers=4), mesh, "fsdp_tp",
                 pipeline=PipelineConfig("1f1b", 4))
    return tr, collectives_from_compiled(tr.lower(8, 16).compile(), mesh)


def _axes(entry):
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def _ideal_gathers(tr) -> list[int]:
    """Per-device bytes of each weight as the stage uses it, for the weights FSDP splits over
    data: the global size over the stages (blocks) and over every other axis it is split on."""
    out = []
    for row in tr.placement():
        axes = [a for e in row.spec for a in _axes(e)]
        if "data" not in axes:
            continue
        split = math.prod(SIZES[a] for a in axes if a != "data")
        out.append(math.prod(row.global_shape) * 4 // split)
    return sorted(out)


def test_no_weight_is_gathered_over_tensor(step):
    _, colls = step
    assert [c for c in colls if c.kind == "all-gather" and "tensor" in c.axes] == []


def test_gathers_over_data_are_fsdp_ideal_and_weights_stay_split_over_tensor(step):
    tr, colls = step
    gathers = sorted(c.bytes_per_device for c in colls if c.kind == "all-gather"
                     for _ in range(c.count))
    assert all(c.axes == ("data",) for c in colls if c.kind == "all-gather")
    # Each gathered weight is its stage's share over tensor: wq [Lc, D, N, H] at N/tensor, …
    assert gathers == _ideal_gathers(tr)
    # and together they are a stage's weights over tensor (blocks) plus the pieces'.
    blocks = sum(math.prod(r.global_shape) * 4 // SIZES["pipe"] for r in tr.placement()
                 if r.path.startswith("blocks/") and "data" in r.spec)
    pieces = sum(math.prod(r.global_shape) * 4 for r in tr.placement()
                 if not r.path.startswith("blocks/") and "data" in r.spec)
    assert sum(gathers) * SIZES["tensor"] == blocks + pieces
    # The gradients leave the same way: one reduce-scatter over data per gathered weight.
    scatters = [c for c in colls if c.kind == "reduce-scatter"]
    assert all(c.axes == ("data",) for c in scatters)
    assert sum(c.count * c.bytes_per_device for c in scatters) == sum(gathers)
