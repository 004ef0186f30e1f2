"""``triax train --plan auto --plan-gpu KIND:N,KIND:N`` (issue 38): the mixed-generation split
``planner.mixed`` proposes is the run, proved by compile on the simulated devices standing for
the groups, and it trains. tiny with 4 layers over an H100 group and an A100 group of 4: the
A100s' stage gets one layer."""
import json

import pytest

from triax.cli.main import main
from triax.training.config import RunConfig

ARGS = ["train", "--model", "tiny", "--num-layers", "4", "--batch-size", "16", "--seq-len",
        "16", "--strategy", "dp", "--plan", "auto", "--plan-gpu", "h100-80gb:4,a100-80gb:4"]


def test_the_mixed_split_is_compiled_and_runs(capsys):
    assert main(ARGS + ["--json", "--steps", "1", "--data", "markov", "--no-save",
                        "--eval-batches", "0", "--no-progress"]) == 0
    out = capsys.readouterr().out
    got = json.loads(out[:out.index("\n}") + 2])
    assert (got["stage_layers"], got["mesh"]) == ("3,1", "data=4,pipe=2"), got
    assert got["mixed"]["stages"] == ["h100-80gb", "a100-80gb"]
    assert 0 < got["compiled_peak_bytes"] <= got["usable_bytes"]
    assert got["budget_source"].startswith("the smallest memory of the --plan-gpu groups")
    assert "loss" in out[out.index("\n}") + 2:]        # the run trained its step


def test_groups_must_be_the_devices_present():
    from triax.planner.auto_mixed import choose_mixed
    run = RunConfig(model="tiny", num_layers=4, batch_size=16, seq_len=16, plan="auto",
                    plan_gpu="h100-80gb:8,a100-80gb:8")
    with pytest.raises(ValueError, match="16 devices, but JAX has 8"):
        choose_mixed(run, frozenset({"model"}))


def test_stage_layers_with_plan_auto_only_for_groups():
    with pytest.raises(ValueError, match="--plan auto lays out only for mixed generations"):
        RunConfig(model="tiny", num_layers=4, plan="auto", stage_layers="3,1")
    with pytest.raises(ValueError, match="--plan-gpu 'h100-80gb'"):
        from triax.planner.auto_mixed import mixed_groups
        mixed_groups(RunConfig(plan="auto", plan_gpu="h100-80gb"))
