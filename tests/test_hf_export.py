"""``triax export``: the exported tensors are the fixture's own (bit for bit), re-importing
the export reproduces the checkpoint's parameters exactly, shards respect the size limit,
a non-empty target is refused without ``--overwrite``, and the merged and the adapter
export's directory and files get the user's umask."""
import json
import os
import stat

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

from hf_fixtures import fixture
from triax.cli.main import main
from triax.hf import Checkpoint, HFError, load
from triax.hf.export import export
from triax.hf.peft import write_adapters
from triax.inference.checkpoint import save_params
from triax.mesh import make_mesh
from triax.models import config
from triax.models.config import LoraConfig
from triax.sharding.partition import abstract_model


def _fixture_tensors(name):
    ckpt = Checkpoint(fixture(name))
    return {n: ckpt.read(n) for n in ckpt.headers}


def _assert_same_tensors(out_dir, name):
    want = _fixture_tensors(name)
    got = Checkpoint(str(out_dir))
    assert set(got.headers) == set(want)
    for n, w in want.items():
        assert got.headers[n][1] == "F32"
        np.testing.assert_array_equal(got.read(n), w, err_msg=n)


def _assert_bit_exact(a, b):
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                      err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def llama_ckpt(tmp_path_factory, devices):
    mesh = make_mesh(tensor=2, devices=devices[:2])
    cfg, params, _ = load(fixture("llama"), mesh, "tp")
    d = str(tmp_path_factory.mktemp("ckpt"))
    save_params(d, 3, cfg, params)
    return d, cfg, params


def test_cli_export_roundtrip(llama_ckpt, tmp_path, capsys, devices):
    ckpt, cfg, params = llama_ckpt
    out = tmp_path / "hf"
    assert main(["export", "--checkpoint", ckpt, "--out", str(out), "--max-shard-size",
                 "60KB", "--tokenizer", fixture("llama"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["step"] == 3
    files = sorted(os.listdir(out))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 1 and "model.safetensors.index.json" in files
    assert "tokenizer.json" in files and "config.json" in files
    biggest = max(int(np.prod(s)) * 4 for s, _ in Checkpoint(str(out)).headers.values())
    for f in shards:  # a shard holds one tensor more than the limit only if that tensor alone is
        assert os.path.getsize(out / f) <= max(60_000, biggest) + 4096, f
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)
    _assert_same_tensors(out, "llama")
    with open(out / "config.json") as fh:
        hf = json.load(fh)
    assert hf["rope_scaling"]["rope_type"] == "llama3"
    cfg2, params2, _ = load(str(out), make_mesh(devices=devices[:1]))
    assert cfg2.replace(name=cfg.name) == cfg
    _assert_bit_exact(params2, params)


def test_export_refuses_a_non_empty_directory(llama_ckpt, tmp_path, capsys):
    ckpt, _, _ = llama_ckpt
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert main(["export", "--checkpoint", ckpt, "--out", str(out)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert os.listdir(out) == ["config.json"] and (out / "config.json").read_text() == "{}"
    assert main(["export", "--checkpoint", ckpt, "--out", str(out), "--overwrite"]) == 0
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".export-")]


@pytest.mark.parametrize("name", ["llama-tied", "mixtral"])
def test_export_equals_fixture(name, tmp_path, devices):
    mesh = make_mesh(tensor=2, devices=devices[:2])
    cfg, params, _ = load(fixture(name), mesh, "tp")
    export(params, cfg, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "model.safetensors"]
    _assert_same_tensors(tmp_path / "out", name)
    assert set(load_file(str(tmp_path / "out" / "model.safetensors"))) == set(
        _fixture_tensors(name))
    with pytest.raises(HFError, match="not empty"):
        export(params, cfg, str(tmp_path / "out"))


def _zeros(cfg):
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract_model(cfg).shapes)


def test_exports_get_the_users_umask(tmp_path):
    """Not mkdtemp's 0700 directory, nor the 0600 safetensors writes, nor a private source's
    mode copied with the tokenizer: what the umask gives any new file. The weights are host
    zeros of the model's shapes: the modes are the point, not the values (no init compiled)."""
    cfg = config.get("tiny", num_layers=1)
    lcfg = cfg.replace(lora=LoraConfig(rank=2))
    tok = tmp_path / "tokenizer.json"
    tok.write_text("{}")
    tok.chmod(0o600)
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    old = os.umask(0o027)
    try:
        export(_zeros(cfg), cfg, str(merged), tokenizer_files=[str(tok)])
        write_adapters(_zeros(lcfg), lcfg, str(adapter), "tiny")
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)  # noqa: E731
    assert mode(merged) == mode(adapter) == 0o750
    files = [merged / f for f in os.listdir(merged)] + [adapter / f for f in os.listdir(adapter)]
    assert len(files) == 5 and {f: mode(f) for f in files} == {f: 0o640 for f in files}
