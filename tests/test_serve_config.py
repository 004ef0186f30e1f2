"""``ServeConfig``: ``serve`` and ``generate``'s flags are its fields, and it refuses what
cannot be served, naming the flag and the fix, before any device starts."""
import argparse

import pytest

from triax.cli.main import build_parser, main
from triax.cli.serving_flags import serve_config
from triax.configs import leaves
from triax.serve_config import ServeConfig


def _flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {s for a in sub.choices[command]._actions for s in a.option_strings}


@pytest.mark.parametrize("command,own", [
    ("generate", {"--prompt", "--prompts-file", "--json"}),
    ("serve", set())])
def test_every_flag_is_a_field(command, own):
    """No hand-written flag restates a field: every flag but the command's own inputs is a
    ServeConfig leaf, and each leaf the command uses is a flag."""
    fields = {"--" + n.replace("_", "-") for n in leaves(ServeConfig)}
    fields |= {"--no-" + f[2:] for f in fields}   # a switch on by default: --no-<name>
    flags = _flags(command) - {"-h", "--help"} - own
    assert flags <= fields, flags - fields
    assert {"--slots", "--kv-blocks", "--stop-token", "--mesh", "--plan"} <= flags
    assert ("--port" in flags) == (command == "serve")
    assert ("--temperature" in flags) == (command == "generate")


@pytest.mark.parametrize("values,match", [
    ({"port": 99999}, "--port 99999: must be in 0..65535"),
    ({"port": -1}, "--port -1: must be in 0..65535"),
    ({"model_dir": "d", "checkpoint": "c"}, "give one of --model-dir, --checkpoint, --model"),
    ({"kv_blocks": 4, "kv_memory": "1MiB"}, "give one of --kv-blocks and --kv-memory"),
    ({"slots": 0}, "--slots 0: must be ≥ 1"),
    ({"top_p": 0}, "--top-p 0: must be in \\(0, 1\\]"),
    ({"greedy": True, "temperature": 0.5}, "--greedy and --temperature contradict"),
    ({"adapter": "a", "model": "tiny"}, "--adapter 'a' adapts a Hugging Face base"),
    ({"dry_run": True}, "--dry-run reports --plan auto's choice"),
    ({"strategy": "nope"}, "--strategy 'nope': choose one of")])
def test_refused_with_the_flag_and_the_fix(values, match):
    with pytest.raises(ValueError, match=match):
        ServeConfig.of(**values)


def test_serve_refuses_a_port_out_of_range(capsys):
    """Once accepted and bound modulo 65536; now refused before any device starts."""
    assert main(["serve", "--model", "tiny", "--port", "99999"]) == 2
    assert "--port 99999: must be in 0..65535" in capsys.readouterr().err


def test_flags_reach_the_sections():
    args = build_parser().parse_args(
        ["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "3", "--slots",
         "2", "--kv-block-size", "8", "--stop-token", "5", "--stop-token", "7", "--top-k", "4",
         "--temperature", "0.5"])
    cfg = serve_config(args)
    assert (cfg.engine.slots, cfg.engine.pool.kv_block_size, cfg.engine.stop_token) == \
        (2, 8, (5, 7))
    assert (cfg.sampling.max_new_tokens, cfg.sampling.top_k) == (3, 4)
    assert cfg.replace(kv_block_size=32).engine.pool.kv_block_size == 32


def test_the_compile_cache_dir_follows_the_flag_the_env_and_the_user_cache(monkeypatch,
                                                                          tmp_path):
    import jax
    from triax.cli.serve_cmd import use_compile_cache
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert ServeConfig().http.compile_cache_dir() == str(tmp_path / "triax" / "xla")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "/env")
    assert ServeConfig().http.compile_cache_dir() == "/env"
    assert ServeConfig.of(compile_cache="/d").http.compile_cache_dir() == "/d"
    assert ServeConfig.of(compile_cache="off").http.compile_cache_dir() is None
    before = jax.config.jax_compilation_cache_dir
    try:
        use_compile_cache(str(tmp_path / "x"))
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "x")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_the_engine_switches_parse():
    parse = build_parser().parse_args
    on = serve_config(parse(["serve", "--model", "tiny"])).engine
    off = serve_config(parse(["serve", "--model", "tiny", "--no-prefix-cache", "--dtype",
                              "float32", "--kv-dtype", "int8"])).engine
    assert (on.prefix_cache, on.dtype, on.pool.kv_dtype) == (True, "bfloat16", "auto")
    assert (off.prefix_cache, off.dtype, off.pool.kv_dtype) == (False, "float32", "int8")
