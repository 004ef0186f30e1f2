"""RunConfig's sections: flat names in (``of``, ``replace``, ``--config``), each field in one
section, train's flags unchanged and their help grouped by section. JAX-free and fast."""
import dataclasses

import pytest

from triax.cli.main import build_parser
from triax.configs import leaves, sections
from triax.training import run_sections
from triax.training.config import RunConfig, load_config_file, saved_values

SECTIONS = ("source", "layout", "compute", "optim", "lora", "pipeline", "dataset",
            "checkpoint", "planner", "loop")


def test_every_field_lives_in_one_frozen_section():
    assert tuple(sections(RunConfig)) == SECTIONS
    found = leaves(RunConfig)
    assert len(found) == sum(len(dataclasses.fields(c)) for c in sections(RunConfig).values())
    assert all(len(leaf.path) == 1 and leaf.field.metadata["help"] for leaf in found.values())
    # No section is named like a field: run.<section> is never a string read by mistake.
    assert not set(SECTIONS) & set(found)
    for cls in sections(RunConfig).values():
        assert cls.__dataclass_params__.frozen
    run = RunConfig.of(lr=0.01)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.optim.lr = 1.0
    assert hash(run) == hash(RunConfig.of(lr=0.01))


def test_flat_names_route_to_their_sections():
    run = RunConfig.of(model="tiny", lr=0.01, mesh="data=8", schedule="gpipe", steps=5,
                       plan="auto", checkpoint_dir="ck")
    assert (run.source.model, run.optim.lr, run.layout.mesh, run.pipeline.schedule,
            run.loop.steps, run.planner.plan, run.checkpoint.checkpoint_dir) == \
        ("tiny", 0.01, "data=8", "gpipe", 5, "auto", "ck")
    again = run.replace(lr=0.02, batch_size=4)
    assert (again.optim.lr, again.dataset.batch_size, again.layout.mesh) == (0.02, 4, "data=8")
    assert again.optim.weight_decay == run.optim.weight_decay
    with pytest.raises(TypeError, match="no field 'learning_rate'"):
        RunConfig.of(learning_rate=1.0)


def test_checks_name_the_flag_within_and_across_sections():
    with pytest.raises(ValueError, match=r"^--lr -1: must be > 0"):
        RunConfig.of(lr=-1)
    with pytest.raises(ValueError, match=r"^--steps 0: must be ≥ 1"):
        RunConfig().replace(steps=0)
    with pytest.raises(ValueError, match="--tp-overlap runs its collective matmuls"):
        RunConfig.of(tp_overlap=True, precision="fp8")                 # layout × compute
    with pytest.raises(ValueError, match="give --init-from BASE_DIR too"):
        RunConfig.of(lora_rank=4, adapter="x")                         # lora × source
    with pytest.raises(ValueError, match="--stage-layers fixes uneven stages"):
        RunConfig.of(stage_layers="3,1", plan="auto")                  # pipeline × planner


def test_saved_values_read_sections_and_old_flat_json():
    run = RunConfig.of(lr=0.01, mesh="data=8", lora_rank=4)
    assert saved_values(run.to_json()) == run.flat() == saved_values(run.flat())
    assert RunConfig.from_json({**run.flat(), "gone_field": 1}) == run   # a removed field


def test_train_flags_are_the_fields_grouped_by_section():
    p = build_parser()
    train = p._subparsers._group_actions[0].choices["train"]
    groups = {g.title: {a.dest for a in g._group_actions} for g in train._action_groups}
    for name, cls in sections(RunConfig).items():
        assert groups[name] == set(leaves(cls)), name
    args = p.parse_args(["train", "--lr", "0.5", "--no-progress", "--stage-layers", "3,1"])
    assert (args.lr, args.progress, args.stage_layers) == (0.5, False, "3,1")


def test_config_file_takes_flat_keys_or_section_tables(tmp_path):
    flat = tmp_path / "flat.toml"
    flat.write_text('lr = 0.01\nbatch-size = 8\n')
    tables = tmp_path / "tables.toml"
    tables.write_text('[optim]\nlr = 0.01\n[dataset]\nbatch-size = 8\n')
    assert load_config_file(str(flat)) == load_config_file(str(tables)) == \
        {"lr": 0.01, "batch_size": 8}
    bad = tmp_path / "bad.toml"
    bad.write_text('[optim]\nbatch_size = 8\n')
    with pytest.raises(ValueError, match=r"\[optim\] has no key 'batch_size'"):
        load_config_file(str(bad))


def test_sections_check_alone():
    assert run_sections.Pipeline(stage_layers="3,1").stage_counts() == (3, 1)
    with pytest.raises(ValueError, match="--device-memory"):
        run_sections.Planner(device_memory="lots")
