"""`triax inspect` contract, and the CLI's simulated-device start-up (in subprocesses, since
the device count is fixed when JAX starts)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
from suite_env import strict_env

from triax.cli.main import main
from triax.sharding.introspect.memory import MemoryReport
from triax.sharding.introspect.step_report import StepReport


# The contract's run; the text tables and the LoRA test's control repeat it (persistent-cache
# hits).
CONTRACT = ["inspect", "--model", "tiny", "--num-layers", "1", "--mesh", "data=2,tensor=4",
            "--strategy", "tp", "--batch-size", "8", "--seq-len", "16", "--json"]


def test_inspect_json_contract(capsys, devices):
    assert main(CONTRACT) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report) >= {"collectives", "memory", "params"}
    assert {"kind", "axes", "bytes_per_device", "count", "frequency_known", "branch",
            "at_most"} == set(report["collectives"][0])
    assert report["op_costs"] == {}   # not pipelined
    assert any(c["kind"] == "all-reduce" and c["axes"] == ["tensor"] for c in report["collectives"])
    assert set(report["params"][0]) == {"path", "logical_axes", "spec", "global_shape",
                                        "shard_shape", "bytes_per_device"}


@pytest.mark.parametrize("schedule,kinds", [("1f1b", {"F", "B"}),
                                             ("zb-h1", {"F", "B_in", "W"})])
def test_inspect_json_op_costs_for_a_pipelined_step(capsys, devices, schedule, kinds):
    """Issue 12 contract: a pipelined step's report has ``op_costs`` per op kind the schedule
    uses (one execution on stage 0), measured on the compiled tick switch's branches."""
    assert main(["inspect", "--model", "tiny", "--num-layers", "2", "--mesh",
                 "data=4,pipe=2", "--schedule", schedule, "--microbatches", "4",
                 "--batch-size", "16", "--seq-len", "16", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    costs = report["op_costs"]
    assert set(costs) == kinds
    assert all(set(c) == {"flops", "bytes"} for c in costs.values())
    assert all(c["flops"] > 0 and c["bytes"] > 0 for c in costs.values())
    backward = costs["B"]["flops"] if "B" in costs else \
        costs["B_in"]["flops"] + costs["W"]["flops"]
    assert backward == pytest.approx(2 * costs["F"]["flops"], rel=0.05)
    # collectives keep bytes per op and count per step
    assert all({"bytes_per_device", "count"} <= set(c) for c in report["collectives"])


def test_inspect_text_shows_op_costs():
    report = StepReport("pipe=2", "dp", [], MemoryReport(1, 2, 3, 4, 5),
                        op_costs={"F": {"flops": 2e9, "bytes": 1024},
                                  "B": {"flops": 4e9, "bytes": 2048}})
    text = report.to_text()
    assert "cost of one pipeline op on stage 0" in text
    assert any(line.split()[:2] == ["B", "4.0000"] for line in text.splitlines())


def test_inspect_text_tables(capsys, devices):
    """The contract's run as text (its step a persistent-cache hit): the header names the
    attention implementation the step runs, ``auto`` resolved for the backend."""
    from triax.models.attention import resolve
    assert main([a for a in CONTRACT if a != "--json"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].endswith(f"attention {resolve('auto')}")
    assert "communication per step" in out and "placement" in out and "memory per device" in out


def test_bad_mesh_says_device_count(capsys, devices):
    assert main(["inspect", "--mesh", "data=3", "--num-layers", "1"]) == 2
    err = capsys.readouterr().err
    assert "triax inspect: error:" in err and "JAX sees 8 device(s)" in err


def _run_cli(args, env_extra):
    """``python -m triax args`` with no device count set, and the test process's JAX settings
    and XLA flags (so it compiles the programs this process did: persistent-cache hits)."""
    env = strict_env({k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"})
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "device_count" not in f)
    env.update(env_extra)
    return subprocess.run([sys.executable, "-m", "triax", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_cli_simulates_8_devices_and_says_so():
    r = _run_cli(CONTRACT, {"JAX_PLATFORMS": "cpu"})   # the contract's run: its compile reused
    assert r.returncode == 0, r.stderr
    assert "simulating 8 CPU devices" in r.stderr


def test_cli_respects_user_device_count():
    r = _run_cli(["inspect", "--num-layers", "1", "--mesh", "data=8"],
                 {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": "4"})
    assert r.returncode == 2
    assert "simulating" not in r.stderr and "JAX sees 4 device(s)" in r.stderr


def test_flags_come_from_run_config_and_the_parser_does_not_load_jax():
    """Every RunConfig field is a `triax train` flag; building the parser leaves JAX unloaded
    (the simulated device count is set later, when a command runs)."""
    code = textwrap.dedent("""
        import sys
        from triax.cli.main import build_parser
        from triax.configs import leaves
        from triax.training.config import RunConfig
        parser = build_parser()
        train = parser._subparsers._group_actions[0].choices["train"]
        dests = {a.dest for a in train._actions}
        missing = set(leaves(RunConfig)) - dests
        assert not missing, missing
        assert not any(m == "jax" or m.startswith("jax.") for m in sys.modules), "jax loaded"
    """)
    subprocess.run([sys.executable, "-c", code], check=True)


def _inspect(capsys, *flags) -> dict:
    assert main(["inspect", "--model", "tiny", "--num-layers", "2", "--seq-len", "16", "--json",
                 *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_inspect_shows_the_lora_step(capsys, devices):
    """--lora-rank shapes the step (adapters beside the frozen base), so inspect takes it;
    without it (the contract's run) no adapter."""
    def params(*flags):
        assert main([*CONTRACT, *flags]) == 0
        return {p["path"] for p in json.loads(capsys.readouterr().out)["params"]}
    paths = params("--lora-rank", "4", "--lora-targets", "q_proj")
    assert "blocks/attn/lora_q_proj/a" in paths and "blocks/attn/lora_k_proj/a" not in paths
    assert not any("lora" in p for p in params())


def test_inspect_shows_the_pipeline_fsdp_step(capsys, devices):
    """--pipeline-fsdp layer gathers each layer's weights per op, stage once per step."""
    mesh = ["--mesh", "data=4,pipe=2", "--strategy", "fsdp", "--batch-size", "16"]
    layer, stage = (_inspect(capsys, *mesh, "--pipeline-fsdp", mode) for mode in ("layer", "stage"))
    assert (layer["memory"], layer["collectives"]) != (stage["memory"], stage["collectives"])
