"""The one model runtime (``models.runtime``): ``using`` layers fields over the current runtime
and restores the outer one on exit, however the block is left, and what the stack scan and
the hooks set never outlives its call."""
import dataclasses

import jax.numpy as jnp
import pytest
from flax import nnx

from triax.models import Transformer, config, runtime
from triax.models.axes import constrain
from triax.models.protocol import current_exec, current_layer, stack_loss
from triax.models.runtime import ExecConfig, Runtime


def test_nested_using_layers_over_the_outer_and_restores_it():
    assert runtime.current() == Runtime()
    bf16 = ExecConfig(compute_dtype="bfloat16")
    with runtime.using(exe=bf16, layer=3) as outer:
        with runtime.using(layer=4, moe_inference=True) as inner:
            assert (inner.exe, inner.layer, inner.moe_inference) == (bf16, 4, True)
            assert runtime.current() is inner
        assert runtime.current() is outer
        assert (outer.layer, outer.moe_inference) == (3, False)   # the inner's set nothing here
    assert runtime.current() == Runtime()


def test_an_exception_restores_the_outer_runtime():
    with runtime.using(layer_count=2):
        with pytest.raises(RuntimeError):
            with runtime.using(layer_count=1, constraint=lambda x, axes: x):
                raise RuntimeError("left early")
        assert runtime.current().layer_count == 2 and runtime.current().constraint is None
    assert runtime.current() == Runtime()


def test_unknown_fields_are_refused_and_the_runtime_is_frozen():
    with pytest.raises(TypeError, match="mesh"):
        with runtime.using(mesh="data"):
            pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        runtime.current().layer = 1
    assert runtime.current() == Runtime()


def test_the_model_reads_the_runtime_and_nothing_it_sets_survives():
    """The constraint hook sees the model's logical axes while active; the stack scan's
    ``exe`` and per-layer index reach the blocks and are gone after the call."""
    model = Transformer(config.TINY, nnx.Rngs(0))
    batch = {"inputs": jnp.zeros((2, 8), jnp.int32), "targets": jnp.zeros((2, 8), jnp.int32)}
    seen, layers = [], []
    block = type(model).block

    def recording_block(b, x, batch, *cache):
        layers.append(current_layer())
        assert current_exec().loss_chunks == 2
        return block(b, x, batch, *cache)

    def record(x, axes):
        seen.append(axes)
        return x
    with runtime.using(constraint=record):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(Transformer, "block", staticmethod(recording_block))
            stack_loss(model, batch, ExecConfig(loss_chunks=2))
        assert runtime.current().exe == ExecConfig() and runtime.current().layer is None
    assert ("batch", "seq", "act_heads", None) in seen
    assert len(layers) == 1 and layers[0] is not None   # the scan traces one body
    x = jnp.ones((2, 3))
    assert constrain(x, ("batch", None)) is x          # outside: the identity again
