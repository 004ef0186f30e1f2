"""Run configuration: one frozen dataclass that the CLI, config files and the loop share.

Every field carries its help text in ``metadata`` and the CLI generates ``triax train``'s
(and ``triax inspect``'s) flags from the fields (``triax.cli.run_flags``). ``--config FILE``
(TOML or YAML, loaded safely) supplies the same keys as the flags (with ``-`` or ``_``), and
explicit flags override it.

    >>> run = RunConfig(model="tiny", mesh="data=2,tensor=2,pipe=2", steps=50)
    >>> run.replace(steps=100).steps
    100
    >>> RunConfig(precision="fp4")
    Traceback (most recent call last):
    ...
    ValueError: --precision 'fp4': choose one of fp32, bf16, fp16, fp8
    >>> RunConfig(lr=-1)
    Traceback (most recent call last):
    ...
    ValueError: --lr -1: must be > 0; give a positive peak learning rate, e.g. --lr 3e-3
"""
from __future__ import annotations

import dataclasses
import os
import tomllib
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import yaml

# JAX-free on purpose: the CLI builds its parser from these fields before it may load JAX
# (the simulated device count must be set first), so the model, optimizer and execution
# configs, whose packages import JAX, are imported where they are built.
from triax import choices
from triax.config_fields import shared, spec
from triax.configs import GE0, GE1, GT0, check_fields
from triax.choices import NONFINITE_MODES, PRECISIONS  # re-exported: importers use these
from triax.training.config_warning import RunConfigWarning  # re-exported: importers use it
from triax.pipeline.schedules import ScheduleKind
from triax.pipeline.stage_counts import check_counts, parse_counts
from triax.units import parse_bytes

if TYPE_CHECKING:
    from triax.models.config import ModelConfig
    from triax.models.layers import ExecConfig
    from triax.training.optim import OptimConfig

# Schedules a training step can run (forward-only is for evaluation and inference).
TRAIN_SCHEDULES = tuple(k.value for k in ScheduleKind if k is not ScheduleKind.FORWARD_ONLY)


_f = spec   # a field with its CLI help (and optional ``choices``) in metadata


