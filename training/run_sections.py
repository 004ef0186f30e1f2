"""``RunConfig``'s sections: each a frozen dataclass of the fields that say one thing about a
training run, with the checks that need only its own fields (``RunConfig`` checks across
sections). A field's name is its flag's (``--lr`` is ``optim.lr``), unique across sections
(``triax.configs.leaves``), and its help lives in its metadata. JAX-free, like the CLI that
builds its parser from these fields.

    >>> Optim(lr=0.01).lr, Pipeline(stage_layers="3,1").stage_counts()
    (0.01, (3, 1))
    >>> Lora(lora_rank=0, lora_dropout=0.1)
    Traceback (most recent call last):
    ...
    ValueError: --lora-dropout needs LoRA: give --lora-rank R (the adapter's rank)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from triax import choices
from triax.choices import NONFINITE_MODES, PRECISIONS
from triax.config_fields import shared, spec
from triax.configs import GE0, GE1, GT0, check_fields
from triax.pipeline.schedules import ScheduleKind
from triax.pipeline.stage_counts import check_counts, parse_counts
from triax.units import device_memory_bytes

# Schedules a training step can run (forward-only is for evaluation and inference).
TRAIN_SCHEDULES = tuple(k.value for k in ScheduleKind if k is not ScheduleKind.FORWARD_ONLY)

_f = spec   # a field with its CLI help (and optional ``choices``) in metadata

# What each numeric setting must be, and the fix an error names (each section checks its own).
BOUNDS = {
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


@dataclass(frozen=True)
class Source:
    """The model: a preset (its layers and context overridable) or a Hugging Face directory."""

    model: str = shared("model", "tiny")
    num_layers: Optional[int] = shared("num_layers", None)
    max_seq_len: Optional[int] = _f(None, "override the model's context (its max_seq_len), "
                                          "e.g. to lengthen a preset's: RoPE needs no table")
    init_from: Optional[str] = _f(None, "Hugging Face model directory to fine-tune: the model "
                                        "from its config.json (no --model), the weights from "
                                        "its safetensors")

    def __post_init__(self):
        check_fields(self, BOUNDS)


@dataclass(frozen=True)
class Layout:
    """The mesh, the sharding strategy over it, and the state kept on the host."""

    mesh: str = shared("mesh", "")
    strategy: str = shared("strategy", "fsdp_tp")
    context_attention: str = shared("context_attention", "all-gather")
    tp_overlap: bool = _f(False, "collective matmul under sequence parallelism (tp_sp, "
                                 "fsdp_tp_sp): each all-gather → matmul and matmul → "
                                 "reduce-scatter over tensor becomes a ring of permutes "
                                 "overlapped with partial matmuls")
    offload: str = _f("", "state kept in the host's pinned memory between steps: optimizer, "
                          "params or optimizer,params (the optimizer update streamed to the "
                          "device or run on the host, whichever costs.offload prices lower)",
                      default_help="none")

    def __post_init__(self):
        check_fields(self, BOUNDS)
        choices.parse_offload(self.offload)   # a part that is not state fails here

    def offload_targets(self) -> tuple[str, ...]:
        """``--offload`` as the state parts it names (() for none)."""
        return choices.parse_offload(self.offload)


@dataclass(frozen=True)
class Compute:
    """How the step computes: precision, rematerialisation, attention, the loss's slices."""

    precision: str = _f("fp32", "compute precision; bf16/fp16 keep fp32 master weights "
                                "(fp16 without loss scaling); fp8: bf16 with the block's "
                                "matmuls in float8 (e4m3 forward, e5m2 gradients, per-tensor "
                                "current scales)", choices=tuple(PRECISIONS))
    remat: str = _f("none", "activation checkpointing policy", choices=choices.REMAT_POLICIES)
    attention: str = _f("auto", "attention implementation (auto: the fastest for the "
                                "backend)", choices=choices.ATTENTION_CHOICES)
    loss_chunks: int = _f(1, "compute the loss over this many slices of each sequence, one "
                             "at a time (long sequences: only a slice's fp32 logits are alive; "
                             "the backward recomputes them)")

    def __post_init__(self):
        check_fields(self, BOUNDS)


@dataclass(frozen=True)
class Optim:
    """The optimizer (AdamW, warmup + cosine) and the micro-steps an update accumulates."""

    lr: float = _f(3e-3, "peak learning rate (warmup + cosine)")
    lr_warmup_steps: int = _f(0, "warmup steps (0: 10% of --steps)")
    lr_decay_steps: int = _f(0, "cosine decay steps (0: --steps)")
    weight_decay: float = _f(0.1, "AdamW weight decay")
    clip_norm: float = _f(1.0, "gradient clipping (global norm)")
    grad_accum: int = _f(1, "gradient-accumulation micro-steps per optimizer step")

    def __post_init__(self):
        check_fields(self, BOUNDS)


@dataclass(frozen=True)
class Lora:
    """LoRA adapters over a frozen base (rank 0: full fine-tuning), or a PEFT one continued."""

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

    def __post_init__(self):
        check_fields(self, BOUNDS)
        needs_lora = [flag for flag, on in (("adapter", self.adapter),
                                            ("base-dtype", self.base_dtype != "float32"),
                                            ("lora-dropout", self.lora_dropout != 0)) if on]
        if self.lora_rank == 0 and needs_lora:
            raise ValueError(f"--{needs_lora[0]} needs LoRA: give --lora-rank R (the "
                             f"adapter's rank)")

    def lora_config(self):
        """The adapters ``--lora-*`` and ``--base-dtype`` ask for (``--lora-rank`` ≥ 1)."""
        from triax.models.config import LoraConfig  # loads JAX: see training.config
        targets = tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())
        return LoraConfig(rank=self.lora_rank, alpha=self.lora_alpha, targets=targets,
                          base_dtype=self.base_dtype, dropout=self.lora_dropout)


