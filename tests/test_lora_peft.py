"""LoRA in and out in PEFT's format, end to end through the CLI: ``triax train --init-from
BASE --lora-rank R`` then ``triax export`` writes the merged model (= base + B·A·alpha/r, in
PEFT's own ``[out, r] @ [r, in]`` convention) and ``--adapter-only`` the PEFT pair, which
triax's import reads back to the same logits, and ``--adapter`` continues. Each bad adapter
is refused naming the field or key."""
import contextlib
import io
import json
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy

from hf_fixtures import fixture, forward_logits
from triax.cli.main import main
from triax.hf import Checkpoint
from triax.hf.files import HFError
from triax.hf.load import load as hf_load
from triax.hf.load import read_model_config
from triax.hf.peft import (CONFIG, WEIGHTS_FILE, expected, load_adapted, read_adapters,
                           read_config, write_adapters)
from triax.mesh import make_mesh
from triax.models import config, lora
from triax.models.config import LoraConfig
from triax.sharding.partition import abstract_model
from triax.training.config import RunConfig

R, ALPHA = 4, 8.0
ROWS = [np.arange(1, 12, dtype=np.int32) % 300, np.arange(5, 14, dtype=np.int32)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory, devices):
    tmp = tmp_path_factory.mktemp("lora")
    ck, merged, adapter = tmp / "ck", tmp / "merged", tmp / "adapter"
    said, listed = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(said):
        assert main(["train", "--init-from", fixture("llama"), "--data", "markov", "--mesh",
                     "data=4,tensor=2", "--strategy", "fsdp_tp", "--steps", "2", "--lr",
                     "1e-2", "--batch-size", "8", "--seq-len", "16", "--eval-batches", "0",
                     "--lora-rank", str(R), "--lora-alpha", str(ALPHA),
                     "--checkpoint-dir", str(ck), "--no-progress"]) == 0
    with contextlib.redirect_stdout(listed):
        assert main(["checkpoints", str(ck)]) == 0
    assert main(["export", "--checkpoint", str(ck), "--out", str(merged)]) == 0
    assert main(["export", "--checkpoint", str(ck), "--out", str(adapter),
                 "--adapter-only"]) == 0
    return str(merged), str(adapter), said.getvalue(), listed.getvalue()


def test_lora_is_named_at_start_up_and_in_the_listing(exported):
    """A LoRA run says so: the start-up line and ``triax checkpoints`` name rank and alpha."""
    *_, said, listed = exported
    want = f"LoRA rank {R} (alpha {ALPHA:g}) on "
    assert any(line.startswith("triax train: ") and want in line for line in said.splitlines())
    assert want in listed.splitlines()[-1]


def test_adapter_only_is_peft_layout(exported):
    _, adapter, *_ = exported
    assert sorted(os.listdir(adapter)) == [CONFIG, WEIGHTS_FILE]
    with open(os.path.join(adapter, CONFIG)) as fh:
        c = json.load(fh)
    assert (c["peft_type"], c["r"], c["lora_alpha"], c["task_type"], c["bias"]) == \
        ("LORA", R, ALPHA, "CAUSAL_LM", "none")
    assert c["target_modules"] == list(config.PEFT_TARGETS)
    assert c["base_model_name_or_path"] == fixture("llama")
    assert not c["use_dora"] and not c["use_rslora"] and not c["fan_in_fan_out"]
    tensors = safetensors.numpy.load_file(os.path.join(adapter, WEIGHTS_FILE))
    cfg = read_model_config(fixture("llama")).replace(lora=read_config(adapter))
    assert {k: v.shape for k, v in tensors.items()} == expected(cfg)
    # e.g. layer 0's q_proj: lora_A [r, in], lora_B [out, r] (torch Linear layout)
    qa = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    qb = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
    assert qa.shape == (R, cfg.embed_dim) and qb.shape == (cfg.num_heads * cfg.head_dim, R)
    assert np.abs(qb).max() > 0   # trained: B moved off its zero init


def test_merged_export_is_base_plus_scaled_BA(exported):
    merged, adapter, *_ = exported
    base, got = Checkpoint(fixture("llama")), Checkpoint(merged)
    ad = safetensors.numpy.load_file(os.path.join(adapter, WEIGHTS_FILE))
    assert set(got.headers) == set(base.headers)
    adapted = 0
    for name in base.headers:
        key = "base_model.model." + name.removesuffix(".weight")
        want = base.read(name)
        if key + ".lora_A.weight" in ad:   # PEFT's merge: W + B @ A · alpha / r
            want = want + (ALPHA / R) * ad[key + ".lora_B.weight"] @ ad[key + ".lora_A.weight"]
            adapted += 1
        np.testing.assert_allclose(got.read(name), want, rtol=1e-6, atol=1e-6, err_msg=name)
    assert adapted == 7 * 2


