"""``bench/ideal.py``'s state ideal is derived independently of the state tree the step
compiles from (``ModelConfig.param_counts()`` by group, split evenly over the axes the rules
give each group, AdamW's two moments), so where the step holds more than an even split the
bench's ratio shows it. Nothing is compiled: the step's placement is its real shardings."""
import importlib.util
from pathlib import Path

import pytest

from triax.mesh import make_mesh
from triax.models import config
from triax.sharding.introspect import placement_table
from triax.training.step import Trainer

_spec = importlib.util.spec_from_file_location(
    "bench_ideal", Path(__file__).parents[1] / "bench" / "ideal.py")
ideal = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ideal)

B, T = 8, 16


def _placed_state_bytes(trainer) -> int:
    """Params + AdamW mu and nu + step counter + the int32 batch, as the step places them."""
    rows = placement_table(trainer.abstract, trainer.mesh, trainer.strategy)
    opt = placement_table(trainer.abstract, trainer.mesh, trainer.strategy, optimizer=True)
    data = dict(trainer.mesh.shape)["data"]
    return (sum(r.bytes_per_device for r in rows) + 2 * sum(r.bytes_per_device for r in opt)
            + 4 + 2 * (B // data) * T * 4)


@pytest.mark.parametrize("sizes,strategy,exact", [
    (dict(data=8), "dp", True),        # every parameter whole: the ideal is the state
    (dict(data=8), "fsdp", True),      # every group splits evenly over data
    (dict(tensor=8), "tp", False),     # 2 KV heads over 8 tensor ranks: K/V replicated
])
def test_ideal_state_is_derived_not_read_off_the_state(devices, sizes, strategy, exact):
    trainer = Trainer(config.TINY.replace(num_layers=2), make_mesh(**sizes), strategy)
    want = ideal.ideal_state_bytes(trainer, B, T)["total"]
    placed = _placed_state_bytes(trainer)
    if exact:
        assert want == placed
    else:   # the step holds what an even split would not: the ideal must say less
        kv = 2 * 2 * config.TINY.embed_dim * config.TINY.num_kv_heads * config.TINY.head_dim
        assert want < placed and placed - want >= 3 * 4 * kv * (1 - 1 / 8) * 0.9
