"""``init_params``: the built-in model's init is one program per config and layout, its seed
an input, so a second init (another seed, engine or replica's load) compiles nothing and
draws the same weights as a program with the seed written in."""
import jax
import numpy as np

from compile_counter import compiles_during
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.partition import abstract_model, init_fn, init_params, param_shardings


def test_a_second_init_of_a_model_and_layout_compiles_nothing(devices):
    cfg = config.TINY.replace(num_layers=1)
    mesh = make_mesh(tensor=2, devices=devices[:2])
    first = init_params(abstract_model(cfg), mesh, "tp", seed=0)
    with compiles_during() as compiles:
        again = init_params(abstract_model(cfg), mesh, "tp", seed=4)
    assert compiles == [], "a second seed compiled the init again"
    # the seed drawn: other weights, the very ones a program with seed 4 written in gives
    am = abstract_model(cfg)
    written = jax.jit(init_fn(am, 4), out_shardings=param_shardings(am, mesh, "tp"))()
    leaves = [jax.tree.leaves(jax.device_get(t)) for t in (first, again, written)]
    assert not all(np.array_equal(a, b) for a, b in zip(leaves[0], leaves[1]))
    assert all(np.array_equal(a, b) for a, b in zip(leaves[1], leaves[2]))
    assert jax.tree.leaves(again)[0].sharding == jax.tree.leaves(first)[0].sharding
