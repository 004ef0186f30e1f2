"""``triax generate --model-dir``: the greedy tokens ``transformers`` produced, through the
directory's tokenizer, on tensor=2 and on 2 replicas; a tokenizer larger than the model's
vocabulary is refused."""
import json
import shutil

from tokenizers import Tokenizer

from hf_fixtures import fixture, golden
from triax.cli.main import main
from triax.hf.tokenizer import load_tokenizer
from triax.inference import build_server, generate
from triax.serve_config import ServeConfig


def _expected(g):
    return [g[f"greedy_{i}"].tolist() for i in range(len(g["prompts"]))]


def test_cli_generate_model_dir_on_tensor2(capsys, devices):
    g = golden("llama")
    prompts = [str(p) for p in g["prompts"]]
    argv = ["generate", "--model-dir", fixture("llama"), "--max-new-tokens", "8", "--json",
            "--mesh", "data=4,tensor=2", "--slots", "4", "--dtype", "float32"]  # one engine on the CLI's 8 devices;
    # 4 slots = one row per data shard, so prefill compiles one batch bucket, not two
    for p in prompts:
        argv += ["--prompt", p]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in out["results"]] == prompts
    assert [r["tokens"] for r in out["results"]] == _expected(g)
    assert all(isinstance(r["text"], str) for r in out["results"])


def test_generate_model_dir_on_two_replicas(devices):
    g = golden("mixtral")
    prompts = [str(p) for p in g["prompts"]]
    tok = load_tokenizer(fixture("mixtral"))
    # slots=1: one prefill batch bucket, fewer compiles per replica
    server = build_server(ServeConfig.of(model_dir=fixture("mixtral"), replicas=2, slots=1,
                                         dtype="float32"),
                          longest=max(len(tok.encode(p)) for p in prompts), max_new_tokens=8,
                          devices=devices[:2])
    out = generate(server, prompts, 8, tokenizer=tok)
    assert [r["tokens"] for r in out["results"]] == _expected(g)
    assert out["results"][0]["text"] == tok.decode(g["greedy_0"])


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
