"""``--lora-dropout p``: PEFT's ``B(A(dropout(x)))·alpha/r`` in training steps, with masks
drawn from per-token seeds of the step (``models.lora.dropout_seeds``) and the layer's index
in the whole stack, so tensor × pipe (1F1B over uneven stages, ZB-V's split backward in its
routed V, interleaved over padded chunks) equals one device with dropout on
(loss, adapter gradients, 3 steps; fp32); eval and decode never drop."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from lora_helpers import run_steps, start_state
from tree_checks import assert_trees_close

from triax.inference.reference import greedy_reference
from triax.mesh import make_mesh
from triax.models import config, lora, runtime
from triax.models.config import LoraConfig
from triax.pipeline.pipelined import PipelineConfig
from triax.training.config import RunConfig
from triax.training.step import Trainer

P = 0.25
# One target of each kind of adapter input: q's is whole on every tensor rank, o's (heads ×
# head dim) and down's (MLP dim) are split over tensor, so their masks must be drawn for
# global positions. The adapters' own layouts on every target are test_lora.py's; here
# each target adds only program size (the ZB-V step: 7 targets 703 fusions, 10.1 CPU-s
# to lower and compile; q and down 391, 6.9 CPU-s).
TARGETS = ("q_proj", "o_proj", "down_proj")
# 4 layers: even over 2 stages (ZB-V's 4 chunks move whole: routed); 3: padded chunks.
DROP = config.TINY.replace(num_layers=4, lora=LoraConfig(rank=4, alpha=8.0, dropout=P,
                                                         targets=TARGETS))
DROP3 = DROP.replace(num_layers=3)
PLAIN = DROP.replace(lora=LoraConfig(rank=4, alpha=8.0, targets=TARGETS))
B, T, STEPS = 8, 12, 3
TP_PIPE = dict(data=2, pipe=2, tensor=2)
# One compile per case, so no two cases run the same path: the uneven 1F1B case runs 1F1B's
# schedule with a stage-to-layer offset as the even split (layers 2-3 on stage 1) would.
# No unpipelined sharded case: there a layer's index enters from the layer scan as on the
# one device (the reference runs that path), and what sharding changes, the batch (its
# per-token seeds) split over data and o's and down's inputs split over tensor (their masks
# drawn for global positions), every case below runs on data=2 × tensor=2.
# No ZB-H1 case: every op reads its slot's layer from one table
# (``StageLayers.layer_ids``, whose 3-layers-over-2-stages padding is its doctest), the
# split backward's B_in and W redraw their layer's mask as ZB-V's do, and a padded slot is
# skipped as in the interleaved padded chunks.
CASES = {"tp_pipe_zbv": (DROP, TP_PIPE, "tp", PipelineConfig("zb-v")),
         "tp_pipe_interleaved_padded": (DROP3, TP_PIPE, "tp",
                                        PipelineConfig("interleaved", virtual=2)),
         # uneven stages (1, 3): stage 1 runs layers 1-3 (not slots 3-5 of an even numbering)
         "tp_pipe_uneven_1_3": (DROP, TP_PIPE, "tp", PipelineConfig("1f1b", stage_layers=(1, 3)))}


@pytest.fixture(scope="module")
def reference(devices):
    """Per config, the start and its one-device runs (``dropout: run``; PLAIN: no dropout)."""
    mesh = make_mesh(devices=devices[:1])
    init = start_state(Trainer(DROP, mesh, "dp"), from_init=False)   # any start serves
    # DROP3 starts from DROP's first 3 layers, its parameters' and their (fresh) moments'
    # (any start serves; no second init compile)
    init3 = jax.tree_util.tree_map_with_path(
        lambda p, x: x[:DROP3.num_layers] if any(getattr(k, "key", None) == "blocks"
                                                 for k in p) else x, init)
    out = {}
    for cfg, start, twins in ((DROP, init, (DROP, PLAIN)), (DROP3, init3, (DROP3,))):
        out[cfg] = start, {c.lora.dropout: run_steps(c, mesh, "dp", None, start, B, T, STEPS)
                           for c in twins}
    return out


def test_dropout_changes_the_training_loss(reference):
    _, runs = reference[DROP]
    on, off = runs[P], runs[0.0]
    # the same start and batches: only the dropped adapter inputs differ
    assert abs(on["loss"] - off["loss"]) > 1e-4, (on["loss"], off["loss"])
    diff = max(np.max(np.abs(a - b)) for a, b in zip(jax.tree.leaves(on["grads"]),
                                                     jax.tree.leaves(off["grads"])))
    assert diff > 1e-4, diff


@pytest.mark.parametrize("name", list(CASES))
def test_dropout_sharded_matches_single_device(name, reference):
    cfg, sizes, strategy, pipeline = CASES[name]
    init, runs = reference[cfg]
    ref = runs[P]
    got = run_steps(cfg, make_mesh(**sizes), strategy, pipeline, init, B, T, STEPS)
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trees_close(got["grads"], ref["grads"], rtol=1e-5, atol=1e-7,
                       what=f"{name} adapter gradients with dropout")
    assert_trees_close(got["params"], ref["params"], rtol=1e-5, atol=1e-5,
                       what=f"{name} params after {STEPS} steps with dropout")


def test_the_mask_drops_p_and_rescales_the_rest():
    """One pair's input under active seeds: a fraction ~p is zero, the rest is x/(1-p);
    another layer or another target draws another mask; no seeds: x unchanged."""
    lo = DROP.lora
    from flax import nnx
    x = np.ones((4, 64, 32), np.float32)
    pairs = [lora.LoraPair((32,), ("embed",), (8,), ("mlp",), lo, nnx.Rngs(0), target=t)
             for t in ("q_proj", "k_proj")]

    @jax.jit   # one program, not one per eager op of the mask
    def masks(x):
        batch = {lora.DROPOUT_SEEDS: lora.dropout_seeds(3, (4, 64))}
        plain = pairs[0].dropped(x)                         # no layer context: no dropout
        with runtime.using(lora_dropout=lora.layer_dropout(batch, jnp.int32(0))):
            q0, k0 = (p.dropped(x) for p in pairs)
        with runtime.using(lora_dropout=lora.layer_dropout(batch, jnp.int32(1))):
            q1 = pairs[0].dropped(x)
        with runtime.using(lora_dropout=lora.layer_dropout({}, jnp.int32(0))):  # eval, decode
            evald = pairs[0].dropped(x)
        return plain, evald, q0, k0, q1
    plain, evald, q0, k0, q1 = (np.asarray(y) for y in masks(x))
    assert np.array_equal(plain, x) and np.array_equal(evald, x)
    for y in (q0, k0, q1):
        assert set(np.unique(y)) == {0.0, np.float32(1 / (1 - P))}
        assert abs(np.mean(y == 0) - P) < 0.02, np.mean(y == 0)   # 8192 draws: σ ≈ 0.005
    assert np.mean(q0 != k0) > 0.2 and np.mean(q0 != q1) > 0.2


def test_decode_ignores_dropout(reference):
    """Greedy decoding with the dropout config equals the same adapters without it."""
    params = reference[DROP][1][P]["params"]   # trained, B non-zero: the adapters matter
    prompts = [[1, 2, 3, 4], [5, 6]]
    got_toks, got = greedy_reference(DROP, params, prompts, 4)
    ref_toks, ref = greedy_reference(PLAIN, params, prompts, 4)
    assert got_toks == ref_toks
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_bad_dropout_settings_are_refused(devices):
    with pytest.raises(ValueError, match=r"--lora-dropout 1: must be in \[0, 1\)"):
        RunConfig.of(lora_rank=4, lora_dropout=1.0)
    with pytest.raises(ValueError, match="--lora-dropout needs LoRA: give --lora-rank"):
        RunConfig.of(lora_dropout=0.1)
    with pytest.raises(ValueError, match=r"--lora-dropout -0.1: must be in \[0, 1\)"):
        LoraConfig(rank=4, dropout=-0.1)
    assert RunConfig.of(lora_rank=4, lora_dropout=0.1).model_config().lora.dropout == 0.1
