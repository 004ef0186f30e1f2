"""One mapping from a run's settings to what the analytic model plans (``Workload.of_run``)
and one from a serving engine's (``Workload.of_engine``): every setting that shapes the
workload reaches it, and through it the memory estimate (issue 34: four copies had drifted,
two dropping ``--loss-chunks`` and ``--attention``; the serving copies wrote "fp32")."""
import dataclasses

import pytest

from triax.costs.memory import estimate
from triax.costs.workload import Layout, Workload
from triax.inference.engine import EngineConfig
from triax.inference.pool_settings import PoolSettings
from triax.models import config
from triax.training.config import RunConfig

CFG = config.get("tiny", num_layers=2)
RUN = RunConfig.of(model="tiny", num_layers=2, batch_size=8, seq_len=256)


def test_of_run_carries_every_setting_that_shapes_the_workload():
    run = RUN.replace(precision="fp32", batch_size=4, seq_len=128, remat="full", loss_chunks=4,
                      attention="blockwise")
    w = Workload.of_run(run, CFG, train=False, backend="cpu",
                        pool=PoolSettings.of_flags(kv_memory="1MiB", kv_block_size=32))
    assert (w.cfg, w.train, w.dtype, w.batch, w.seq, w.remat, w.loss_chunks, w.attention,
            w.backend) == (CFG, False, "fp32", 4, 128, "full", 4, "blockwise", "cpu")
    assert (w.kv_blocks, w.kv_memory, w.kv_block_size) == (0, 1 << 20, 32)
    assert Workload.of_run(RUN).cfg == RUN.model_config()   # the run's own model by default
    assert Workload.of_run(RUN, params=7e9).cfg is None     # or only a parameter count


@pytest.mark.parametrize("field, a, b", [("loss_chunks", 1, 8), ("attention", "reference",
                                                                    "blockwise"),
                                         ("remat", "none", "full"), ("seq_len", 256, 128)])
def test_each_setting_reaches_the_memory_estimate(field, a, b):
    lay = Layout(data=8)
    one, other = (estimate(Workload.of_run(RUN.replace(**{field: v}), CFG), lay)
                  for v in (a, b))
    assert other.activations < one.activations


# (served dtype, --kv-dtype) -> (planned precision, bytes per KV value, scale bytes per
# block, layer and KV head)
DTYPES = {("float32", "auto"): ("fp32", 4, 0), ("bfloat16", "auto"): ("bf16", 2, 0),
          ("float32", "bfloat16"): ("fp32", 2, 0), ("bfloat16", "int8"): ("bf16", 1, 4)}


@pytest.mark.parametrize("dtype, kv_dtype", list(DTYPES))
def test_of_engine_plans_the_engines_pool_in_its_dtype(dtype, kv_dtype):
    ecfg = EngineConfig(max_batch=4, max_len=64, kv_blocks=8, block_size=16, dtype=dtype,
                        kv_dtype=kv_dtype)
    w = Workload.of_engine(CFG, ecfg)
    assert (w.train, w.batch, w.seq, w.kv_blocks, w.kv_block_size) == (False, 4, 64, 8, 16)
    precision, nbytes, scale = DTYPES[dtype, kv_dtype]
    assert (w.dtype, w.kv_dtype) == (precision, kv_dtype)
    # the KV term is that pool: 8 blocks of 16 positions, k and v, every layer and head
    # (tensor=2 splits the heads), and an int8 pool's scale per block, layer and head
    kv = estimate(w, Layout(tensor=2, strategy="tp")).kv_cache
    heads = CFG.num_kv_heads // 2
    assert kv == 2 * CFG.num_layers * 8 * heads * (16 * CFG.head_dim * nbytes + scale)


def test_the_pool_settings_are_checked_by_the_flags_one_home():
    from triax.config_fields import KVPool
    assert PoolSettings.of_flags(kv_memory="2KiB") == PoolSettings(0, 2048, 16, "auto")
    for bad in (dict(kv_blocks=0), dict(kv_block_size=0), dict(kv_memory="-1"),
                dict(kv_blocks=4, kv_memory="1MiB"), dict(kv_dtype="fp8")):
        with pytest.raises(ValueError, match="--kv-") as from_settings:
            PoolSettings.of_flags(**bad)
        with pytest.raises(ValueError) as from_flags:
            KVPool(**bad)
        assert str(from_flags.value) == str(from_settings.value)
    assert dataclasses.asdict(PoolSettings()) == {"kv_blocks": 0, "kv_memory": 0,
                                                  "block_size": 16, "kv_dtype": "auto"}
