"""``triax generate --model-dir BASE --adapter DIR`` and ``triax serve … --adapter DIR`` run a
PEFT adapter unmerged (``x·W + x·A·B·alpha/r``): their greedy tokens equal those of the
merged export (base + B·A·alpha/r written as plain weights) and differ from the base's. A
mismatching adapter fails naming what does not match. In-process ``cli.main`` calls on the
tiny ``llama`` fixture."""
import json
import os
import shutil

import jax
import numpy as np
import pytest
import safetensors.numpy
from fastapi.testclient import TestClient

from hf_fixtures import fixture
from triax.cli.main import main
from triax.hf.export import export, tokenizer_files_in
from triax.hf.load import load as hf_load
from triax.hf.peft import CONFIG, WEIGHTS_FILE, write_adapters
from triax.mesh import make_mesh
from triax.models import lora
from triax.models.config import LoraConfig
from triax.sharding.partition import abstract_model

R, ALPHA = 4, 8.0
PROMPTS = ["hello world", "the cat"]
NEW = 8
# one engine on the CLI's 8 devices; 4 slots = one row per data shard (one prefill bucket)
LAYOUT = ["--mesh", "data=4,tensor=2", "--slots", "4", "--dtype", "float32"]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, devices):
    """``(adapter, merged)``: a PEFT adapter of random A and B over the fixture, and the
    fixture with that adapter merged in (``lora.merged``), as HF directories."""
    tmp = tmp_path_factory.mktemp("lora_gen")
    mesh = make_mesh(devices=devices[:1])
    cfg, base, _ = hf_load(fixture("llama"), mesh, "dp")
    cfg = cfg.replace(lora=LoraConfig(rank=R, alpha=ALPHA))
    rng = np.random.default_rng(0)
    ad = jax.tree.map(lambda s: (0.3 * rng.standard_normal(s.shape)).astype(np.float32),
                      lora.split(abstract_model(cfg).shapes)[0])
    write_adapters(ad, cfg, str(tmp / "adapter"), base_model=fixture("llama"))
    merged = jax.device_get(jax.jit(lora.merged, static_argnums=1)(
        lora.join(ad, jax.device_get(base)), cfg.lora))
    export(merged, cfg.replace(lora=None), str(tmp / "merged"),
           tokenizer_files=tokenizer_files_in(fixture("llama")))
    return str(tmp / "adapter"), str(tmp / "merged")


def _generate(capsys, *source):
    argv = ["generate", *source, "--max-new-tokens", str(NEW), "--json", *LAYOUT]
    for p in PROMPTS:
        argv += ["--prompt", p]
    assert main(argv) == 0
    return [r["tokens"] for r in json.loads(capsys.readouterr().out)["results"]]


def test_generate_with_adapter_equals_the_merged_export(dirs, capsys):
    adapter, merged = dirs
    got = _generate(capsys, "--model-dir", fixture("llama"), "--adapter", adapter)
    want = _generate(capsys, "--model-dir", merged)
    base = _generate(capsys, "--model-dir", fixture("llama"))
    assert got == want
    assert got != base, "the adapter changed no greedy token"


def _serve_completions(monkeypatch, argv):
    """``triax serve ARGV`` in-process: uvicorn's run is replaced by greedy /v1/completions
    requests (one per prompt) to the app it was given; their completion texts."""
    import uvicorn
    texts = []

    def run(self, sockets=None):   # serve binds its socket first
        with TestClient(self.config.app) as client:
            for p in PROMPTS:
                r = client.post("/v1/completions", json={"model": "m", "prompt": p,
                                                          "max_tokens": NEW, "temperature": 0})
                assert r.status_code == 200, r.text
                texts.append(r.json()["choices"][0]["text"])
    monkeypatch.setattr(uvicorn.Server, "run", run)
    monkeypatch.setattr("signal.signal", lambda *a: None)   # serve's SIGTERM handler
    assert main(["serve", *argv, "--port", "0", "--served-model-name", "m", *LAYOUT]) == 0
    return texts


def test_serve_with_adapter_equals_the_merged_export(dirs, monkeypatch):
    """No base run here: the merged export's greedy tokens differ from the base's
    (``test_generate_with_adapter_equals_the_merged_export``, the same adapter, prompts and
    layout), so a serve that dropped the adapter would fail ``got == want``."""
    adapter, merged = dirs
    got = _serve_completions(monkeypatch, ["--model-dir", fixture("llama"), "--adapter",
                                           adapter])
    want = _serve_completions(monkeypatch, ["--model-dir", merged])
    assert got == want


def _edit_config(d, **kw):
    with open(os.path.join(d, CONFIG)) as fh:
        c = json.load(fh)
    c.update(kw)
    with open(os.path.join(d, CONFIG), "w") as fh:
        json.dump(c, fh)


def test_mismatching_adapter_is_refused(dirs, tmp_path, capsys):
    adapter, _ = dirs
    bad = str(tmp_path / "bad")

    def refused(command="generate", source=("--model-dir", fixture("llama"))):
        argv = [command, *source, "--adapter", bad, *LAYOUT] + (
            ["--prompt", "hi", "--max-new-tokens", "2"] if command == "generate" else [])
        assert main(argv) == 2
        return capsys.readouterr().err

    shutil.copytree(adapter, bad)   # one tensor of another base's shape
    tensors = safetensors.numpy.load_file(os.path.join(bad, WEIGHTS_FILE))
    key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
    tensors[key] = np.zeros((R, 80), np.float32)   # this base's intermediate_size is 96
    safetensors.numpy.save_file(tensors, os.path.join(bad, WEIGHTS_FILE))
    err = refused()
    assert f"{key} has shape (4, 80), expected (4, 96)" in err, err
    assert "has shape" in refused("serve")   # serve loads it the same way
    _edit_config(bad, target_modules=["q_proj", "qkv"])
    err = refused()
    assert "--lora-targets q_proj,qkv: unknown module(s) ['qkv']" in err, err
    _edit_config(bad, target_modules=["q_proj"])   # fewer targets than the tensors hold
    assert "unexpected" in refused()
    _edit_config(bad, target_modules=list(LoraConfig(rank=R).targets), use_dora=True)
    assert "use_dora=True is not supported" in refused()
    shutil.rmtree(bad)
    assert f"adapter {bad!r}: no {CONFIG}" in refused()
    err = refused(source=("--model", "tiny"))
    assert "adapts a Hugging Face base: give --model-dir" in err, err