def test_adapter_read_back_gives_the_merged_logits(exported, devices):
    merged, adapter, *_ = exported
    mesh = make_mesh(tensor=2, devices=devices[:2])
    cfg, params = load_adapted(fixture("llama"), adapter, mesh, "tp")
    assert cfg.lora == LoraConfig(rank=R, alpha=ALPHA)
    mcfg, mparams, _ = hf_load(merged, mesh, "tp")
    got = forward_logits(cfg, params, mesh, "tp", ROWS)
    want = forward_logits(mcfg, mparams, mesh, "tp", ROWS)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    # The adapter matters: the plain base's logits differ.
    bcfg, bparams, _ = hf_load(fixture("llama"), mesh, "tp")
    base = forward_logits(bcfg, bparams, mesh, "tp", ROWS)
    assert np.abs(base[0] - got[0]).max() > 1e-4


def test_adapter_continues_training(exported, devices):
    """``--init-from BASE --adapter DIR``: step 0 holds DIR's adapters over BASE's weights."""
    from triax.training.init_from import lora_params
    from triax.training.setup import build_run
    _, adapter, *_ = exported
    run = RunConfig.of(init_from=fixture("llama"), lora_rank=R, lora_alpha=ALPHA, adapter=adapter,
                       mesh="data=4,tensor=2", strategy="fsdp_tp", batch_size=8, seq_len=16)
    built = build_run(run)
    params = jax.device_get(lora_params(built.trainer, built.model, run.source.init_from, adapter))
    want = read_adapters(adapter, built.model)
    got = lora.split(params)[0]
    for (p, g), w in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_array_equal(g, w, err_msg=jax.tree_util.keystr(p))


# ---- bad input --------------------------------------------------------------------------
CFG = read_model_config(fixture("llama")).replace(lora=LoraConfig(rank=R, alpha=ALPHA))


@pytest.fixture
def good(tmp_path):
    """A valid PEFT adapter of the llama fixture (random weights), written by triax."""
    rng = np.random.default_rng(0)
    shapes = lora.split(abstract_model(CFG).shapes)[0]
    params = jax.tree.map(lambda s: rng.standard_normal(s.shape).astype(np.float32), shapes)
    write_adapters(params, CFG, str(tmp_path / "ad"), base_model="llama")
    return str(tmp_path / "ad")


def _edit_config(d, **kw):
    with open(os.path.join(d, CONFIG)) as fh:
        c = json.load(fh)
    c.update(kw)
    with open(os.path.join(d, CONFIG), "w") as fh:
        json.dump(c, fh)


@pytest.mark.parametrize("field,value,needle", [
    ("use_dora", True, "use_dora=True is not supported"),
    ("use_rslora", True, "use_rslora=True is not supported"),
    ("bias", "all", "bias='all' is not supported"),
    ("rank_pattern", {"q_proj": 8}, "rank_pattern="),
    ("peft_type", "IA3", "peft_type 'IA3'; only 'LORA'"),
    ("target_modules", ["q_proj", "lm_head"], "unknown module(s) ['lm_head']"),
])
def test_unsupported_peft_options_are_refused(good, field, value, needle):
    _edit_config(good, **{field: value})
    with pytest.raises(HFError) as e:
        read_config(good)
    assert needle in str(e.value) and CONFIG in str(e.value), str(e.value)


def test_rank_and_targets_must_match_the_run(good):
    with pytest.raises(HFError, match=r"r=4 but the run asks --lora-rank 8; give --lora-rank 4"):
        read_config(good, LoraConfig(rank=8))
    with pytest.raises(HFError, match=r"target_modules=.* but the run asks --lora-targets "
                                      r"q_proj,v_proj"):
        read_config(good, LoraConfig(rank=R, targets=("q_proj", "v_proj")))


def test_missing_key_and_wrong_shape_are_named(good):
    path = os.path.join(good, WEIGHTS_FILE)
    t = safetensors.numpy.load_file(path)
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    shutil.copy(path, path + ".bak")
    safetensors.numpy.save_file({k: v for k, v in t.items() if k != key}, path)
    with pytest.raises(HFError, match=r"missing \['" + key.replace(".", r"\.")):
        read_adapters(good, CFG)
    safetensors.numpy.save_file({**t, key: np.zeros((64, R + 1), np.float32)}, path)
    with pytest.raises(HFError, match=key.replace(".", r"\.") + r" has shape \(64, 5\), "
                                      r"expected \(64, 4\)"):
        read_adapters(good, CFG)


def test_missing_files_are_named(good):
    os.remove(os.path.join(good, WEIGHTS_FILE))
    with pytest.raises(HFError, match=f"no {WEIGHTS_FILE}"):
        read_adapters(good, CFG)
    os.remove(os.path.join(good, CONFIG))
    with pytest.raises(HFError, match=f"no {CONFIG}"):
        read_config(good)


def test_bad_run_settings_are_refused():
    with pytest.raises(ValueError, match="adapters on MoE expert weights are not supported"):
        config.TINY_MOE.replace(lora=LoraConfig(rank=4))
    with pytest.raises(ValueError, match="--adapter 'x' continues a PEFT adapter over its base "
                                         "model: give --init-from"):
        RunConfig.of(lora_rank=4, adapter="x")
    with pytest.raises(ValueError, match="--base-dtype needs LoRA: give --lora-rank"):
        RunConfig.of(base_dtype="bfloat16")
    with pytest.raises(ValueError, match=r"--lora-targets q_proj,qkv: unknown module\(s\) "
                                         r"\['qkv'\]"):
        RunConfig.of(lora_rank=4, lora_targets="q_proj,qkv").model_config()
