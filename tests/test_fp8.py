"""FP8 (``--precision fp8``, ``models.fp8``): the float8 matmul is close to bf16's within the
formats' rounding, and the compiled program really computes in float8 (e4m3 forward operands,
e5m2 gradients); under FSDP the block's weights are all-gathered as one byte per element, so
the step's all-gather bytes over ``data`` are at most 0.55× the bf16 step's (read from the
compiled HLO); the FSDP step's loss equals one device's fp8 loss."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from triax.mesh import make_mesh
from triax.models import config, fp8
from triax.models.runtime import ExecConfig
from triax.sharding.introspect import bytes_over, collectives_from_compiled
from triax.training.config import RunConfig
from triax.training.step import Trainer

CFG = config.get("tiny", num_layers=1)
B, T = 8, 16
BF16, FP8 = ExecConfig("bfloat16"), ExecConfig("bfloat16", fp8=True)
# Relative (Frobenius) error bounds: e4m3 keeps 3 mantissa bits (unit roundoff 2^-4), e5m2
# keeps 2 (2^-3); a dot of rounded operands errs by about the roundoff over sqrt(2) per
# operand, well under one roundoff in norm. bf16 (2^-8) is negligible beside them.
FORWARD_TOL, GRADIENT_TOL = 2.0 ** -4, 2.0 ** -3


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_fp8_matmul_close_to_bf16():
    rng = np.random.default_rng(0)   # drawn on the host: no eager program per draw
    x = rng.standard_normal((4, 16, 64), np.float32)
    w = 0.05 * rng.standard_normal((64, 4, 8), np.float32)
    g = rng.standard_normal((4, 16, 4, 8), np.float32).astype(jnp.bfloat16)
    spec = "BTD,DNH->BTNH"

    @jax.jit
    def both(x, w, g):
        y, vjp = jax.vjp(lambda x, w: fp8.einsum(spec, x, w, jnp.bfloat16), x, w)
        y_ref, vjp_ref = jax.vjp(lambda x, w: jnp.einsum(spec, x.astype(jnp.bfloat16),
                                                          w.astype(jnp.bfloat16)), x, w)
        return y, y_ref, vjp(g), vjp_ref(g)
    y, y_ref, grads, grads_ref = both(x, w, g)
    assert _rel(y, y_ref) < FORWARD_TOL
    for name, got, want in zip(("dx", "dw"), grads, grads_ref):
        assert got.dtype == jnp.float32, name   # fp32 master gradients
        assert _rel(got, want) < GRADIENT_TOL, name


@pytest.fixture(scope="module")
def fsdp_steps(devices):
    mesh = make_mesh(data=8)
    return mesh, {name: Trainer(CFG, mesh, "fsdp", exe=exe).lower(B, T)
                  for name, exe in (("bf16", BF16), ("fp8", FP8))}


@pytest.fixture(scope="module")
def compiled(fsdp_steps):
    return {name: low.compile() for name, low in fsdp_steps[1].items()}


def test_step_computes_in_float8(fsdp_steps):
    """The lowered step's projections are dots of e4m3 operands (forward) and of e5m2 ×
    e4m3 ones (backward); the bf16 step has none."""
    _, lowered = fsdp_steps
    for name, want in (("fp8", True), ("bf16", False)):
        text = lowered[name].as_text()
        e4m3 = re.findall(r"dot_general.*tensor<[\dx]+xf8E4M3FN>.*tensor<[\dx]+xf8E4M3FN>", text)
        e5m2 = re.findall(r"dot_general.*tensor<[\dx]+xf8E5M2>", text)
        assert bool(e4m3) == want and bool(e5m2) == want, (
            f"{name}: {len(e4m3)} e4m3 forward dots, {len(e5m2)} e5m2 gradient dots")


def test_fsdp_gathers_weights_in_float8(fsdp_steps, compiled):
    mesh = fsdp_steps[0]
    gathered = {name: bytes_over(collectives_from_compiled(c, mesh), "all-gather", "data")
                for name, c in compiled.items()}
    assert gathered["fp8"] <= 0.55 * gathered["bf16"], gathered
    # every block weight's gather is of bytes (u8: the e4m3 bits), none in bf16's step
    u8 = {name: len(re.findall(r"= u8\[[\d,]+\]\{[^}]*\} all-gather\(", c.as_text()))
          for name, c in compiled.items()}
    assert u8["bf16"] == 0 and u8["fp8"] >= 6, u8   # q, k, v, o, in, down


def test_fsdp_fp8_loss_matches_single_device(devices, fsdp_steps, compiled):
    """The compiled FSDP step's loss (before its update) against one device's fp8 forward."""
    one = Trainer(CFG, make_mesh(devices=devices[:1]), "dp", exe=FP8)
    sharded = Trainer(CFG, fsdp_steps[0], "fsdp", exe=FP8)
    batch = one.example_batch(B, T)
    init = jax.device_get(one.init(0))      # placed on the FSDP mesh: no init compile there
    loss_one = jax.jit(one.loss_fn())(init["params"], batch)[0]
    _, metrics = compiled["fp8"](sharded.place(init), sharded.shard_batch(batch))
    loss_fsdp = metrics["loss"]
    # the same scales and roundings; only the fp32 accumulation order differs
    np.testing.assert_allclose(float(loss_fsdp), float(loss_one), rtol=1e-4,
                               err_msg="fp8 loss: fsdp (data=8) vs one device")


def test_precision_flag_turns_fp8_on():
    assert RunConfig.of(precision="fp8").exec_config().fp8
    assert RunConfig.of(precision="fp8").exec_config().compute_dtype == "bfloat16"
    assert not RunConfig.of(precision="bf16").exec_config().fp8
