"""An int8 LoRA base (``--base-dtype int8``) under fsdp_tp equals the one-device int8
run (loss, adapter gradients, 3 steps; fp32 adapters, tight tolerance), each
per-output-channel scale is split like its weight's output axes (replicated along the input
dims it keeps as 1), and the planner's state bytes are the compiled fsdp_tp step's."""
import jax
import numpy as np
import pytest
from lora_helpers import run_steps, start_state
from tree_checks import assert_trees_close

from triax.costs.workload import Layout, Workload
from triax.mesh import make_mesh
from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.models.quantize import SUFFIX
from triax.planner.verify import compare, figures
from triax.training.step import Trainer

INT8 = config.TINY.replace(num_layers=2, lora=LoraConfig(rank=4, alpha=8.0, base_dtype="int8"))
# The quantized projections and their input-dim counts (models.layers).
N_IN = {"wq_DNH": 1, "wk_DKH": 1, "wv_DKH": 1, "wo_NHD": 2, "w_in_D2F": 1, "w_down_FD": 1}
B, T, STEPS = 8, 12, 3
# tensor=2 divides the 2 KV heads, so every projection has a split output axis.
CASES = {"dp": (dict(data=8), "dp"), "fsdp_tp": (dict(data=4, tensor=2), "fsdp_tp")}
# The layouts trained against one device. Not dp: it splits no weight or scale (above), so
# its int8 base is dequantized as on the one device, and what dp adds, the adapters'
# gradients all-reduced over data, is test_lora.py's expert case (dp on data=2 × expert=4).
TRAINED = ("fsdp_tp",)


@pytest.fixture(scope="module")
def reference(devices):
    mesh = make_mesh(devices=devices[:1])
    init = start_state(Trainer(INT8, mesh, "dp"))   # its base is the one-device init's
    return init, run_steps(INT8, mesh, "dp", None, init, B, T, STEPS)


@pytest.fixture(scope="module")
def sharded(reference):
    init, _ = reference
    return {name: run_steps(INT8, make_mesh(**CASES[name][0]), CASES[name][1], None, init, B, T,
                            STEPS) for name in TRAINED}


@pytest.mark.parametrize("name", TRAINED)
def test_int8_base_sharded_matches_single_device(name, reference, sharded):
    init, ref = reference
    got = sharded[name]
    np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
    assert_trees_close(got["grads"], ref["grads"], rtol=1e-5, atol=1e-7,
                       what=f"{name} adapter gradients over an int8 base")
    assert_trees_close(got["params"], ref["params"], rtol=1e-5, atol=1e-5,
                       what=f"{name} params after {STEPS} steps over an int8 base")
    _, base0 = lora.split(init["params"])
    _, base = lora.split(got["params"])
    assert all(a.dtype == b.dtype and np.array_equal(a, b)
               for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(base0)))
    assert any(x.dtype == np.int8 for x in jax.tree.leaves(base))
    # The int8 init made on the mesh (amax over split input dims) is the one-device init.
    sharded_init = jax.device_get(got["trainer"].init(0)["params"])
    assert_trees_close(lora.split(sharded_init)[1], base0, rtol=0, atol=0,
                       what=f"{name} int8 init")


def _spec(sharding, ndim):
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


@pytest.mark.parametrize("name", list(CASES))
def test_scales_shard_like_the_weights_output_axes(name, devices):
    sizes, strategy = CASES[name]
    tr = Trainer(INT8, make_mesh(**sizes), strategy)
    shapes, shardings = tr.abstract.shapes["blocks"], tr.param_shardings["blocks"]
    split_out = 0
    for mod, names in (("attn", ("wq_DNH", "wk_DKH", "wv_DKH", "wo_NHD")),
                       ("mlp", ("w_in_D2F", "w_down_FD"))):
        for n in names:
            k, w = N_IN[n], shapes[mod][n]
            w_spec = _spec(shardings[mod][n], w.ndim)
            s_spec = _spec(shardings[mod][n + SUFFIX], w.ndim)
            # layers dim, then the input dims (kept as 1: replicated), then the output dims
            assert s_spec[0] == w_spec[0], (n, w_spec, s_spec)
            assert s_spec[1:1 + k] == (None,) * k, (n, s_spec)
            assert s_spec[1 + k:] == w_spec[1 + k:], (n, w_spec, s_spec)
            split_out += any(a is not None for a in w_spec[1 + k:])
    # fsdp_tp splits every projection's output over tensor or data; dp splits nothing
    assert split_out == (6 if name == "fsdp_tp" else 0), split_out


def test_planned_int8_lora_state_matches_the_compile(sharded):
    """The planner's params + optimizer bytes per device (``verify.compare``: what ``plan
    --verify`` prints) against the compiled fsdp_tp step's state arguments (its step above,
    read with ``verify.figures``: no second compile)."""
    run = sharded["fsdp_tp"]
    sizes, strategy = CASES["fsdp_tp"]
    w = Workload.of(INT8, train=True, dtype="fp32", batch=B, seq=T, backend="cpu")
    mem = compare(w, Layout(**sizes, strategy=strategy),
                  figures(run["compiled"], run["trainer"].mesh))["memory"]
    assert mem["predicted_state"] == pytest.approx(mem["compiled_state"], abs=64), mem
