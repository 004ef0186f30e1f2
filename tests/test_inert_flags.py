"""A flag that has no effect in the combination given is named in a warning (only flags the
user gave; settings that cannot work stay errors)."""
import warnings

import pytest

from triax.cli.main import build_parser
from triax.cli.plan_cmd import plan_inputs
from triax.cli.serving_flags import serve_config
from triax.cli.train_cmd import run_config_and_given
from triax.training.config import RunConfigWarning


def _warned(argv, build) -> list[str]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        build(build_parser().parse_args(argv))
    return [str(x.message) for x in w if issubclass(x.category, UserWarning)]


TRAIN = lambda args: run_config_and_given(args)   # noqa: E731


@pytest.mark.parametrize("argv,flag", [
    (["train", "--lora-alpha", "32"], "--lora-alpha has no effect without LoRA"),
    (["train", "--lora-targets", "q_proj"], "--lora-targets has no effect without LoRA"),
    (["train", "--mesh", "data=8", "--schedule", "gpipe"], "--schedule has no effect: the mesh"),
    (["train", "--mesh", "data=8", "--pipeline-fsdp", "layer"], "--pipeline-fsdp has no effect"),
    (["train", "--mesh", "data=4,tensor=2", "--microbatches", "4"], "--microbatches has no"),
    (["train", "--objective", "latency"], "--objective has no effect without --plan auto"),
    (["train", "--allow-fp8"], "--allow-fp8 has no effect without --plan auto"),
    (["train", "--plan-gpu", "h100-80gb:4,a100-80gb:4"], "--plan-gpu has no effect without"),
])
def test_train_names_the_inert_flag(argv, flag):
    msgs = _warned(argv, TRAIN)
    assert any(m.startswith(flag) for m in msgs), msgs


@pytest.mark.parametrize("argv", [
    ["train"],                                                   # defaults are never named
    ["train", "--lora-rank", "4", "--lora-alpha", "32"],
    ["train", "--mesh", "data=4,pipe=2", "--schedule", "gpipe"],
    ["train", "--schedule", "gpipe"],             # the mesh is picked later: may have pipe
    ["train", "--mesh", "pipe=-1", "--virtual", "2"],
    ["train", "--plan", "auto", "--objective", "throughput"],
    ["train", "--plan", "auto", "--allow-fp8"],
])
def test_no_warning_when_the_flag_acts(argv):
    assert _warned(argv, TRAIN) == []


def test_lora_dropout_without_lora_stays_an_error():
    with pytest.raises(ValueError, match="--lora-dropout needs LoRA"):
        TRAIN(build_parser().parse_args(["train", "--lora-dropout", "0.1"]))


def test_the_warning_is_a_run_config_warning():
    with pytest.warns(RunConfigWarning, match="--lora-alpha"):
        TRAIN(build_parser().parse_args(["train", "--lora-alpha", "8"]))


def test_plan_names_the_inert_flag():
    assert _warned(["plan", "--lora-alpha", "8"], plan_inputs) == \
        ["--lora-alpha has no effect without LoRA (give --lora-rank R)"]


GEN = ["generate", "--model", "tiny", "--prompt", "hi", "--max-new-tokens", "2"]


@pytest.mark.parametrize("flags,named", [
    (["--top-k", "5"], "--top-k has no effect with greedy decoding"),
    (["--greedy", "--top-p", "0.9"], "--top-p has no effect with greedy decoding"),
    (["--objective", "latency"], "--objective has no effect without --plan auto"),
    (["--skip-memory-check", "--device-memory", "1GiB"], "--device-memory has no effect"),
    (["--temperature", "0.7", "--top-k", "5"], None),
])
def test_serving_names_the_inert_flag(flags, named):
    msgs = _warned(GEN + flags, serve_config)
    assert (msgs == []) if named is None else any(m.startswith(named) for m in msgs), msgs
