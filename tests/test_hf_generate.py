"""``triax generate --model-dir``: the greedy tokens ``transformers`` produced, through the
directory's tokenizer, on tensor=2 and on 2 replicas; a tokenizer larger than the model's
vocabulary is refused."""
import json
import shutil

import pytest
from tokenizers import Tokenizer

from hf_fixtures import fixture, golden
from triax.cli.main import main


@pytest.mark.parametrize("name,layout", [
    ("llama", ["--mesh", "tensor=2", "--replicas", "4"]),     # the CLI uses all 8 devices
    ("mixtral", ["--mesh", "tensor=4", "--replicas", "2"])])
def test_generate_model_dir_equals_transformers(name, layout, capsys, devices):
    g = golden(name)
    prompts = [str(p) for p in g["prompts"]]
    argv = ["generate", "--model-dir", fixture(name), "--max-new-tokens", "8", "--json"]
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv + layout) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in out["results"]] == prompts
    assert [r["tokens"] for r in out["results"]] == [g[f"greedy_{i}"].tolist()
                                                     for i in range(len(prompts))]
    assert all(isinstance(r["text"], str) for r in out["results"])


def test_tokenizer_larger_than_vocab_is_refused(tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(fixture("llama-tied"), d)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))
    tok.add_tokens(["<extra_a>", "<extra_b>"])
    tok.save(str(d / "tokenizer.json"))
    assert main(["generate", "--model-dir", str(d), "--prompt", "hi", "--max-new-tokens",
                 "2"]) == 2
    err = capsys.readouterr().err
    assert "322 tokens" in err and "vocab_size is 320" in err
