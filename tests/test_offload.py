"""Host offload (``training.offload``): 3 steps with the state in ``pinned_host`` equal one
device's (fp32, tight), for the streamed update (parameters and optimizer state offloaded)
and the host update (``compute_on``, optimizer state offloaded); the state really lives on
the host (its arrays' memory kind, the compiled entry layout's ``S(5)``, the host update's
``_xla_compute_type="host"``); and the compiled step's device argument bytes drop by exactly
the offloaded state's bytes, which the planner's ``costs.offload`` predicts."""
import math

import jax
import numpy as np
import pytest
from tree_checks import assert_trees_close

from triax.costs.offload import offload_cost
from triax.costs.workload import Layout, Workload
from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.introspect import memory_from_compiled
from triax.training.offload import HOST, Offload
from triax.training.step import Trainer

CFG = config.get("tiny", num_layers=1)
B, T, STEPS = 8, 16, 3
CASES = {"stream": Offload(("optimizer", "params"), "stream"),
         "host": Offload(("optimizer",), "host")}


def run(trainer, step=None, init=None):
    """3 steps with ``step`` (default: the trainer's own jitted step) from seed 0's state: the
    trainer's own ``init``, or ``init`` (a host state) placed with ``Trainer.place``."""
    step = step or trainer._jitted_step
    state, losses = trainer.init(seed=0) if init is None else trainer.place(init), []
    for i in range(STEPS):
        state, m = step(state, trainer.shard_batch(trainer.example_batch(B, T, seed=i)))
        losses.append(float(m["loss"]))
    return np.array(losses), state


@pytest.fixture(scope="module")
def reference(devices):
    """One device's 3 steps, and its initial state on the host."""
    one = Trainer(CFG, make_mesh(devices=devices[:1]), "dp")
    init = jax.device_get(one.init(seed=0))
    return (*run(one, init=init), init)


@pytest.fixture(scope="module")
def offloaded():
    return {name: Trainer(CFG, make_mesh(data=8), "fsdp", offload=off)
            for name, off in CASES.items()}


@pytest.fixture(scope="module")
def compiled(offloaded):
    """Each step compiled once: run by the equality test, read by the memory test."""
    plain = Trainer(CFG, make_mesh(data=8), "fsdp")
    return {name: tr.lower(B, T).compile()
            for name, tr in {"none": plain, **offloaded}.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_offloaded_steps_match_single_device(name, reference, offloaded, compiled):
    trainer = offloaded[name]
    # stream starts from its own init (made straight into pinned_host), host from one
    # device's placed there (Trainer.place): one init compile less, both paths covered.
    losses, state = run(trainer, compiled[name], init=reference[2] if name == "host" else None)
    np.testing.assert_allclose(losses, reference[0], rtol=1e-5, atol=1e-6,
                               err_msg=f"offload {name}: losses")
    assert_trees_close(state["params"], reference[1]["params"], what=f"offload {name} params")
    assert_trees_close(state["opt_state"], reference[1]["opt_state"],
                       what=f"offload {name} optimizer state")
    for part, key in (("params", "params"), ("optimizer", "opt_state")):
        kinds = {x.sharding.memory_kind for x in jax.tree.leaves(state[key])}
        want = HOST if part in CASES[name].targets else "device"
        assert kinds == {want}, f"offload {name}: {key} in {kinds}, expected {want}"


def _state_bytes(trainer, key):
    return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize
               for s in jax.tree.leaves(trainer.abstract_state()[key]))


@pytest.mark.parametrize("name", list(CASES))
def test_device_argument_bytes_drop_by_offloaded_state(name, offloaded, compiled):
    trainer = offloaded[name]
    base, mem = memory_from_compiled(compiled["none"]), memory_from_compiled(compiled[name])
    moved = sum(_state_bytes(trainer, key) for part, key in
                (("params", "params"), ("optimizer", "opt_state"))
                if part in trainer.offload.targets)
    assert moved > 0
    assert base.argument_bytes - mem.argument_bytes == moved, (
        f"offload {name}: device arguments {base.argument_bytes} -> {mem.argument_bytes}, "
        f"offloaded state {moved} bytes")
    assert mem.host_argument_bytes == moved and base.host_argument_bytes == 0
    # the planner's model of the host memory is the compiled program's
    w = Workload.of(CFG, train=True, dtype="fp32", batch=B, seq=T)
    cost = offload_cost(w, Layout(data=8, strategy="fsdp"), trainer.offload.targets,
                        trainer.offload.update)
    assert cost.host_bytes == moved
    if trainer.offload.host_update:   # the update is compiled for the host
        assert '_xla_compute_type="host"' in compiled[name].as_text()
