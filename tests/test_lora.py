"""LoRA over a frozen base equals one device on every layout (fsdp_tp, tensor × pipe with
ZB-H1, dp with expert parallelism): loss, adapter gradients and 3 steps (fp32); the
base is bit-identical after training and has no optimizer state. The same compiled steps show
what a frozen base costs: no weight-gradient matmul for any base weight (the one-device dp
step and the ZB-H1 split backward) and the optimizer state's bytes are the adapters' AdamW
moments (``memory_analysis``), against full fine-tuning twins.

The adapter gradients are read from the first step's Adam moment (``mu = (1 - b1)·g`` of the
clipped gradient, the gradient the optimizer uses): one compile per layout, not two."""
import re

import jax
import numpy as np
import pytest
from lora_helpers import run_steps, start_state
from tree_checks import assert_trees_close

from triax.mesh import make_mesh
from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.pipeline.pipelined import PipelineConfig
from triax.training.step import Trainer

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
DENSE = config.TINY.replace(num_layers=2, lora=LoraConfig(rank=4, alpha=8.0))
MOE = config.TINY_MOE.replace(num_layers=2, lora=LoraConfig(rank=4, alpha=8.0, targets=ATTN))
# rows per device (micro-)batch (12 or 8 × 12) are no weight dimension, so a 2-D dot whose
# result has only weight dimensions is a weight gradient (test_no_weight_gradient_dots).
B, T, STEPS = 8, 12, 3
# No dp case on data=8: the dp strategy's path (replicated adapters, their gradients
# all-reduced over data) is the expert case's (dp on data=2 × expert=4), and every target's
# gradient reduction over data is fsdp_tp's and the pipeline's (data=2). No 1F1B case: every
# target's adapters through a pipeline stage on tensor × pipe (the stage's params, their
# gradients summed over micro-batches) is ZB-H1's here, and 1F1B's schedule with LoRA
# adapters on this mesh and strategy (F and B ops, each stage's gradient accumulators) is
# test_lora_dropout.py's tp_pipe_uneven_1_3 (against one device, 3 steps).
CASES = {  # name: (cfg, mesh sizes, strategy, pipeline)
    "fsdp_tp": (DENSE, dict(data=2, tensor=4), "fsdp_tp", None),
    "tp_pipe_zbh1": (DENSE, dict(data=2, pipe=2, tensor=2), "tp", PipelineConfig("zb-h1")),
    "expert": (MOE, dict(data=2, expert=4), "dp", None),
}


def run(cfg, mesh, strategy, pipeline, start):
    return run_steps(cfg, mesh, strategy, pipeline, start, B, T, STEPS)


@pytest.fixture(scope="module")
def reference(devices):
    out = {}
    for cfg in (DENSE, MOE):
        tr = Trainer(cfg, make_mesh(devices=devices[:1]), "dp")
        # DENSE's init program serves test_step_zero_is_the_base too; MOE's start is drawn
        # on the host (no init program)
        init = start_state(tr, from_init=cfg is DENSE)
        out[cfg] = (init, run(cfg, tr.mesh, "dp", None, init))
        if cfg is DENSE:   # the trainer's own init, before start_state (B = 0)
            out["b_zero"] = jax.device_get(tr.init(0)["params"])
    return out


@pytest.fixture(scope="module")
def sharded(reference):
    return {name: run(cfg, make_mesh(**sizes), strategy, pipeline, reference[cfg][0])
            for name, (cfg, sizes, strategy, pipeline) in CASES.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_lora_matches_single_device(name, reference, sharded):
    cfg, sizes, strategy, pipeline = CASES[name]
    init, ref = reference[cfg]
    got = sharded[name]
    np.testing.assert_allclose(got["loss"], ref["loss"], rtol=1e-5)
    assert_trees_close(got["grads"], ref["grads"], rtol=1e-5, atol=1e-7,
                       what=f"{name} adapter gradients")
    assert np.abs(np.concatenate([np.ravel(g) for g in jax.tree.leaves(got["grads"])])).max() > 0
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trees_close(got["params"], ref["params"], rtol=1e-5, atol=1e-5,
                       what=f"{name} params after {STEPS} steps")
    # The base is bit-identical after training; the adapters moved.
    ad0, base0 = lora.split(init["params"])
    ad, base = lora.split(got["params"])
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(base)[0],
                            jax.tree.leaves(base0)):
        assert x.dtype == y.dtype and np.array_equal(x, y), jax.tree_util.keystr(path)
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(ad),
                                                        jax.tree.leaves(ad0)))
    # The optimizer state holds the adapters' moments only.
    n_opt = sum(np.size(x) for x in jax.tree.leaves(got["opt"]) if np.ndim(x))
    n_ad = sum(np.size(x) for x in jax.tree.leaves(ad))
    assert n_opt == 2 * n_ad == 2 * lora.param_count(cfg.lora, cfg), (n_opt, n_ad)


