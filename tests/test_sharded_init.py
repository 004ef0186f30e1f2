"""The sharded init (``Trainer.init``: one program with ``out_shardings``, so each device makes
only its own shard) equals the one-device init bit for bit, per strategy, and
``Trainer.place`` puts the one-device state exactly where ``init`` puts its own. This is what
lets the equivalence tests place their one-device reference's initial state on each mesh (a
transfer) instead of compiling an init per mesh and strategy."""
import jax
import numpy as np
import pytest
from user_models import ViT, VitConfig, vit_loss

from triax.mesh import make_mesh
from triax.models import config
from triax.pipeline.pipelined import PipelineConfig
from triax.training.step import Trainer

CFG = config.TINY.replace(num_layers=2)
MOE = config.TINY_MOE.replace(num_layers=2)
UNEVEN = config.TINY.replace(num_layers=4)


def vit(mesh, strategy, **kw):
    return Trainer.for_model(lambda rngs: ViT(VitConfig(layers=2), rngs), vit_loss, mesh,
                             strategy, rules={"pixels": None, "classes": None}, **kw)


def built_in(cfg):
    return lambda mesh, strategy, **kw: Trainer(cfg, mesh, strategy, **kw)


TINY, TINY_MOE, TINY4 = built_in(CFG), built_in(MOE), built_in(UNEVEN)


# Each way the state is split: fsdp_tp on 2x4 splits the weights over data and tensor at once
# (the axes fsdp's and tp's rules use one at a time; dp and HSDP's replica axis only copy),
# zero1 splits the optimizer state and not the parameters; experts over `expert`, a user's
# model (its own constructor), and uneven stages (init restacks the blocks; place restacks
# the saved form).
CASES = {
    "fsdp_tp": (TINY, dict(data=2, tensor=4), "fsdp_tp", {}),
    "zero1": (TINY, dict(data=8), "zero1", {}),
    "moe_ep4_fsdp": (TINY_MOE, dict(data=2, expert=4), "fsdp", {}),
    "vit_fsdp_tp": (vit, dict(data=2, tensor=4), "fsdp_tp", {}),
    "uneven_stages_3_1": (TINY4, dict(data=4, pipe=2), "fsdp",
                          dict(pipeline=PipelineConfig("1f1b", 2, stage_layers=(3, 1)))),
}


@pytest.fixture(scope="module")
def one_device_states(devices):
    """Each model's init on one device, on the host."""
    one = make_mesh(devices=devices[:1])
    return {make: jax.device_get(make(one, "dp").init(0))
            for make in {make for make, *_ in CASES.values()}}


@pytest.mark.parametrize("name", CASES)
def test_sharded_init_equals_one_device_init_and_place(one_device_states, name):
    make, sizes, strategy, kw = CASES[name]
    tr = make(make_mesh(**sizes), strategy, **kw)
    sharded, placed = tr.init(0), tr.place(one_device_states[make])
    want = jax.tree.leaves(tr.state_shardings)
    for what, state in (("init", sharded), ("place", placed)):
        got = [a.sharding for a in jax.tree.leaves(state)]
        assert all(g.is_equivalent_to(w, a.ndim) for g, w, a in
                   zip(got, want, jax.tree.leaves(state))), f"{name}: {what}'s shardings"
    assert any(not a.sharding.is_fully_replicated for a in jax.tree.leaves(sharded))  # split
    # Bit for bit, in the saved form (the model's [L, ...] blocks, whatever the stages).
    saved = jax.device_get(tr.to_saved(sharded))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(saved)[0],
                            jax.tree.leaves(one_device_states[make])):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} {jax.tree_util.keystr(path)}: "
                                                    f"sharded init != one device's")
    # place: the sharded init exactly, in the stored form (uneven stages restacked).
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(jax.device_get(placed))[0],
                            jax.tree.leaves(jax.device_get(sharded))):
        np.testing.assert_array_equal(a, b, err_msg=f"{name} {jax.tree_util.keystr(path)}: "
                                                    f"placed != sharded init")

def test_place_names_a_state_of_another_model(one_device_states):
    """A state of another model, or parameters without the optimizer's state: an error that
    names the leaf, before anything is transferred."""
    with pytest.raises(ValueError, match=r"the state lacks \['opt_state'\]\[1\]\[0\]"
                                         r"\.count, .* saved form"):
        Trainer(CFG, make_mesh(data=8), "dp").place({"params": one_device_states[TINY]["params"]})
    tr = Trainer(CFG.replace(num_layers=3), make_mesh(data=8), "dp")
    with pytest.raises(ValueError, match=r"Trainer.place: \[.*\['blocks'\].* is float32\[2, "
                                         r".* holds float32\[3, .* same model"):
        tr.place(one_device_states[TINY])
