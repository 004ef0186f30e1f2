"""Importing Hugging Face checkpoints: the golden logits ``transformers`` computed, on one
device and sharded over data × tensor × pipe; the config mapping; and every bad input."""
import json
import os
import shutil

import numpy as np
import pytest
import safetensors.numpy

from hf_fixtures import NAMES, fixture, forward_logits, golden, prompts
from triax.hf import HFError, load, model_config, read_config
from triax.hf.load import expected_tensors
from triax.mesh import make_mesh
from triax.models.config import RopeScaling


@pytest.mark.parametrize("name", NAMES)
def test_forward_equals_transformers_on_one_device(name, devices):
    mesh = make_mesh(devices=devices[:1])
    cfg, params, report = load(fixture(name), mesh, "tp")
    g = golden(name)
    for i, got in enumerate(forward_logits(cfg, params, mesh, "tp", prompts(g))):
        np.testing.assert_allclose(got, g[f"logits_{i}"], atol=1e-5, rtol=0, err_msg=f"{i}")
    # one device reads every stored byte exactly once
    sizes = expected_tensors(cfg)
    assert report.bytes_read == 4 * sum(int(np.prod(s)) for s in sizes.values())


def test_llama3_rope_scaling_is_imported():
    cfg = model_config(read_config(fixture("llama")))
    assert cfg.rope_scaling == RopeScaling(factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_seq_len=32)
    assert model_config(read_config(fixture("llama-tied"))).tie_embeddings


@pytest.mark.parametrize("name,strategy", [("llama", "tp"), ("mixtral", "fsdp_tp")])
def test_forward_equals_transformers_on_data_tensor_pipe(name, strategy, devices):
    mesh = make_mesh(data=2, tensor=2, pipe=2, devices=devices)
    cfg, params, _ = load(fixture(name), mesh, strategy)
    specs = {str(params["blocks"]["attn"]["wq_DNH"].sharding.spec),
             str(params["embed"]["table_VD"].sharding.spec)}
    assert any("pipe" in s for s in specs) and any("tensor" in s for s in specs), specs
    g = golden(name)
    rows = prompts(g)
    for i, got in enumerate(forward_logits(cfg, params, mesh, strategy, rows)):
        np.testing.assert_allclose(got, g[f"logits_{i}"], atol=1e-5, rtol=0, err_msg=f"{i}")


def test_loads_in_the_served_dtype(devices, monkeypatch):
    """``dtype=bfloat16`` builds every parameter, stacked or not, in bfloat16 on the
    devices (no float32 copy there), equal to the float32 load cast."""
    import importlib
    import jax
    hf_load = importlib.import_module("triax.hf.load")   # (triax.hf.load is also a function)
    mesh = make_mesh(data=2, tensor=2, pipe=2, devices=devices)
    made = []

    def recording(shape, sharding, read):
        x = from_callback(shape, sharding, read)
        made.append(x.dtype)
        return x
    from_callback = hf_load._from_callback
    monkeypatch.setattr(hf_load, "_from_callback", recording)
    _, half, _ = load(fixture("mixtral"), mesh, "fsdp_tp", dtype="bfloat16")
    assert made and {str(d) for d in made} == {"bfloat16"}, set(made)
    _, full, _ = load(fixture("mixtral"), mesh, "fsdp_tp")
    for (path, h), f in zip(jax.tree_util.tree_leaves_with_path(half), jax.tree.leaves(full)):
        assert h.dtype == np.dtype("bfloat16") and h.sharding == f.sharding, path
        np.testing.assert_array_equal(np.asarray(h), np.asarray(f).astype(h.dtype),
                                      err_msg=str(path))


# ---- config mapping errors ---------------------------------------------------------------
LLAMA = read_config(fixture("llama"))


@pytest.mark.parametrize("change,match", [
    ({"architectures": ["GPT2LMHeadModel"]}, "GPT2LMHeadModel.*LlamaForCausalLM"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, "sliding_window"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "'yarn' is not supported"),
    ({"num_hidden_layers": None}, "num_hidden_layers"),
])
def test_config_fields_triax_would_ignore_are_errors(change, match):
    hf = {**LLAMA, **change}
    hf = {k: v for k, v in hf.items() if v is not None}
    with pytest.raises(HFError, match=match):
        model_config(hf)


def test_mistral_without_sliding_window_is_llama():
    cfg = model_config({**LLAMA, "architectures": ["MistralForCausalLM"],
                        "sliding_window": None})
    assert cfg == model_config(LLAMA)


# ---- bad directories: clear errors before any device memory is spent --------------------
def _copy(name, tmp_path):
    out = tmp_path / name
    shutil.copytree(fixture(name), out)
    return out


def _load(d):
    return load(str(d), make_mesh(devices=__import__("jax").devices()[:1]))


def test_missing_shard(tmp_path):
    d = _copy("llama", tmp_path)
    os.remove(d / "model-00003-of-00007.safetensors")
    with pytest.raises(HFError, match=r"model-00003-of-00007.*not in"):
        _load(d)


def test_index_naming_a_missing_file(tmp_path):
    d = _copy("llama", tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(HFError, match="model-00009-of-00009.safetensors"):
        _load(d)


def test_corrupt_shard(tmp_path):
    d = _copy("mixtral", tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(HFError, match="model.safetensors.*corrupt"):
        _load(d)


def _rewrite(d, name, value):
    tensors = safetensors.numpy.load_file(str(d / "model.safetensors"))
    tensors[name] = value
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))


def test_wrong_shape(tmp_path):
    d = _copy("llama-tied", tmp_path)
    _rewrite(d, "model.layers.1.self_attn.k_proj.weight", np.zeros((16, 64), np.float32))
    with pytest.raises(HFError, match=r"k_proj.*shape \[16, 64\].*\[32, 64\]"):
        _load(d)


def test_uncastable_dtype(tmp_path):
    d = _copy("llama-tied", tmp_path)
    _rewrite(d, "model.norm.weight", np.zeros((64,), np.int8))
    with pytest.raises(HFError, match="model.norm.weight.*I8.*cannot cast"):
        _load(d)


def test_missing_tensor(tmp_path):
    d = _copy("llama-tied", tmp_path)
    tensors = safetensors.numpy.load_file(str(d / "model.safetensors"))
    del tensors["model.layers.0.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(HFError, match="lacks tensor.*up_proj"):
        _load(d)


def test_not_a_model_directory(tmp_path):
    with pytest.raises(HFError, match="no config.json"):
        _load(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(HFError, match="neither model.safetensors nor"):
        _load(tmp_path)