def test_step_zero_is_the_base(reference):
    """B = 0 at init: the adapted model's logits are the base model's, exactly (the
    reference trainer's init: no init compiled for this test alone)."""
    from flax import nnx
    from triax.sharding.partition import abstract_model
    params = reference["b_zero"]
    tokens = np.arange(2 * T, dtype=np.int32).reshape(2, T)
    ad, base = lora.split(params)
    assert all(not np.any(b) for p, b in jax.tree_util.tree_flatten_with_path(ad)[0]
               if p[-1].key == "b")

    def logits(cfg, params):   # jitted: eagerly, each op outside the layer scan compiles
        graphdef = abstract_model(cfg).graphdef
        return jax.jit(lambda p: nnx.merge(graphdef, p)(tokens)[0])(params)
    adapted = logits(DENSE, params)
    plain = logits(DENSE.replace(lora=None), base)
    assert np.array_equal(adapted, plain)


def test_bf16_base_is_stored_in_bf16():
    """``--base-dtype bfloat16``: every base leaf of the train state is bf16 (half the bytes),
    the adapters and their moments fp32."""
    tr = Trainer(DENSE.replace(lora=LoraConfig(rank=4, base_dtype="bfloat16")),
                 make_mesh(data=8), "fsdp")
    state = tr.abstract_state()
    ad, base = lora.split(state["params"])
    assert {x.dtype for x in jax.tree.leaves(base)} == {np.dtype("bfloat16")}
    assert {x.dtype for x in jax.tree.leaves(ad)} == {np.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(state["opt_state"]) if x.ndim} == \
        {np.dtype("float32")}


# ---- what the frozen base costs, in the compiled step -------------------------------------
# A weight's dims, whole or halved (the ZB-H1 twin splits them over tensor=2); the per-device
# rows (12) are none of them.
WEIGHT_DIMS = {d // s for d in (DENSE.embed_dim, DENSE.num_heads * DENSE.head_dim,
                                DENSE.num_kv_heads * DENSE.head_dim, DENSE.mlp_dim,
                                2 * DENSE.mlp_dim, DENSE.vocab_size) for s in (1, 2)}
# layout: the LoRA case it is compared with (dp: the one-device reference's compiled step)
TWINS = {"dp": None, "zb-h1": "tp_pipe_zbh1"}


@pytest.fixture(scope="module")
def lora_steps(reference, sharded):
    """Per layout of ``TWINS``, the LoRA run whose compiled step is read."""
    return {layout: reference[DENSE][1] if case is None else sharded[case]
            for layout, case in TWINS.items()}


def weight_grad_dots(hlo: str) -> int:
    shapes = re.findall(r"= f32\[([0-9,]*)\][^ ]* dot\(", hlo)
    return sum(1 for s in shapes if len(dims := [int(d) for d in s.split(",") if d]) == 2
               and set(dims) <= WEIGHT_DIMS)


@pytest.fixture(scope="module")
def full_ft(lora_steps):
    """Full fine-tuning twins of two LoRA steps: the same mesh, strategy and pipeline."""
    out = {}
    for layout, run in lora_steps.items():
        tr, case = run["trainer"], TWINS[layout]
        full = Trainer(DENSE.replace(lora=None), tr.mesh, tr.strategy.name,
                       pipeline=None if case is None else CASES[case][3])
        out[layout] = (full, full.lower(B, T).compile())
    return out


@pytest.mark.parametrize("layout", list(TWINS))
def test_no_weight_gradient_dots_for_the_base(lora_steps, full_ft, layout):
    full = weight_grad_dots(full_ft[layout][1].as_text())
    adapted = weight_grad_dots(lora_steps[layout]["compiled"].as_text())
    # Full fine-tuning: q, k, v, o, the fused gate|up and down per layer (the scanned body,
    # compiled once) and the head; LoRA: none (its adapters' gradients have a rank dim).
    assert full >= 7, full
    assert adapted == 0, adapted


def test_optimizer_state_is_the_adapters_moments(lora_steps, full_ft):
    tr_lora, c_lora = lora_steps["dp"]["trainer"], lora_steps["dp"]["compiled"]
    tr_full, c_full = full_ft["dp"]
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa
    base = nbytes(tr_full.abstract.shapes)
    adapters = nbytes(lora.split(tr_lora.abstract.shapes)[0])
    assert adapters == 4 * lora.param_count(DENSE.lora, DENSE)
    opt = lambda tr: nbytes(jax.eval_shape(tr.fresh_state, tr.abstract.shapes)["opt_state"])  # noqa
    assert opt(tr_lora) == 2 * adapters + opt(tr_full) - 2 * base
    # The compiled step's arguments (state + batch), on the one device: full FT
    # holds the base and 2 moments of it; LoRA the base, the adapters and their 2 moments.
    arg_full = c_full.memory_analysis().argument_size_in_bytes
    arg_lora = c_lora.memory_analysis().argument_size_in_bytes
    assert arg_full - arg_lora == 2 * base - 3 * adapters, (arg_full, arg_lora)
