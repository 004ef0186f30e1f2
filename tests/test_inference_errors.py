"""Bad input gets a clear error naming the problem and the fix; nothing is truncated."""
import json

import jax
import numpy as np
import pytest

from triax.cli.main import main
from triax.inference.checkpoint import CheckpointLoadError, load_params, save_params
from triax.inference.engine import CacheFullError, Engine, EngineConfig, InferenceError
from triax.inference.sampling import SamplingConfig, SamplingError
from triax.inference.replicas import split_devices
from triax.inference.server import Server
from triax.mesh import make_mesh
from triax.models import config

CFG = config.TINY.replace(num_layers=1)


@pytest.fixture(scope="module")
def engine(devices):
    return Engine.from_seed(CFG, make_mesh(devices=devices[:1]), seed=0,
                            ecfg=EngineConfig(max_batch=2, max_len=16, min_bucket=16))


def test_prompt_longer_than_context(engine):
    with pytest.raises(InferenceError, match="longer than the model's context"):
        engine.check_prompt(CFG.max_seq_len + 1, 1)


def test_prompt_not_fitting_with_max_new_tokens(engine):
    with pytest.raises(InferenceError, match=r"12 tokens plus max_new_tokens=6 does not fit"):
        Server([engine]).submit(list(range(12)), max_new_tokens=6)


def test_empty_prompt(engine, capsys):
    with pytest.raises(InferenceError, match="empty prompt"):
        Server([engine]).submit([], max_new_tokens=2)
    assert main(["generate", "--model", "tiny", "--num-layers", "1", "--prompt", "",
                 "--max-new-tokens", "2"]) == 2
    assert "empty prompt" in capsys.readouterr().err


def test_full_cache(engine):
    engine.prefill([0], [np.arange(16)], [0])  # fills all 16 positions of slot 0
    with pytest.raises(CacheFullError, match=r"slot\(s\) \[0\].*16 positions"):
        engine.decode(np.zeros(2, np.int32), np.array([True, False]), np.zeros(2))


def test_replicas_not_dividing_devices(devices, capsys):
    with pytest.raises(InferenceError, match="--replicas 3 does not divide the 8 devices"):
        split_devices(devices, 3)
    assert main(["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "2",
                 "--replicas", "3"]) == 2
    assert "does not divide" in capsys.readouterr().err


def test_bad_sampling_settings():
    with pytest.raises(SamplingError, match="top_p"):
        SamplingConfig(temperature=1.0, top_p=0.0)
    with pytest.raises(SamplingError, match="temperature"):
        SamplingConfig(temperature=-1.0)


def test_checkpoint_roundtrip_and_config_mismatch(tmp_path, devices, capsys):
    mesh = make_mesh(devices=devices[:1])
    cfg, params = load_params(mesh, model="tiny", seed=3, num_layers=1)
    save_params(str(tmp_path), 7, cfg, params)
    mesh2 = make_mesh(tensor=2, devices=devices[:2])
    cfg2, restored = load_params(mesh2, checkpoint=str(tmp_path))  # onto another layout
    assert cfg2 == cfg
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 restored, params)
    with pytest.raises(CheckpointLoadError, match=r"different model \(num_layers: checkpoint 1 "
                                                  r"vs requested 4\)"):
        load_params(mesh, checkpoint=str(tmp_path), model="tiny")
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "hi",
                 "--max-new-tokens", "2", "--json", "--slots", "1"]) == 0   # 2 programs
    out = json.loads(capsys.readouterr().out)
    assert len(out["results"][0]["tokens"]) == 2 and out["decode_tokens_per_s"] > 0


def test_loads_a_training_checkpoint(tmp_path, devices):
    """The layout written by training (state = params + opt_state + step, meta = model)."""
    import dataclasses

    from triax.checkpoint import Checkpointer
    from triax.training.step import Trainer
    trainer = Trainer(CFG, make_mesh(data=2, devices=devices[:2]), "dp")
    state = trainer.init(seed=5)
    ckpt = Checkpointer(str(tmp_path), async_save=False)
    ckpt.save(3, state, {"model": json.loads(json.dumps(dataclasses.asdict(CFG)))}, wait=True)
    ckpt.close()
    cfg, params = load_params(make_mesh(tensor=2, devices=devices[2:4]), checkpoint=str(tmp_path))
    assert cfg == CFG
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 params, state["params"])
