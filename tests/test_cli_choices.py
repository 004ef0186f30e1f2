"""The CLI's named choices come from one home (``triax.choices``): a flag that several
commands share accepts the same values in each, and every name ``choices.py`` holds."""
import argparse

import pytest

from triax import choices
from triax.cli.main import build_parser
from triax.cli.plan_cmd import plan_inputs
from triax.cli.serve_cmd import DEFAULTS as SERVE_DEFAULTS
from triax.cli.serving_flags import serve_config
from triax.pipeline.schedules import ScheduleKind
from triax.cli.run_flags import FIELDS as RUN_FIELDS
from triax.training.config import TRAIN_SCHEDULES

COMMANDS = ("train", "inspect", "plan", "generate", "serve")


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def _flag_choices(p):
    """``--flag`` -> its choices (None when the flag takes any value)."""
    out = {}
    for a in p._actions:
        for s in a.option_strings:
            if s.startswith("--"):
                out[s] = None if a.choices is None else tuple(a.choices)
    return out


@pytest.fixture(scope="module")
def flags():
    subs = _subparsers(build_parser())
    return {c: _flag_choices(subs[c]) for c in COMMANDS}


def test_shared_flags_have_the_same_choices_everywhere(flags):
    seen = {}
    for cmd, fl in flags.items():
        for flag, ch in fl.items():
            seen.setdefault(flag, {})[cmd] = ch
    for flag, by_cmd in seen.items():
        given = {c: ch for c, ch in by_cmd.items() if ch is not None}
        if len(given) < 1 or len(by_cmd) < 2:
            continue
        if flag == "--dtype":   # plan: --precision's alias (fp16 too); serving: the weights'
            assert by_cmd.pop("plan") == tuple(choices.PRECISIONS)
            assert set(by_cmd.values()) == {choices.SERVE_DTYPES}, by_cmd
            continue
        if flag == "--schedule":  # a plan may be for inference: forward-only too
            assert by_cmd.pop("plan") == tuple(k.value for k in ScheduleKind)
            assert set(by_cmd.values()) == {TRAIN_SCHEDULES}, by_cmd
            continue
        # A flag limited to a set in one command is limited to the same set in all.
        assert len(set(by_cmd.values())) == 1, f"{flag}: {by_cmd}"


@pytest.mark.parametrize("flag,names", [
    ("--strategy", choices.STRATEGIES), ("--remat", choices.REMAT_POLICIES),
    ("--attention", choices.ATTENTION_CHOICES),
    ("--context-attention", choices.CONTEXT_SCHEMES)])
def test_flags_accept_every_named_choice(flags, flag, names):
    for cmd, fl in flags.items():
        if flag in fl:
            assert fl[flag] == tuple(names), f"triax {cmd} {flag}: {fl[flag]}"
    assert flags["plan"][flag] == tuple(names)
    assert flags["train"][flag] == tuple(names)


def test_precision_names(flags):
    assert flags["train"]["--precision"] == tuple(choices.PRECISIONS)
    assert flags["plan"]["--dtype"] == flags["plan"]["--precision"] == tuple(choices.PRECISIONS)


# Flags a command keeps as its own because they mean something else there: a plan may be
# for inference (forward-only schedules) and its micro-batches default to 1, not 2 × pipe;
# generate and serve check weights and KV cache against memory, not a compiled step.
OWN = {("plan", "--schedule"), ("plan", "--microbatches"),
       ("generate", "--skip-memory-check"), ("serve", "--skip-memory-check")}


def test_shared_run_flags_are_run_config_fields(flags):
    """A flag named after a RunConfig field carries the field's help in every command that
    has it (written once, by ``add_run_flags``), not a restated one."""
    subs = _subparsers(build_parser())
    for cmd in COMMANDS:
        for a in subs[cmd]._actions:
            for s in a.option_strings:
                name = s[2:].replace("-", "_")
                if (cmd, s) in OWN or name not in RUN_FIELDS or not s.startswith("--"):
                    continue
                assert a.help.startswith(RUN_FIELDS[name].metadata["help"].replace("%", "%%")), \
                    f"triax {cmd} {s}: {a.help!r}"


PLAN_ARGS = ["plan", "--model", "tiny", "--train", "--gpu", "h100-80gb", "--gpus-per-node", "8",
             "--nodes", "1"]


def test_command_defaults():
    """Each command keeps its own defaults for the flags it shares with ``triax train``."""
    p = build_parser()
    plan = plan_inputs(p.parse_args(PLAN_ARGS))   # train's defaults; the layout searched
    run = plan.run
    ds, comp, src = run.dataset, run.compute, run.source
    assert (ds.batch_size, ds.seq_len, comp.precision, comp.remat, comp.attention,
            comp.loss_chunks, src.num_layers, src.max_seq_len, plan.layout) == \
        (16, 128, "fp32", "none", "auto", 1, None, None, {})
    gen = serve_config(p.parse_args(["generate", "--model", "tiny", "--prompt", "hi",
                                     "--max-new-tokens", "1"]))
    assert (gen.source.seed, gen.layout.mesh, gen.layout.context_attention,
            gen.source.num_layers, gen.engine.slots, gen.engine.max_queue) == \
        (0, "", "all-gather", None, 8, None)
    serve = serve_config(p.parse_args(["serve", "--model", "tiny"]), **SERVE_DEFAULTS)
    assert (serve.engine.max_queue, serve.http.port) == (64, 8000)
    # train and inspect leave what is not given to --config and RunConfig.
    train = p.parse_args(["train"])
    assert train.seq_len is None and train.mesh is None and train.seed is None
    assert p.parse_args(["inspect"]).seq_len is None
