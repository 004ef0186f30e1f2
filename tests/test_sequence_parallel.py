"""Megatron sequence parallelism (``tp_sp``, ``fsdp_tp_sp``): the residual stream split over
``tensor`` along the sequence. Equal to one device (loss and every gradient, fp32), and the
compiled step stores the residual stream split (all-gathers over ``tensor`` along the
sequence, fewer temporaries than TP)."""
import jax
import numpy as np
import pytest
from layer_collectives import with_one_more_layer
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline.pipelined import PipelineConfig
from triax.costs.memory import estimate
from triax.planner.verify import compile_figures, run_config
from triax.costs.workload import Layout, Workload
from triax.training.setup import build_run
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
B, T = 8, 16


def loss_and_grads(trainer, params):
    (loss, _), grads = trainer.grads(params, trainer.example_batch(B, T, seed=0))
    return float(loss), jax.device_get(grads)


@pytest.fixture(scope="module")
def reference(devices):
    """The one-device loss and gradients, and the parameters (on the host) every run takes:
    one init compile for the file."""
    tr = Trainer(CFG, make_mesh(devices=devices[:1]), "dp")
    params = jax.device_get(tr.init(seed=0)["params"])
    return (*loss_and_grads(tr, params), params)


# fsdp_tp_sp only: it runs tp_sp's rules (the residual stream split over tensor along the
# sequence, the blocks' Megatron split) with the weights also sharded over data; tp_sp's own
# rules run in test_pipelined_sequence_parallel_matches_single_device below.
@pytest.mark.parametrize("strategy", ["fsdp_tp_sp"])
def test_sequence_parallel_matches_single_device(reference, strategy):
    ref_loss, ref_grads, params = reference
    loss, grads = loss_and_grads(Trainer(CFG, make_mesh(data=2, tensor=4), strategy), params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what="gradients")


# A shape where the residual stream dominates the saved activations (wide D, short T).
WIDE = config.TINY.replace(embed_dim=512)
WB, WT = 16, 64     # 8 sequences per data rank


def workload(layers):
    return Workload.of(WIDE.replace(num_layers=layers), train=True, dtype="fp32", batch=WB,
                       seq=WT)


@pytest.fixture(scope="module")
def compiled(devices):
    """The 2-layer training step at data=2 × tensor=4 for TP and SP, built as the planner's
    ``compile_figures`` builds a plan's (``build_run``): the SP step is the one
    test_planner_models_the_sequence_parallel_saving reads, compiled once."""
    runs = {st: build_run(run_config(workload(2), Layout(data=2, tensor=4, strategy=st)),
                          workload(2).cfg) for st in ("tp", "tp_sp")}
    return runs["tp"].mesh, {k: r.compiled.step for k, r in runs.items()}


def test_sequence_parallel_halves_temporaries(compiled):
    """The residual stream (norms, residual adds, the attention and MLP outputs) is stored
    split over tensor=4: the step's temporaries drop to about half of TP's (0.56 measured for
    tiny with D=512, 8 sequences of T=64 per data rank, 2 layers)."""
    _, c = compiled
    temp = {st: c[st].memory_analysis().temp_size_in_bytes for st in ("tp", "tp_sp")}
    assert temp["tp_sp"] < 0.6 * temp["tp"], temp


def test_sequence_parallel_gathers_the_sequence_per_block(compiled):
    """Each block gathers its split residual stream over ``tensor`` before the column-parallel
    matmuls (forward and backward); TP gathers no activation per block. Per block: the
    2-layer step's collectives with its layer scans run once more (``layer_collectives``)."""
    mesh, c = compiled

    def per_block(st):
        two, three = with_one_more_layer(c[st], mesh, layers=2)
        return {kind: sum(x.count for x in three if x.kind == kind and "tensor" in x.axes)
                - sum(x.count for x in two if x.kind == kind and "tensor" in x.axes)
                for kind in ("all-gather", "all-reduce", "reduce-scatter")}
    tp, sp = per_block("tp"), per_block("tp_sp")
    assert sp["all-gather"] >= tp["all-gather"] + 4, (tp, sp)


def test_pipelined_sequence_parallel_matches_single_device(reference):
    """data=2 × tensor=2 × pipe=2: the stages run the block with the residual stream split."""
    ref_loss, ref_grads, params = reference
    tr = Trainer(CFG, make_mesh(data=2, tensor=2, pipe=2), "tp_sp", pipeline=PipelineConfig())
    loss, grads = loss_and_grads(tr, params)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    assert_trees_close(grads, ref_grads, rtol=1e-5, atol=1e-7, what="pipelined gradients")


def test_planner_models_the_sequence_parallel_saving(devices):
    """The planner's activation term splits the residual stream as the rules do; its
    prediction for the SP step is within 5% of memory_analysis (TP's and SP's compiled peaks
    are ~28.2 and ~17.1 MB here)."""
    w = workload(2)
    lay = Layout(data=2, tensor=4, strategy="tp_sp")
    got = compile_figures(w, lay)["memory"]["peak_bytes"]
    assert estimate(w, lay).modelled == pytest.approx(got, rel=0.05)
    assert estimate(w, lay).activations < 0.6 * estimate(w, Layout(data=2, tensor=4, strategy="tp")).activations
