"""`triax train` runs: learning to the known optimum, the --log-json contract, the same losses
on different meshes, gradient accumulation, metrics helpers and `triax plot` (NaN stops:
test_training_nonfinite.py)."""
import json

import jax
import numpy as np
import pytest

from tree_checks import assert_trees_close
from triax.cli.main import main
from triax.mesh import make_mesh
from triax.models import config as mc
from triax.training import metrics
from triax.training.config import RunConfig
from triax.training.data import load_corpus
from triax.training.loop import train
from triax.training.step import Trainer

MARKOV = ["--model", "tiny", "--num-layers", "1", "--data", "markov", "--batch-size", "16",
          "--seq-len", "32", "--lr", "0.01", "--seed", "0", "--no-progress"]
STEPS = 60


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    """One CLI run on the synthetic Markov task (data=8, dp) with JSONL and TensorBoard."""
    d = tmp_path_factory.mktemp("cli")
    log = d / "run.jsonl"
    rc = main(["train", *MARKOV, "--mesh", "data=8", "--strategy", "dp", "--steps", str(STEPS),
               "--log-json", str(log), "--tensorboard", str(d / "tb")])
    assert rc == 0
    return d, [json.loads(line) for line in log.read_text().splitlines()]


def test_log_json_contract(cli_run):
    _, recs = cli_run
    assert [r["step"] for r in recs] == list(range(1, STEPS + 1))
    for r in recs:
        assert {"step", "loss", "tokens_per_s", "lr", "grad_norm", "step_time_s", "mfu"} <= set(r)
        assert r["tokens_per_s"] > 0 and r["step_time_s"] > 0 and r["mfu"] is None  # CPU: n/a
    assert recs[0]["lr"] == 0.0 and max(r["lr"] for r in recs) == pytest.approx(0.01, rel=1e-5)


def test_synthetic_task_reaches_within_10pct_of_optimal_loss(cli_run):
    _, recs = cli_run
    optimal = load_corpus("markov").info["optimal_loss"]
    assert recs[-1]["val_loss"] <= 1.10 * optimal, (recs[-1]["val_loss"], optimal)
    assert recs[0]["loss"] > 2 * optimal


def test_tensorboard_events_written(cli_run):
    d, _ = cli_run
    assert any(p.name.startswith("events.out.tfevents") for p in (d / "tb").iterdir())


def test_same_losses_on_another_mesh_and_strategy(cli_run):
    _, recs = cli_run
    run = RunConfig.of(model="tiny", num_layers=1, data="markov", batch_size=16, seq_len=32,
                       lr=0.01, seed=0, steps=STEPS, mesh="data=2,tensor=4",
                       strategy="fsdp_tp", progress=False,
                       eval_batches=0)   # the training losses compared: no eval to compile
    res = train(run, note=lambda *_: None)
    other, ref = res.losses, [r["loss"] for r in recs]
    kinds = {(c["kind"], tuple(c["axes"])) for c in res.summary["collectives"]}
    assert ("all-reduce", ("tensor",)) in kinds and res.summary["pipeline"] is None
    np.testing.assert_allclose(other[:10], ref[:10], rtol=1e-5)
    np.testing.assert_allclose(other, ref, rtol=1e-3)


def test_plot_writes_png(cli_run, capsys):
    d, _ = cli_run
    assert main(["plot", str(d / "run.jsonl"), "-o", str(d / "c.png")]) == 0
    assert (d / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_plot_rejects_non_metrics_file(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"a": 1}\n')
    assert main(["plot", str(tmp_path / "x.jsonl")]) == 2
    assert "no step/loss records" in capsys.readouterr().err


def test_gradient_accumulation_matches_one_big_batch(devices):
    cfg = mc.get("tiny", num_layers=1)
    # test_same_losses_on_another_mesh_and_strategy's model, mesh and strategy: its init
    # program (a persistent-cache hit when that test ran first)
    mesh = make_mesh(data=2, tensor=4)
    one = Trainer(cfg, mesh, "fsdp_tp")
    four = Trainer(cfg, mesh, "fsdp_tp", accum_steps=4)
    params = one.init(0)["params"]
    batch = one.shard_batch(one.example_batch(32, 16))
    (l1, _), g1 = jax.jit(one.accumulated_loss_and_grad)(params, batch)
    (l4, _), g4 = jax.jit(four.accumulated_loss_and_grad)(params, batch)
    np.testing.assert_allclose(l4, l1, rtol=1e-5)
    assert_trees_close(g4, g1, rtol=1e-4, atol=1e-7, what="accumulated grads")


# A NaN loss stopping the run (naming the step and batch, keeping the last good checkpoint,
# the fixes named) is test_training_nonfinite.py's test_stop_names_step_and_batch: the loop
# checks the loss, not what made it NaN, so a diverging --lr takes that very path.


def test_mfu_and_peak_table():
    assert metrics.peak_flops_per_device("NVIDIA H100 80GB HBM3") == 989e12
    assert metrics.peak_flops_per_device("NVIDIA H100 PCIe") == 756e12
    assert metrics.peak_flops_per_device("TPU v5 lite") == 197e12
    assert metrics.peak_flops_per_device("cpu") is None
    assert metrics.mfu(1e12, 1.0, 2, 1e12) == 0.5
    assert metrics.mfu(1e12, 1.0, 2, None) is None and metrics.fmt_mfu(None) == "n/a"
