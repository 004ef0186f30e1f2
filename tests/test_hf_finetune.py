"""``triax train --init-from DIR`` starts from the Hugging Face weights on a sharded mesh
(with lr 0 the checkpoint still holds exactly the fixture's tensors, which ``triax export``
writes back with the run's tokenizer); ``triax plan --model-dir`` plans DIR's model; a
``--model`` beside ``--init-from`` is an error."""
import json
import os

import numpy as np
import pytest

from hf_fixtures import fixture
from triax.cli.main import main
from triax.hf import Checkpoint, read_model_config
from triax.training.config import RunConfig, RunConfigWarning
from triax.training.init_from import init_from_config


def test_init_from_then_export_gives_the_fixture_back(tmp_path, capsys, devices):
    ck, out = tmp_path / "ck", tmp_path / "hf"
    # --lr 1e-30: an Adam step moves no fp32 weight (a zero --lr is refused as a mistake).
    assert main(["train", "--init-from", fixture("llama"), "--data", "markov", "--mesh",
                 "data=4,tensor=2", "--strategy", "fsdp_tp", "--steps", "1", "--lr",
                 "1e-30", "--batch-size", "8", "--seq-len", "16", "--eval-batches", "0",
                 "--checkpoint-dir", str(ck), "--no-progress"]) == 0
    assert main(["export", "--checkpoint", str(ck), "--out", str(out)]) == 0
    assert "tokenizer.json" in os.listdir(out)  # the run's --init-from directory's
    want, got = Checkpoint(fixture("llama")), Checkpoint(str(out))
    assert set(got.headers) == set(want.headers)
    for n in want.headers:
        np.testing.assert_array_equal(got.read(n), want.read(n), err_msg=n)


def test_model_beside_init_from_is_an_error(capsys):
    assert main(["train", "--init-from", fixture("llama"), "--model", "tiny"]) == 2
    assert "--model 'tiny' conflicts with --init-from" in capsys.readouterr().err


def test_plan_model_dir(capsys):
    assert main(["plan", "--model-dir", fixture("mixtral"), "--inference", "--gpu",
                 "h100-80gb", "--gpus-per-node", "8", "--nodes", "1", "--top", "1",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    cfg = read_model_config(fixture("mixtral"))
    assert json.dumps(out).count(cfg.name) >= 1


def test_init_from_past_its_context_warns_and_lengthens_it():
    """A pretrained model run past the context it was trained on (the fixture's 256) warns,
    naming the model, its directory and both lengths, and runs: RoPE needs no table."""
    d = fixture("llama")
    trained = read_model_config(d)
    with pytest.warns(RunConfigWarning) as got:
        cfg = init_from_config(RunConfig.of(init_from=d, seq_len=2 * trained.max_seq_len))
    msg = str(got[0].message)
    for part in (f"--seq-len {2 * trained.max_seq_len}", trained.name, repr(d),
                 f"max_seq_len {trained.max_seq_len}"):
        assert part in msg, (part, msg)
    assert cfg.max_seq_len == 2 * trained.max_seq_len
    RunConfig.of(init_from=d, seq_len=2 * trained.max_seq_len).check_model(cfg)   # not refused
