"""The planner knows host offload (``Layout.offload``): its device memory for an offloaded
layout against the compiled step's (memory_analysis, host ``S(5)`` arguments split off), its
host bytes against the offloaded state's, the host link's seconds in the step time,
``triax plan --offload`` showing both, and ``--plan auto`` choosing offload only when no
plan that keeps the state on the device compiles within the budget (8 simulated devices,
tiny shapes; the auto cases share ``test_plan_auto``'s run, search and compiles)."""
import pytest

from triax.cli.main import main
from triax.costs import hardware
from triax.costs.memory import estimate
from triax.costs.offload import host_link, planned_cost
from triax.costs.workload import Layout, Workload
from triax.models import config
from triax.planner import auto
from triax.planner.evaluate import evaluate
from triax.planner.verify import compile_figures
from triax.training.config import RunConfig
from triax.units import human_bytes

W = Workload.of(config.get("tiny", num_layers=2), train=True, dtype="fp32", batch=16, seq=32,
                backend="cpu")
CASES = {"dp-optimizer": Layout(data=8, strategy="dp", offload=("optimizer",)),
         "fsdp-optimizer-params": Layout(data=8, strategy="fsdp",
                                         offload=("optimizer", "params"))}
STEP_COUNT_BYTES = 4   # the state's int32 step count: on the device, not a modelled term


@pytest.mark.parametrize("key", list(CASES))
def test_offloaded_memory_matches_the_compiled_step(devices, key):
    """Within the unpipelined rows' tolerances (``test_planner_model``: the state 2%, the
    peak 15%); the host bytes exactly the compiled step's host arguments."""
    lay = CASES[key]
    got = compile_figures(W, lay)["memory"]
    mem = estimate(W, lay)
    batch_bytes = 2 * (W.batch // lay.batch_shards) * W.seq * 4
    state = got["argument_bytes"] - batch_bytes - STEP_COUNT_BYTES
    assert mem.params + mem.optimizer == pytest.approx(state, rel=0.02), key
    assert mem.modelled == pytest.approx(got["peak_bytes"], rel=0.15), key
    assert mem.host == got["host_argument_bytes"] == planned_cost(W, lay).host_bytes > 0, key


def test_step_time_adds_the_host_links_seconds():
    cluster = hardware.cluster("h100-80gb", 8, 1)
    plain, lay = Layout(data=8, strategy="fsdp"), CASES["fsdp-optimizer-params"]
    cost = planned_cost(W, lay, host_link(cluster.device))
    assert cost.link_s > 0 and evaluate(W, lay, cluster).offload == cost
    assert evaluate(W, lay, cluster).step_time_s - evaluate(W, plain, cluster).step_time_s \
        == pytest.approx(cost.seconds, rel=1e-9)


def test_plan_prints_host_bytes_and_link_time(capsys):
    assert main(["plan", "--gpu", "h100-80gb", "--mesh", "data=8", "--strategy", "fsdp",
                 "--offload", "optimizer", "--batch-size", "16", "--seq-len", "32",
                 "--num-layers", "2"]) == 0
    out = capsys.readouterr().out
    cost = planned_cost(Workload.of(config.get("tiny", num_layers=2), train=True,
                                    dtype="fp32", batch=16, seq=32),
                        Layout(data=8, strategy="fsdp", offload=("optimizer",)),
                        hardware.LINKS["pcie5"])
    line = next(s for s in out.splitlines() if s.strip().startswith("host offload"))
    assert f"host {human_bytes(cost.host_bytes)} per device" in line, out
    assert f"host link {human_bytes(cost.link_bytes)} per step ({cost.link_s * 1e3:.3g} ms" \
        in line, out


RUN = RunConfig.of(model="tiny", num_layers=1, batch_size=8, seq_len=16, steps=3, plan="auto",
                   data="markov", progress=False, eval_batches=0)
GIVEN = frozenset({"model", "num_layers", "batch_size", "seq_len", "steps", "plan"})


def _choose(mib: float):
    return auto.choose_train(RUN, GIVEN, budget=auto.Budget(int(mib * (1 << 20)), "a test"))


def test_auto_offloads_only_when_nothing_on_the_device_fits():
    """0.35 MiB: no plan keeping the state on the device fits (by the model, or refused by
    its compile), an offloaded one does, proved by its compile."""
    c = _choose(0.35)
    assert c.run.layout.offload and c.plan.layout.offload, auto.label(c.plan)
    assert c.compiled.peak_bytes <= c.budget.usable
    assert c.compiled.host_argument_bytes == c.plan.memory.host > 0
    assert all(x.plan.layout.offload or x.compiled_peak > c.budget.usable for x in c.refused)
    assert "host offload was searched" in c.describe() and "Offloaded to the host" in \
        c.describe()
    assert c.to_json()["offload"] == c.run.layout.offload


def test_auto_keeps_the_state_on_the_device_when_a_plan_fits():
    """0.6 MiB: an offloaded plan would rank faster by the model (tp_sp offloading its
    optimizer state beats the fsdp_tp_sp that fits), but a plan keeping the state on the
    device compiles within the budget, so it is chosen."""
    c = _choose(0.6)
    assert not c.run.layout.offload and not c.plan.layout.offload, auto.label(c.plan)
    assert c.compiled.peak_bytes <= c.budget.usable and c.compiled.host_argument_bytes == 0
