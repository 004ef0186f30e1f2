"""Run configuration: one frozen dataclass of frozen sections that the CLI, config files
and the loop share.

The sections (``triax.training.run_sections``) are ``source`` (the model), ``layout`` (mesh,
strategy, offload), ``compute`` (precision, remat, attention, loss slices), ``optim``,
``lora``, ``pipeline``, ``dataset`` (data, tokenizer, batch shape, validation),
``checkpoint``, ``planner`` (``--plan`` and the memory it must fit) and ``loop`` (steps,
seed, non-finite losses, logging). Every field carries its help text in ``metadata``, and
its name is its flag's wherever its section is: the CLI generates ``triax train``'s (and
``triax inspect``'s) flags from the fields (``triax.cli.run_flags``). ``--config FILE``
(TOML or YAML, loaded safely) supplies the same flat keys as the flags (with ``-`` or
``_``), or ``[section]`` tables of them, and explicit flags override it.

    >>> run = RunConfig.of(model="tiny", mesh="data=2,tensor=2,pipe=2", steps=50)
    >>> run.replace(steps=100).loop.steps, run.layout.mesh
    (100, 'data=2,tensor=2,pipe=2')
    >>> RunConfig.of(precision="fp4")
    Traceback (most recent call last):
    ...
    ValueError: --precision 'fp4': choose one of fp32, bf16, fp16, fp8
    >>> RunConfig.of(lr=-1)
    Traceback (most recent call last):
    ...
    ValueError: --lr -1: must be > 0; give a positive peak learning rate, e.g. --lr 3e-3
    >>> RunConfig.from_json({"lr": 0.1, "steps": 3}) == RunConfig.of(lr=0.1, steps=3)  # old flat
    True
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import yaml

# JAX-free on purpose: the CLI builds its parser from these fields before it may load JAX
# (the simulated device count must be set first), so the model, optimizer and execution
# configs, whose packages import JAX, are imported where they are built.
from triax import choices, configs
from triax.choices import NONFINITE_MODES, PRECISIONS  # re-exported: importers use these
from triax.training.config_warning import RunConfigWarning  # re-exported: importers use it
from triax.training.run_sections import (TRAIN_SCHEDULES, Checkpoint, Compute,  # noqa: F401
                                         Dataset, Layout, Lora, Loop, Optim, Pipeline,
                                         Planner, Source)

if TYPE_CHECKING:
    from triax.models.config import ModelConfig
    from triax.models.layers import ExecConfig
    from triax.training.optim import OptimConfig


def tp_overlap_reason(tp_overlap: bool, precision: str) -> Optional[str]:
    """Why ``--tp-overlap`` does not run in ``precision`` (None: it does): the rings carry
    the compute dtype's weights, not float8 (``models.projection``)."""
    if tp_overlap and precision == choices.FP8:
        return ("--tp-overlap runs its collective matmuls in the compute dtype, not float8: "
                "drop --tp-overlap or use --precision bf16")
    return None


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run, in sections (saved as JSON in every
    checkpoint); build it from flat field names with ``of``."""

    source: Source = field(default_factory=Source)
    layout: Layout = field(default_factory=Layout)
    compute: Compute = field(default_factory=Compute)
    optim: Optim = field(default_factory=Optim)
    lora: Lora = field(default_factory=Lora)
    pipeline: Pipeline = field(default_factory=Pipeline)
    dataset: Dataset = field(default_factory=Dataset)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    planner: Planner = field(default_factory=Planner)
    loop: Loop = field(default_factory=Loop)

    def __post_init__(self):
        # Every choice and every number that cannot train is refused as the sections are
        # built, and what needs two sections here, so flags and --config files alike fail
        # before anything is built, naming the flag and the fix (``--lr -1`` would
        # otherwise ascend the gradient).
        lay, comp, pipe, lora = self.layout, self.compute, self.pipeline, self.lora
        why = tp_overlap_reason(lay.tp_overlap, comp.precision)
        if why:
            raise ValueError(why)
        if pipe.stage_layers is not None:   # the stage count (the mesh's pipe) is checked
            counts = pipe.stage_counts()    # by check_pipeline, the model's layers there too
            pipe.check_counts(self.source.num_layers or sum(counts), len(counts))
            if self.planner.plan == "auto" and not self.planner.plan_gpu:   # mixed groups only
                raise ValueError("--stage-layers fixes uneven stages, which --plan auto lays "
                                 "out only for mixed generations: give --plan-gpu "
                                 "KIND:N,KIND:N, or use --plan flags with --mesh (triax plan "
                                 "--gpu KIND:N,KIND:N proposes a split)")
        if lora.adapter and not self.source.init_from:
            raise ValueError(f"--adapter {lora.adapter!r} continues a PEFT adapter over its "
                             f"base model: give --init-from BASE_DIR too")
        opt, steps = self.optim, self.loop.steps
        if steps and opt.lr_warmup_steps > steps:
            warnings.warn(f"--lr-warmup-steps {opt.lr_warmup_steps} is longer than the run "
                          f"(--steps {steps}): the learning rate never reaches --lr "
                          f"{opt.lr:g}; lower --lr-warmup-steps (0: 10% of --steps)",
                          RunConfigWarning, stacklevel=5)

    @classmethod
    def of(cls, **flat) -> "RunConfig":
        """From flat field names (as the flags are named), e.g. ``of(model="tiny", lr=1e-3)``."""
        return configs.from_flat(cls, flat)

    @classmethod
    def from_json(cls, saved: dict) -> "RunConfig":
        """The run a checkpoint saved: in sections, or flat as older checkpoints hold it."""
        return cls.of(**saved_values(saved))

    def replace(self, **flat) -> "RunConfig":
        """A copy with flat fields changed, e.g. ``replace(steps=100)``; checked again."""
        return configs.replace_flat(self, **flat)

    def flat(self) -> dict:
        """Every field by its flat name (the flags' names)."""
        return configs.flat(self)

    def check_pipeline(self, cfg: "ModelConfig", stages: int) -> Optional[tuple[int, ...]]:
        """``--stage-layers`` against the model's layers and the mesh's ``pipe`` (None when
        not given)."""
        return self.pipeline.check_pipeline(cfg.num_layers, stages)

    def model_config(self) -> "ModelConfig":
        src = self.source
        if src.init_from:
            from triax.training.init_from import init_from_config  # loads JAX
            cfg = init_from_config(self)
        else:
            from triax.models import config as model_config  # loads JAX: see the imports
            cfg = model_config.get(src.model, src.num_layers)
            if src.max_seq_len is not None:
                cfg = cfg.replace(max_seq_len=src.max_seq_len)
        return cfg if self.lora.lora_rank == 0 else cfg.replace(lora=self.lora.lora_config())

    def optim_config(self) -> "OptimConfig":
        """The optimizer, resolved against ``steps`` (warmup and decay filled in)."""
        from triax.training.optim import OptimConfig  # loads JAX: see the imports
        o = self.optim
        return OptimConfig(lr=o.lr, warmup_steps=o.lr_warmup_steps,
                           decay_steps=o.lr_decay_steps, weight_decay=o.weight_decay,
                           clip_norm=o.clip_norm).resolved(self.loop.steps)

    def exec_config(self) -> "ExecConfig":
        # The names were checked as the sections were built; these load JAX: see the imports.
        from triax.models.layers import ExecConfig
        from triax.models.loss import check_loss_chunks
        c = self.compute
        check_loss_chunks(c.loss_chunks, self.dataset.seq_len)
        return ExecConfig(compute_dtype=PRECISIONS[c.precision], remat=c.remat,
                          attention=c.attention, loss_chunks=c.loss_chunks,
                          fp8=c.precision == choices.FP8)

    # The checks that need what the fields alone do not say (the model, the mesh): called by
    # ``training.setup.build_run`` before anything compiles, beside ``__post_init__``'s.
    def check_model(self, cfg: "ModelConfig") -> None:
        """A sequence past the model's context is refused (``--init-from`` lengthens a
        pretrained model's with a warning instead: ``training.init_from``)."""
        seq_len = self.dataset.seq_len
        if seq_len > cfg.max_seq_len:
            raise ValueError(f"--seq-len {seq_len} is longer than {cfg.name}'s context "
                             f"(max_seq_len {cfg.max_seq_len}); "
                             f"{context_fix(seq_len, cfg.max_seq_len)}")

    def check_batch(self, data: int, microbatches: int = 1) -> None:
        """The global batch must split into ``data`` shards × accumulation × pipeline
        ``microbatches``."""
        micro = self.optim.grad_accum * microbatches
        unit, batch = data * micro, self.dataset.batch_size
        if batch % unit or batch <= 0:
            valid = max(unit, round(batch / unit) * unit)
            raise ValueError(f"--batch-size {batch} is not divisible by data ({data}) "
                             f"× micro-batches ({micro}) = {unit}; use e.g. --batch-size {valid}")

    def to_json(self) -> dict:
        """The run as nested plain values, section by section (JSON-ready)."""
        return dataclasses.asdict(self)


def context_fix(seq_len: int, max_seq_len: int) -> str:
    """What to do about a sequence longer than the context (the planner says it too)."""
    return (f"use --seq-len {max_seq_len} or less, or --max-seq-len {seq_len} to lengthen "
            f"the context (RoPE needs no table)")


FIELDS = set(configs.leaves(RunConfig))
SECTIONS = configs.sections(RunConfig)


def saved_values(saved: dict) -> dict:
    """A saved run's flat values: its sections' fields (``to_json``), or the flat fields
    older checkpoints hold; fields this version no longer has are left out."""
    out = {}
    for key, value in saved.items():
        if key in SECTIONS and isinstance(value, dict):
            out.update(value)
        else:
            out[key] = value
    return {k: tuple(v) if isinstance(v, list) else v for k, v in out.items() if k in FIELDS}


def _flat_tables(path: str, data: dict) -> dict:
    """``data`` with each ``[section]`` table (``[optim]`` holding ``lr``) flattened into it."""
    out = {}
    for key, value in data.items():
        if key not in SECTIONS or not isinstance(value, dict):
            out[key] = value
            continue
        for k, v in value.items():
            k = k.replace("-", "_")
            if k not in configs.leaves(SECTIONS[key]):
                raise ValueError(f"config file {path!r}: [{key}] has no key {k!r}; its keys "
                                 f"are {', '.join(configs.leaves(SECTIONS[key]))}")
            out[k] = v
    return out


def load_config_file(path: str) -> dict:
    """Read a TOML or YAML run config into a dict of RunConfig fields (validated names):
    flat keys, as the flags are named, or ``[section]`` tables of them."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            data = tomllib.loads(raw.decode("utf-8"))
        elif path.endswith((".yaml", ".yml")):
            data = yaml.safe_load(raw) or {}
        else:
            raise ValueError(f"config file {path!r}: use a .toml, .yaml or .yml file")
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"config file {path!r} is not valid: {e}") from None
    except Exception as e:  # yaml.YAMLError does not subclass ValueError
        raise ValueError(f"config file {path!r} is not valid: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"config file {path!r} must hold a table/mapping of settings")
    data = _flat_tables(path, {k.replace("-", "_"): v for k, v in data.items()})
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ValueError(f"config file {path!r}: unknown keys {unknown}; valid keys are "
                         f"{', '.join(sorted(FIELDS))}")
    if isinstance(data.get("mesh"), dict):
        data["mesh"] = ",".join(f"{k}={v}" for k, v in data["mesh"].items())
    return data