def tp_overlap_reason(tp_overlap: bool, precision: str) -> Optional[str]:
    """Why ``--tp-overlap`` does not run in ``precision`` (None: it does): the rings carry
    the compute dtype's weights, not float8 (``models.projection``)."""
    if tp_overlap and precision == choices.FP8:
        return ("--tp-overlap runs its collective matmuls in the compute dtype, not float8: "
                "drop --tp-overlap or use --precision bf16")
    return None


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run (saved as JSON in every checkpoint)."""

    model: str = shared("model", "tiny")
    num_layers: Optional[int] = shared("num_layers", None)
    max_seq_len: Optional[int] = _f(None, "override the model's context (its max_seq_len), "
                                          "e.g. to lengthen a preset's: RoPE needs no table")
    init_from: Optional[str] = _f(None, "Hugging Face model directory to fine-tune: the model "
                                        "from its config.json (no --model), the weights from "
                                        "its safetensors")
    mesh: str = shared("mesh", "")
    strategy: str = shared("strategy", "fsdp_tp")
    context_attention: str = shared("context_attention", "all-gather")
    tp_overlap: bool = _f(False, "collective matmul under sequence parallelism (tp_sp, "
                                 "fsdp_tp_sp): each all-gather → matmul and matmul → "
                                 "reduce-scatter over tensor becomes a ring of permutes "
                                 "overlapped with partial matmuls")
    steps: int = _f(200, "optimizer steps to reach (a resumed run continues up to this)")
    seed: int = shared("seed", 0)
    batch_size: int = _f(16, "global batch size (sequences per optimizer step)")
    seq_len: int = _f(128, "tokens per sequence")
    lr: float = _f(3e-3, "peak learning rate (warmup + cosine)")
    lr_warmup_steps: int = _f(0, "warmup steps (0: 10% of --steps)")
    lr_decay_steps: int = _f(0, "cosine decay steps (0: --steps)")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    clip_norm: float = _f(1.0, "gradient clipping (global norm)")
    precision: str = _f("fp32", "compute precision; bf16/fp16 keep fp32 master weights "
                                "(fp16 without loss scaling); fp8: bf16 with the block's "
                                "matmuls in float8 (e4m3 forward, e5m2 gradients, per-tensor "
                                "current scales)", choices=tuple(PRECISIONS))
    remat: str = _f("none", "activation checkpointing policy", choices=choices.REMAT_POLICIES)
    offload: str = _f("", "state kept in the host's pinned memory between steps: optimizer, "
                          "params or optimizer,params (the optimizer update streamed to the "
                          "device or run on the host, whichever costs.offload prices lower)",
                      default_help="none")
    attention: str = _f("auto", "attention implementation (auto: the fastest for the "
                                "backend)", choices=choices.ATTENTION_CHOICES)
    loss_chunks: int = _f(1, "compute the loss over this many slices of each sequence, one "
                             "at a time (long sequences: only a slice's fp32 logits are alive; "
                             "the backward recomputes them)")
    lora_rank: int = _f(0, "train LoRA adapters of this rank over a frozen base (0: full "
                           "fine-tuning)")
    lora_alpha: float = _f(16.0, "LoRA scaling numerator: adapters add x·A·B·alpha/rank")
    lora_dropout: float = _f(0.0, "dropout probability on the adapters' input in training "
                                  "steps (PEFT's lora_dropout; none at eval or decode)")
    lora_targets: str = _f(",".join(choices.PEFT_TARGETS), "comma-separated PEFT module names "
                                                            "that get adapters")
    base_dtype: str = _f("float32", "how the frozen LoRA base is stored (bfloat16: half the "
                                    "bytes; int8: its projections int8 with per-channel "
                                    "scales; adapters stay fp32)", choices=choices.BASE_DTYPES)
    adapter: Optional[str] = shared("adapter", None)
    grad_accum: int = _f(1, "gradient-accumulation micro-steps per optimizer step")
    schedule: str = _f("1f1b", "pipeline schedule, used when the mesh has pipe > 1",
                       choices=TRAIN_SCHEDULES)
    microbatches: int = _f(0, "pipeline micro-batches per step (0: 2 × pipe)")
    virtual: int = _f(1, "pipeline chunks per stage (interleaved; zb-v always runs 2)")
    pipeline_fsdp: str = _f("auto", "FSDP weights in pipeline stages: stage (gathered once "
                                    "per step, gradients accumulated whole) | layer (each "
                                    "layer gathered per op, gradients reduce-scattered per "
                                    "layer) | auto (stage where the planner's memory model "
                                    "says it fits a device, else layer)",
                            choices=choices.PIPELINE_FSDP_CHOICES)
    stage_layers: Optional[str] = _f(None, "layers each pipeline stage runs, e.g. 5,3 (uneven "
                                           "stages: one count per pipe stage, adding up to the "
                                           "layers; gpipe or 1f1b; see docs/pipeline.md)",
                                     default_help="as even as the layer count allows")
    data: str = _f("pydoc", "pydoc | markov | path to a .txt, .npy (token ids), .jsonl or "
                            ".parquet file (documents with a text field, or prompt/completion "
                            "pairs whose prompts get no loss; packed)")
    tokenizer: Optional[str] = shared("tokenizer", None)
    val_fraction: float = _f(0.05, "fraction of the data held out for validation")
    eval_every: int = _f(0, "validation loss every N steps (0: at the end only)")
    eval_batches: int = _f(4, "batches per validation")
    checkpoint_dir: Optional[str] = _f(None, "directory for Orbax checkpoints")
    checkpoint_every: int = _f(0, "save every N steps (0: at the end and on SIGTERM/SIGINT)")
    keep_checkpoints: int = _f(3, "keep the last N checkpoints")
    resume: bool = _f(False, "continue from the latest checkpoint in --checkpoint-dir")
    no_save: bool = _f(False, "do not write checkpoints")
    resume_from: Optional[int] = _f(None, "resume from this checkpoint step (newer steps are "
                                          "set aside, never deleted); implies --resume")
    on_nonfinite: str = _f("stop", "a NaN/inf loss: stop | skip (drop that update) | rollback "
                                   "(restore the last checkpoint, skip the data since)",
                           choices=NONFINITE_MODES)
    skip_memory_check: bool = shared("skip_memory_check", False)
    # How the layout is chosen is part of the run (saved with it, so `--resume` keeps the
    # chosen layout and a --config file can ask for a search), as is the memory it must fit.
    plan: str = shared("plan", "flags")
    objective: str = shared("objective", "throughput")
    device_memory: Optional[str] = shared("device_memory", None)
    plan_gpu: Optional[str] = _f(None, "with --plan auto: the devices present are mixed "
                                       "generations, KIND:COUNT groups in pipeline order, "
                                       "e.g. h100-80gb:4,a100-80gb:4 (one pipeline stage "
                                       "per group, layers sized by speed within every "
                                       "group's memory; docs/planner.md)")
    allow_fp8: bool = _f(False, "with --plan auto: the search may also choose --precision fp8 "
                                "(the block's matmuls in float8) where the planner prices it "
                                "faster, proved by compile like every plan; without it the "
                                "precision stays --precision's")
    log_json: Optional[str] = _f(None, "write one JSON object per optimizer step to FILE")
    tensorboard: Optional[str] = _f(None, "write TensorBoard logs to DIR (needs tensorboardX)")
    progress: bool = _f(True, "progress bar")

    def __post_init__(self):
        # Every choice and every number that cannot train is refused here, so flags and
        # --config files alike fail before anything is built, naming the flag and the fix
        # (``--lr -1`` would otherwise ascend the gradient).
        check_fields(self, _BOUNDS)
        choices.parse_offload(self.offload)   # a part that is not state fails here
        if self.device_memory is not None:
            self.device_memory_bytes()   # a bad size fails here, naming the flag
        why = tp_overlap_reason(self.tp_overlap, self.precision)
        if why:
            raise ValueError(why)
        if self.stage_layers is not None:   # the stage count (the mesh's pipe) is checked
            counts = self.stage_counts()    # by check_pipeline, the model's layers there too
            try:
                check_counts(counts, self.num_layers or sum(counts), len(counts), self.virtual,
                             ScheduleKind.parse(self.schedule).split_backward)
            except ValueError as e:
                raise ValueError(f"--stage-layers: {e}") from None
            if self.plan == "auto" and not self.plan_gpu:   # even stages but for groups
                raise ValueError("--stage-layers fixes uneven stages, which --plan auto lays "
                                 "out only for mixed generations: give --plan-gpu "
                                 "KIND:N,KIND:N, or use --plan flags with --mesh (triax plan "
                                 "--gpu KIND:N,KIND:N proposes a split)")
        needs_lora = [flag for flag, on in (("adapter", self.adapter),
                                            ("base-dtype", self.base_dtype != "float32"),
                                            ("lora-dropout", self.lora_dropout != 0)) if on]
        if self.lora_rank == 0 and needs_lora:
            raise ValueError(f"--{needs_lora[0]} needs LoRA: give --lora-rank R (the "
                             f"adapter's rank)")
        if self.adapter and not self.init_from:
            raise ValueError(f"--adapter {self.adapter!r} continues a PEFT adapter over its "
                             f"base model: give --init-from BASE_DIR too")
        if self.steps and self.lr_warmup_steps > self.steps:
            warnings.warn(f"--lr-warmup-steps {self.lr_warmup_steps} is longer than the run "
                          f"(--steps {self.steps}): the learning rate never reaches --lr "
                          f"{self.lr:g}; lower --lr-warmup-steps (0: 10% of --steps)",
                          RunConfigWarning, stacklevel=3)

    def stage_counts(self) -> Optional[tuple[int, ...]]:
        """``--stage-layers`` as per-stage layer counts (None: not given)."""
        if self.stage_layers is None:
            return None
        try:
            return parse_counts(self.stage_layers)
        except ValueError as e:
            raise ValueError(f"--stage-layers: {e}") from None

    def check_pipeline(self, cfg: "ModelConfig", stages: int) -> Optional[tuple[int, ...]]:
        """``--stage-layers`` against the model's layers and the mesh's ``pipe`` (None when
        not given)."""
        counts = self.stage_counts()
        if counts is None:
            return None
        if stages < 2:
            raise ValueError(f"--stage-layers {self.stage_layers} needs a pipelined mesh "
                             f"(pipe >= 2), got pipe={stages}; add pipe={len(counts)} to --mesh")
        try:
            return check_counts(counts, cfg.num_layers, stages, self.virtual,
                                ScheduleKind.parse(self.schedule).split_backward)
        except ValueError as e:
            raise ValueError(f"--stage-layers: {e}") from None

    def offload_targets(self) -> tuple[str, ...]:
        """``--offload`` as the state parts it names (() for none)."""
        return choices.parse_offload(self.offload)

    def device_memory_bytes(self) -> Optional[int]:
        """``--device-memory`` in bytes (None: not given)."""
        if self.device_memory is None:
            return None
        try:
            n = parse_bytes(self.device_memory)
        except ValueError as e:
            raise ValueError(f"--device-memory: {e}") from None
        if n <= 0:
            raise ValueError(f"--device-memory {self.device_memory}: must be > 0, e.g. "
                             f"--device-memory 40GiB")
        return n

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)

    def model_config(self) -> "ModelConfig":
        if self.init_from:
            from triax.training.init_from import init_from_config  # loads JAX
            cfg = init_from_config(self)
        else:
            from triax.models import config as model_config  # loads JAX: see the imports
            cfg = model_config.get(self.model, self.num_layers)
            if self.max_seq_len is not None:
                cfg = cfg.replace(max_seq_len=self.max_seq_len)
        return cfg if self.lora_rank == 0 else cfg.replace(lora=self.lora_config())

    def lora_config(self):
        """The adapters ``--lora-*`` and ``--base-dtype`` ask for (``--lora-rank`` ≥ 1)."""
        from triax.models.config import LoraConfig  # loads JAX: see the imports
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, targets=targets,
                          base_dtype=self.base_dtype, dropout=self.lora_dropout)

    def optim_config(self) -> "OptimConfig":
        """The optimizer, resolved against ``steps`` (warmup and decay filled in)."""
        from triax.training.optim import OptimConfig  # loads JAX: see the imports
        return OptimConfig(lr=self.lr, warmup_steps=self.lr_warmup_steps,
                           decay_steps=self.lr_decay_steps, weight_decay=self.weight_decay,
                           clip_norm=self.clip_norm).resolved(self.steps)

    def exec_config(self) -> "ExecConfig":
        # The names were checked in __post_init__; these load JAX: see the imports.
        from triax.models.layers import ExecConfig
        from triax.models.loss import check_loss_chunks
        check_loss_chunks(self.loss_chunks, self.seq_len)
        return ExecConfig(compute_dtype=PRECISIONS[self.precision], remat=self.remat,
                          attention=self.attention, loss_chunks=self.loss_chunks,
                          fp8=self.precision == choices.FP8)

    # The checks that need what the fields alone do not say (the model, the mesh): called by
    # ``training.setup.build_run`` before anything compiles, beside ``__post_init__``'s.
    def check_model(self, cfg: "ModelConfig") -> None:
        """A sequence past the model's context is refused (``--init-from`` lengthens a
        pretrained model's with a warning instead: ``training.init_from``)."""
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"--seq-len {self.seq_len} is longer than {cfg.name}'s context "
                             f"(max_seq_len {cfg.max_seq_len}); "
                             f"{context_fix(self.seq_len, cfg.max_seq_len)}")

    def check_batch(self, data: int, microbatches: int = 1) -> None:
        """The global batch must split into ``data`` shards × accumulation × pipeline
        ``microbatches``."""
        micro = self.grad_accum * microbatches
        unit = data * micro
        if self.batch_size % unit or self.batch_size <= 0:
            valid = max(unit, round(self.batch_size / unit) * unit)
            raise ValueError(f"--batch-size {self.batch_size} is not divisible by data ({data}) "
                             f"× micro-batches ({micro}) = {unit}; use e.g. --batch-size {valid}")

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def context_fix(seq_len: int, max_seq_len: int) -> str:
    """What to do about a sequence longer than the context (the planner says it too)."""
    return (f"use --seq-len {max_seq_len} or less, or --max-seq-len {seq_len} to lengthen "
            f"the context (RoPE needs no table)")


