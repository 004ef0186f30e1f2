"""Mixed GPU generations (``planner.mixed``, ``triax plan --gpu KIND:N,KIND:N``): the slower
group's stage gets fewer layers, the predicted step beats equal stages, the chosen split
compiles (abstract, 8 simulated devices standing for the two groups) with its peak within
each group's memory, and bad ``--gpu`` strings name the catalogue's kinds."""
import json
import re

import pytest

from triax.cli.main import main
from triax.models import config
from triax.costs import hardware
from triax.costs.hardware import GB, TFLOPS, Catalog, Device, FormFactor
from triax.planner.mixed import plan_mixed
from triax.costs.workload import Workload
from triax.sharding.introspect import memory_from_compiled
from triax.training.config import RunConfig
from triax.training.setup import build_run

# Two made-up kinds: the same memory, the second a third of the first's fp32 FLOP/s.
FAST = Device("fast-gpu", 24 * GB, 300 * TFLOPS, 60 * TFLOPS, 2000 * GB, FormFactor.SXM,
              "nvlink4")
SLOW = Device("slow-gpu", 24 * GB, 100 * TFLOPS, 20 * TFLOPS, 1000 * GB, FormFactor.SXM,
              "nvlink3")
CATALOG = Catalog(devices={**hardware.DEVICES, FAST.name: FAST, SLOW.name: SLOW})


@pytest.fixture(scope="module")
def small_plan():
    w = Workload.of(config.get("tiny", num_layers=4), train=True, dtype="fp32", batch=16,
                    seq=16)
    return plan_mixed(w, hardware.parse_gpu("fast-gpu:4,slow-gpu:4", CATALOG), "dp",
                      catalog=CATALOG)


def test_the_slower_group_gets_fewer_layers_and_a_faster_step(small_plan):
    m = small_plan
    assert [d.name for d in m.stages] == ["fast-gpu", "slow-gpu"]
    assert m.layout.mesh_str == "data=4,pipe=2" and m.equal == (2, 2)
    assert m.seconds_per_layer[1] > m.seconds_per_layer[0]
    assert m.uneven == (3, 1) == m.by_speed
    assert m.uneven_step_s < m.equal_step_s
    assert all(m.fits)
    assert "The timing is modelled" in m.describe()
    assert "--stage-layers 3,1" in m.describe()


def test_the_chosen_split_compiles_within_each_groups_memory(small_plan):
    m = small_plan
    lay = m.layout
    run = RunConfig.of(model="tiny", num_layers=4, mesh=lay.mesh_str, strategy=lay.strategy.name,
                       batch_size=16, seq_len=16, schedule=lay.schedule.value,
                       microbatches=lay.microbatches,
                       stage_layers=",".join(map(str, m.uneven)))
    built = build_run(run)
    assert built.trainer.pipeline.layout.counts == (3, 1)
    peak = memory_from_compiled(built.compiled.step).peak_bytes
    assert 0 < peak <= min(d.memory for d in m.stages)


def test_h100_and_a100_on_the_command_line(capsys):
    """llama3-8b over an H100 group and an A100 group: the A100s' stage gets fewer layers,
    capped by memory below what speed alone would give them, faster than equal stages."""
    assert main(["plan", "--model", "llama3-8b", "--train", "--batch-size", "32", "--remat",
                 "full", "--gpu", "h100-80gb:8,a100-80gb:8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stages"] == ["h100-80gb", "a100-80gb"] and out["timing"] == "modelled"
    fast, slow = out["stage_layers"]
    assert fast > slow and fast + slow == 32 and out["equal_stage_layers"] == [16, 16]
    assert out["speed_only_stage_layers"][1] < slow          # memory moved layers back
    assert out["predicted_step_s"] < out["predicted_equal_step_s"]
    assert all(out["fits"]) and out["memory_per_device"]["total"] <= 80e9


@pytest.mark.parametrize("gpu,match", [
    ("h100-80gb:8,b9000:8", r"unknown GPU 'b9000'; choose one of: h100-80gb, h100-pcie"),
    ("h100-80gb:x,a100-80gb:8", r"give KIND:COUNT groups, comma-separated, e.g. "
                                r"h100-80gb:8,a100-80gb:8 \(COUNT ≥ 1\); kinds: h100-80gb"),
    ("h100-80gb:0,a100-80gb:8", r"COUNT ≥ 1"),
    ("h100-80gb:8", r"is one group: give two or more kinds"),
])
def test_bad_gpu_strings_are_refused(gpu, match, capsys):
    assert main(["plan", "--model", "tiny", "--train", "--gpu", gpu]) == 2
    err = capsys.readouterr().err
    assert err.startswith("triax plan: error:")
    assert re.search(match, err), err


