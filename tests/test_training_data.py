"""Data, tokenizer, run config and the set-up errors of `triax train` (no compiles here)."""
import os

import numpy as np
import pytest

from triax.cli.main import main
from triax.mesh import make_mesh
from triax.models import config as mc
from triax.training.config import RunConfig, load_config_file
from triax.training.data import (Batches, DataError, load_corpus, markov_chain, process_rows,
                                 unigram_loss)
from triax.training.setup import build_mesh, check_batch, default_mesh
from triax.text.byte_tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip_and_vocab():
    tok = ByteTokenizer()
    ids = tok.encode("naïve ∑ text", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "naïve ∑ text"
    assert tok.vocab_size == mc.TINY.vocab_size == 264


def test_markov_entropy_rate_matches_empirical_bigram_entropy():
    toks, h = markov_chain(num_states=8, length=200_000, seed=3)
    counts = np.zeros((8, 8))
    np.add.at(counts, (toks[:-1], toks[1:]), 1)
    p = counts / counts.sum(1, keepdims=True)
    pi = counts.sum(1) / counts.sum()
    with np.errstate(divide="ignore", invalid="ignore"):
        emp = -np.nansum(pi[:, None] * np.where(p > 0, p * np.log(p), 0))
    assert abs(emp - h) < 0.01
    assert h < unigram_loss(toks)


def test_pydoc_corpus_split_and_baseline():
    c = load_corpus("pydoc")
    assert len(c.tokens) > 400_000 and len(c.train) + len(c.val) == len(c.tokens)
    assert 3.0 < c.info["unigram_loss"] < 3.5


def test_batches_are_deterministic_and_resumable():
    toks = np.arange(10_000, dtype=np.int32)
    a = Batches(toks, 8, 16, seed=1)
    first = [a.numpy_batch(i) for i in range(3)]
    b = Batches(toks, 8, 16, seed=1, position=2)  # resumed at position 2
    np.testing.assert_array_equal(b.numpy_batch(b.position)["inputs"], first[2]["inputs"])
    np.testing.assert_array_equal(first[0]["targets"][:, :-1], first[0]["inputs"][:, 1:])
    assert not np.array_equal(Batches(toks, 8, 16, seed=2).numpy_batch(0)["inputs"],
                              first[0]["inputs"])


def test_global_batch_is_the_same_on_any_mesh(devices):
    toks = np.arange(10_000, dtype=np.int32)
    data = Batches(toks, 8, 16, seed=0)
    ref = data.numpy_batch(0)
    for mesh in (make_mesh(data=8), make_mesh(data=2, tensor=4)):
        from triax.sharding.partition import batch_sharding
        sh = batch_sharding(mesh, "dp")
        assert process_rows(sh, (8, 16)) == slice(0, 8)  # one process reads every row
        got = data.global_batch(0, sh)
        np.testing.assert_array_equal(np.asarray(got["inputs"]), ref["inputs"])
        assert got["inputs"].sharding == sh


def test_npy_tokens_are_memory_mapped(tmp_path):
    path = tmp_path / "toks.npy"
    np.save(path, np.arange(5000, dtype=np.int32) % 250)
    c = load_corpus(str(path))
    assert isinstance(c.tokens, np.memmap)


@pytest.mark.parametrize("make,match", [
    (lambda p: str(p / "missing.txt"), "does not exist"),
    (lambda p: str(p), "not a readable file"),
    (lambda p: _write(p / "bad.npy", b"not numpy"), "cannot read data file"),
    (lambda p: _npy(p / "floats.npy", np.zeros(100, np.float32)), "1-D integer array"),
])
def test_bad_data_file_errors(tmp_path, make, match):
    with pytest.raises(DataError, match=match):
        load_corpus(make(tmp_path))


def _write(path, data):
    path.write_bytes(data)
    return str(path)


def _npy(path, arr):
    np.save(path, arr)
    return str(path)


def test_unreadable_data_file(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("hello")
    os.chmod(path, 0)
    if os.access(path, os.R_OK):
        pytest.skip("running as root: permissions are not enforced")
    with pytest.raises(DataError, match="not a readable file"):
        load_corpus(str(path))


def test_cli_bad_data_file_is_a_clean_error(tmp_path, capsys):
    rc = main(["train", "--data", str(tmp_path / "nope.txt"), "--steps", "1", "--mesh", "data=8",
               "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "triax train: error: data file" in err and "does not exist" in err


def test_batch_not_divisible_names_numbers_and_a_valid_size(devices):
    mesh = make_mesh(data=4, tensor=2)
    with pytest.raises(ValueError, match=r"--batch-size 10 is not divisible by data \(4\) × "
                                         r"micro-batches \(2\) = 8; use e.g. --batch-size 8"):
        check_batch(RunConfig.of(batch_size=10, grad_accum=2), mesh)
    check_batch(RunConfig.of(batch_size=16, grad_accum=2), mesh)


def test_mesh_needing_more_devices_than_exist(devices):
    with pytest.raises(ValueError, match="needs 16 devices but only 8 exist"):
        build_mesh(RunConfig.of(mesh="data=4,tensor=4"), mc.TINY)


def test_default_mesh_is_3d_on_8_devices():
    assert default_mesh(8, mc.TINY) == {"data": 2, "tensor": 2, "pipe": 2}
    assert default_mesh(1, mc.TINY) == {"data": 1, "tensor": 1, "pipe": 1}


def test_config_file_toml_and_yaml_and_flags_override(tmp_path):
    from triax.cli.main import build_parser
    from triax.cli.train_cmd import run_config_and_given
    toml = tmp_path / "run.toml"
    toml.write_text('model = "tiny"\nsteps = 7\nbatch-size = 8\n[mesh]\ndata = 4\ntensor = 2\n')
    yml = tmp_path / "run.yaml"
    yml.write_text("steps: 9\nlr: 0.01\n")
    args = build_parser().parse_args(["train", "--config", str(toml), "--steps", "3"])
    run, given = run_config_and_given(args)
    assert (run.loop.steps, run.dataset.batch_size, run.layout.mesh) == (3, 8, "data=4,tensor=2")
    assert given == {"model", "steps", "batch_size", "mesh"}
    assert load_config_file(str(yml)) == {"steps": 9, "lr": 0.01}
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(ValueError, match=r"unknown keys \['stepz'\]"):
        load_config_file(str(bad))
    broken = tmp_path / "broken.yaml"
    broken.write_text("steps: [1,\n")
    with pytest.raises(ValueError, match="is not valid"):
        load_config_file(str(broken))