# What each numeric setting must be, and the fix an error names.
_BOUNDS = {
    "steps": (*GE1, "give the number of optimizer steps to reach, e.g. --steps 200"),
    "lr": (*GT0, "give a positive peak learning rate, e.g. --lr 3e-3"),
    "weight_decay": (*GE0, "use 0 for none, or e.g. --weight-decay 0.1"),
    "clip_norm": (*GT0, "give a positive global norm, e.g. --clip-norm 1.0"),
    "lr_warmup_steps": (*GE0, "use 0 for 10% of --steps"),
    "lr_decay_steps": (*GE0, "use 0 for --steps"),
    "seq_len": (*GE1, "give the tokens per sequence, e.g. --seq-len 128"),
    "max_seq_len": (*GE1, "give the context in tokens, e.g. --max-seq-len 1024"),
    "grad_accum": (*GE1, "use 1 for no accumulation"),
    "lora_rank": (*GE0, "use 0 for full fine-tuning, or e.g. --lora-rank 8"),
    "lora_alpha": (*GT0, "give the scaling numerator, e.g. --lora-alpha 16"),
    "lora_dropout": ("in [0, 1)", lambda v: 0 <= v < 1, "give the probability of zeroing "
                     "an adapter input, e.g. --lora-dropout 0.05 (0: none)"),
}

FIELDS = {f.name for f in dataclasses.fields(RunConfig)}


def load_config_file(path: str) -> dict:
    """Read a TOML or YAML run config into a dict of RunConfig fields (validated names)."""
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
    data = {k.replace("-", "_"): v for k, v in data.items()}
    unknown = sorted(set(data) - FIELDS)
    if unknown:
        raise ValueError(f"config file {path!r}: unknown keys {unknown}; valid keys are "
                         f"{', '.join(sorted(FIELDS))}")
    if isinstance(data.get("mesh"), dict):
        data["mesh"] = ",".join(f"{k}={v}" for k, v in data["mesh"].items())
    return data
