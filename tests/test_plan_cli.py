"""``triax plan`` as a new user first runs it: no flags plans for the devices present with
train's defaults, on one readable screen."""
import pytest

from triax.cli.main import build_parser, main
from triax.cli.plan_cmd import plan_inputs
from triax.training.config import RunConfig


def test_no_flags_means_train_defaults():
    inp = plan_inputs(build_parser().parse_args(["plan"]))
    d = RunConfig()
    got, want = inp.run.flat(), d.flat()
    keys = ("batch_size", "seq_len", "precision")
    assert (inp.model, *map(got.get, keys)) == (want["model"], *map(want.get, keys)) == \
        ("tiny", 16, 128, "fp32")
    assert not inp.plan.inference and inp.plan.gpu is None and inp.layout == {}


def _screen(capsys, *flags):
    assert main(["plan", *flags]) == 0
    return capsys.readouterr().out


def test_no_flags_plans_for_the_devices_present(capsys):
    """Once it failed three ways in a row (--gpu required, then --gpus-per-node and --nodes,
    then "unknown GPU 'cpu'")."""
    out = _screen(capsys)
    assert "tiny (train, fp32, batch 16 × seq 128) on 1 node(s) × 8 cpu (this machine)" in out
    assert "devices: the 8 present" in out and "cpu timings are not modelled" in out
    assert out.count("Pipeline bubbles") == 1   # one line for every schedule's op costs
    assert "tok/s" not in out


def test_the_screen_with_a_mesh(capsys):
    """A given mesh on the devices present: the table's throughput in human units."""
    out = _screen(capsys, "--mesh", "data=8", "--strategy", "dp")
    row = next(line for line in out.splitlines() if line.startswith(" 1 data=8 dp"))
    assert row.split()[-1][-1] in "kMGT", row      # e.g. 69.1M, not 69123456
    assert "memory check counts" not in out and "2 devices" not in out
    assert "devices: the 8 present" in out


def test_one_kind_defaults_to_one_node_of_eight(capsys):
    out = _screen(capsys, "--gpu", "h100-80gb", "--mesh", "data=8", "--strategy", "dp")
    assert "1 node(s) × 8 h100-80gb" in out and "time model" not in out


def test_dtype_is_precision():
    assert plan_inputs(build_parser().parse_args(["plan", "--dtype", "bf16"])).run.compute.precision \
        == "bf16"


@pytest.mark.parametrize("flags,match", [
    (["--kv-blocks", "4"], "--kv-blocks sizes serving's KV pool"),
    (["--train", "--inference"], "not allowed with argument"),
])
def test_refused(flags, match, capsys):
    with pytest.raises(SystemExit) if "--inference" in flags else pytest.raises(ValueError,
                                                                               match=match):
        plan_inputs(build_parser().parse_args(["plan", *flags]))
