"""The one model protocol (``triax.models.protocol``): the built-in Transformer is trained and
pipelined through the same path as a user's model, and a user's model gets what the built-in
one has (auxiliary losses summed over the layers, added to the loss, reported)."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tree_checks import assert_trees_close

import triax
from triax.mesh import make_mesh
from triax.models import Transformer, config
from triax.models.protocol import stack_loss
from triax.pipeline.pipelined import PipelineConfig
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)


def _reference(devices):
    ref = Trainer(CFG, make_mesh(devices=devices[:1]), "dp")
    params = jax.device_get(ref.init(0)["params"])
    batch = ref.example_batch(8, 16)
    return params, batch, ref.grads(params, batch)


def test_builtin_transformer_is_a_users_model(devices):
    """``Trainer.for_model(Transformer, loss_fn=None)``, unpipelined and pipelined, is the
    built-in decoder's step: same loss, same ``ce`` metric, same gradients."""
    params, batch, ((loss0, aux0), grads0) = _reference(devices)
    make = functools.partial(Transformer, CFG)
    for mesh, pipeline in ((make_mesh(devices=devices[:1]), None),
                           (make_mesh(pipe=2, devices=devices[:2]), PipelineConfig("1f1b", 4))):
        tr = triax.Trainer.for_model(make, None, mesh, "dp", pipeline=pipeline)
        assert tr.abstract.cfg is None                 # known by its protocol alone
        (loss, aux), grads = tr.grads(params, batch)
        np.testing.assert_allclose(float(loss), float(loss0), rtol=1e-5)
        assert sorted(aux) == sorted(aux0) == ["ce"]
        np.testing.assert_allclose(float(aux["ce"]), float(aux0["ce"]), rtol=1e-5)
        assert_trees_close(grads, jax.device_get(grads0), rtol=1e-5, atol=1e-6,
                           what=f"pipeline={pipeline}")


class Layer(nnx.Module):
    def __init__(self, rngs):
        self.w = nnx.Param(0.5 * jax.random.normal(rngs.params(), (4, 4)),
                           out_sharding=(None, None))


class Penalised(nnx.Module):
    """A user's stack whose blocks return an auxiliary loss, as the built-in MoE's do."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=4)
        @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make(rngs):
            return Layer(rngs)
        self.blocks = make(rngs)

    def embed(self, batch):
        return batch["x"]

    @staticmethod
    def block(block, x, batch):
        y = jnp.tanh(x @ block.w[...])
        return y, {"penalty_loss_weighted": jnp.mean(y ** 2)}

    def aux_zeros(self):
        return {"penalty_loss_weighted": jnp.zeros((), jnp.float32)}

    def head_loss(self, x, batch):
        return jnp.sum(x * batch["y"])


def test_users_auxiliary_losses_add_to_the_loss_pipelined_or_not(devices):
    with nnx.use_eager_sharding(False):
        model = Penalised(nnx.Rngs(0))
    rng = np.random.default_rng(0)
    batch = {"x": rng.normal(size=(8, 4)).astype(np.float32),
             "y": rng.normal(size=(8, 4)).astype(np.float32)}
    x, penalty = batch["x"], 0.0
    for w in np.asarray(model.blocks.w[...]):  # the stack by hand, on the host
        x = np.tanh(x @ w)
        penalty += np.mean(x ** 2)
    loss, aux = stack_loss(model, batch)
    np.testing.assert_allclose(float(aux["penalty_loss_weighted"]), float(penalty), rtol=1e-6)
    np.testing.assert_allclose(float(loss), float(np.sum(x * batch["y"]) / 8 + penalty),
                               rtol=1e-6)

    plain = triax.Trainer.for_model(Penalised, None, make_mesh(devices=devices[:1]), "dp")
    params = jax.device_get(plain.init(0)["params"])
    (loss0, aux0), grads0 = plain.grads(params, batch)
    piped = triax.Trainer.for_model(Penalised, None, make_mesh(pipe=2, devices=devices[:2]),
                                    "dp", pipeline=PipelineConfig("gpipe", 2))
    (loss1, aux1), grads1 = piped.grads(params, batch)
    np.testing.assert_allclose(float(loss1), float(loss0), rtol=1e-5)
    np.testing.assert_allclose(float(aux1["penalty_loss_weighted"]),
                               float(aux0["penalty_loss_weighted"]), rtol=1e-5)
    assert_trees_close(grads1, jax.device_get(grads0), rtol=1e-5, atol=1e-6, what="grads")
