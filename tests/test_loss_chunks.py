"""The loss over slices of the sequence (``ExecConfig.loss_chunks``, ``models.loss``) equals
the whole-sequence loss: loss, every gradient and 3 steps of parameters, fp32, on one
device, under context × tensor × sequence parallelism, with loss weights and packed
documents, and through the pipeline's last stage; and the compiled step holds only a
slice's logits (temporaries fall by what the whole sequence's fp32 logits would take)."""
import dataclasses

import jax
import numpy as np
import pytest
from step_grads import first_step_grads
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import config
from triax.models.runtime import ExecConfig
from triax.pipeline.pipelined import PipelineConfig
from triax.sharding.rules import get_strategy
from triax.training.config import RunConfig
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
B, T = 4, 32


def run(trainer, init, weights=False, n_steps=3):
    """The loss and gradients at the initial parameters (the first step's, its gradients read
    from the optimizer: one compile) and the parameters after ``n_steps`` steps, from
    ``init`` (the one-device initial state, placed: no init compile per mesh)."""
    state = trainer.place(init)
    batches = [trainer.example_batch(B, T, seed=i) for i in range(n_steps)]
    if weights:     # a prompt-masked batch: the first quarter of each row has no loss
        for b in batches:
            b["weights"] = (np.arange(T)[None] >= T // 4).astype(np.float32).repeat(B, 0)
    for i, b in enumerate(batches):
        state, m = trainer.step(state, b)
        if i == 0:
            loss, grads = float(m["loss"]), first_step_grads(trainer, state, m)
    return loss, grads, jax.device_get(state["params"])


def check(out, ref):
    np.testing.assert_allclose(out[0], ref[0], rtol=1e-5)
    assert_trees_close(out[1], ref[1], rtol=1e-5, atol=1e-7, what="gradients")
    assert_trees_close(out[2], ref[2], rtol=1e-5, atol=1e-6, what="params after 3 steps")


@pytest.fixture(scope="module")
def init(devices):
    """The one-device initial train state on the host, every run's start
    (test_sharded_init.py: each mesh's own init is the same state)."""
    return jax.device_get(Trainer(CFG, make_mesh(devices=devices[:1]), "dp").init(seed=0))


@pytest.fixture(scope="module")
def reference(devices, init):
    return {w: run(Trainer(CFG, make_mesh(devices=devices[:1]), "dp"), init, weights=w)
            for w in (False, True)}


# Each path once: the chunked loss has one call site (``Transformer.head_loss`` ->
# ``models.loss.head_nll_sum``), run unpipelined and weighted here under context × tensor ×
# sequence parallelism, and unweighted on the pipeline's last stage below (one device
# unweighted is no case of its own: the same scan, and ``head_nll_sum``'s docstring example
# checks it against the whole sequence). The number of chunks is the length of the one scan
# over slices (2, 4 and 8 run the same code).
@pytest.mark.parametrize("chunks, strategy, mesh, weights", [
    (8, "fsdp_tp_sp", dict(context=2, tensor=2, data=2), True),
])
def test_chunked_loss_matches_the_whole_sequence(reference, init, devices, chunks, strategy,
                                                  mesh, weights):
    st = dataclasses.replace(get_strategy(strategy), context_attention="ring")
    m = make_mesh(**mesh) if mesh else make_mesh(devices=devices[:1])
    out = run(Trainer(CFG, m, st, exe=ExecConfig(loss_chunks=chunks)), init, weights=weights)
    check(out, reference[weights])


def test_chunked_loss_through_the_pipeline(reference, init, devices):
    tr = Trainer(CFG, make_mesh(devices=devices[:4], data=2, pipe=2), "dp", pipeline=PipelineConfig("1f1b", 2),
                 exe=ExecConfig(loss_chunks=4))
    check(run(tr, init), reference[False])


# A vocabulary large against the width, as in real models (llama3: 128,256 against 4,096),
# so the logits, not attention, set the step's peak.
BIG_VOCAB = CFG.replace(vocab_size=8192, num_layers=1)


def _temporaries(chunks, seq):
    tr = Trainer(BIG_VOCAB, make_mesh(data=8), "dp", exe=ExecConfig(loss_chunks=chunks))
    return tr.lower(8, seq).compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_holds_one_slice_of_logits():
    # One sequence per device: 256 tokens × 8192 vocab of fp32 logits is 8 MiB, and the
    # unchunked step keeps logits, log-probabilities and their gradient alive together
    # (the three the planner counts, costs.activations.activation_bytes).
    seq, chunks = 256, 8
    logits = seq * BIG_VOCAB.vocab_size * 4
    saved = _temporaries(1, seq) - _temporaries(chunks, seq)
    assert saved >= 3 * logits * (1 - 1 / chunks), (saved, logits)


def test_loss_chunks_must_divide_the_sequence():
    with pytest.raises(ValueError, match=r"--loss-chunks 3: must be ≥ 1 and divide the "
                                         r"sequence length 32"):
        RunConfig.of(seq_len=32, loss_chunks=3).exec_config()