@dataclass(frozen=True)
class Pipeline:
    """The pipeline schedule, used when the mesh has ``pipe > 1``."""

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

    def __post_init__(self):
        check_fields(self, BOUNDS)

    def stage_counts(self) -> Optional[tuple[int, ...]]:
        """``--stage-layers`` as per-stage layer counts (None: not given)."""
        if self.stage_layers is None:
            return None
        try:
            return parse_counts(self.stage_layers)
        except ValueError as e:
            raise ValueError(f"--stage-layers: {e}") from None

    def check_counts(self, layers: int, stages: int) -> tuple[int, ...]:
        """``--stage-layers`` against ``layers`` and ``stages`` (given)."""
        try:
            return check_counts(self.stage_counts(), layers, stages, self.virtual,
                                ScheduleKind.parse(self.schedule).split_backward)
        except ValueError as e:
            raise ValueError(f"--stage-layers: {e}") from None

    def check_pipeline(self, num_layers: int, stages: int) -> Optional[tuple[int, ...]]:
        """``--stage-layers`` against the model's layers and the mesh's ``pipe`` (None when
        not given)."""
        counts = self.stage_counts()
        if counts is None:
            return None
        if stages < 2:
            raise ValueError(f"--stage-layers {self.stage_layers} needs a pipelined mesh "
                             f"(pipe >= 2), got pipe={stages}; add pipe={len(counts)} to --mesh")
        return self.check_counts(num_layers, stages)


@dataclass(frozen=True)
class Dataset:
    """What the steps read: the data, its tokenizer, the batch shape, the validation split."""

    data: str = _f("pydoc", "pydoc | markov | path to a .txt, .npy (token ids), .jsonl or "
                            ".parquet file (documents with a text field, or prompt/completion "
                            "pairs whose prompts get no loss; packed)")
    tokenizer: Optional[str] = shared("tokenizer", None)
    batch_size: int = _f(16, "global batch size (sequences per optimizer step)")
    seq_len: int = _f(128, "tokens per sequence")
    val_fraction: float = _f(0.05, "fraction of the data held out for validation")
    eval_every: int = _f(0, "validation loss every N steps (0: at the end only)")
    eval_batches: int = _f(4, "batches per validation")

    def __post_init__(self):
        check_fields(self, BOUNDS)


@dataclass(frozen=True)
class Checkpoint:
    """Where checkpoints go, how often and how many, and where a run resumes."""

    checkpoint_dir: Optional[str] = _f(None, "directory for Orbax checkpoints")
    checkpoint_every: int = _f(0, "save every N steps (0: at the end and on SIGTERM/SIGINT)")
    keep_checkpoints: int = _f(3, "keep the last N checkpoints")
    resume: bool = _f(False, "continue from the latest checkpoint in --checkpoint-dir")
    no_save: bool = _f(False, "do not write checkpoints")
    resume_from: Optional[int] = _f(None, "resume from this checkpoint step (newer steps are "
                                          "set aside, never deleted); implies --resume")

    def __post_init__(self):
        check_fields(self, BOUNDS)


@dataclass(frozen=True)
class Planner:
    """How the layout is chosen and the memory it must fit. Part of the run (saved with it,
    so ``--resume`` keeps the chosen layout and a ``--config`` file can ask for a search);
    the search's own settings belong here."""

    plan: str = shared("plan", "flags")
    objective: str = shared("objective", "throughput")
    device_memory: Optional[str] = shared("device_memory", None)
    skip_memory_check: bool = shared("skip_memory_check", False)
    plan_gpu: Optional[str] = _f(None, "with --plan auto: the devices present are mixed "
                                         "generations, KIND:COUNT groups in pipeline order, "
                                         "e.g. h100-80gb:4,a100-80gb:4 (one pipeline stage "
                                         "per group, layers sized by speed within every "
                                         "group's memory; docs/planner.md)")
    allow_fp8: bool = _f(False, "with --plan auto: the search may also choose --precision "
                                  "fp8 (the block's matmuls in float8) where the planner "
                                  "prices it faster, proved by compile like every plan; "
                                  "without it the precision stays --precision's")

    def __post_init__(self):
        check_fields(self, BOUNDS)
        if self.device_memory is not None:
            self.device_memory_bytes()   # a bad size fails here, naming the flag

    def device_memory_bytes(self) -> Optional[int]:
        """``--device-memory`` in bytes (None: not given)."""
        return device_memory_bytes(self.device_memory)


@dataclass(frozen=True)
class Loop:
    """The loop: how many steps, its seed, what a non-finite loss does, how it reports."""

    steps: int = _f(200, "optimizer steps to reach (a resumed run continues up to this)")
    seed: int = shared("seed", 0)
    on_nonfinite: str = _f("stop", "a NaN/inf loss: stop | skip (drop that update) | rollback "
                                   "(restore the last checkpoint, skip the data since)",
                           choices=NONFINITE_MODES)
    log_json: Optional[str] = _f(None, "write one JSON object per optimizer step to FILE")
    tensorboard: Optional[str] = _f(None, "write TensorBoard logs to DIR (needs tensorboardX)")
    progress: bool = _f(True, "progress bar")

    def __post_init__(self):
        check_fields(self, BOUNDS)
