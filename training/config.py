"""Run configuration: one frozen dataclass that the CLI, config files and the loop share.

``--config FILE`` (TOML or YAML, loaded safely) supplies the same keys as the flags (with
``-`` or ``_``), and explicit flags override it.

    >>> run = RunConfig(model="tiny", mesh="data=2,tensor=2,pipe=2", steps=50)
    >>> run.replace(steps=100).steps
    100
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Optional

from triax.models import config as model_config
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.training.optim import OptimConfig

PRECISIONS = {"fp32": "float32", "bf16": "bfloat16"}


@dataclass(frozen=True)
class RunConfig:
    """Everything that defines a training run (saved as JSON in every checkpoint)."""

    model: str = "tiny"
    num_layers: Optional[int] = None
    mesh: str = ""                      # "" = pick automatically (see loop.default_mesh)
    strategy: str = "fsdp_tp"
    steps: int = 200
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    lr_warmup_steps: int = 0            # 0: 10% of --steps
    lr_decay_steps: int = 0             # 0: --steps
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    precision: str = "fp32"             # fp32 | bf16 (bf16 compute, fp32 master weights)
    remat: str = "none"
    grad_accum: int = 1
    schedule: str = "1f1b"              # pipeline schedule (used when pipe > 1)
    microbatches: int = 0               # pipeline micro-batches (0: 2 × pipe)
    virtual: int = 1                    # pipeline chunks per stage (interleaved schedules)
    data: str = "pydoc"
    val_fraction: float = 0.05
    eval_every: int = 0                 # 0: only at the end
    eval_batches: int = 4
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0           # 0: only at the end (and on SIGTERM/SIGINT)
    keep_checkpoints: int = 3
    resume: bool = False
    no_save: bool = False
    log_json: Optional[str] = None
    tensorboard: Optional[str] = None
    progress: bool = True

    def replace(self, **kw) -> "RunConfig":
        return dataclasses.replace(self, **kw)

    def model_config(self) -> ModelConfig:
        return model_config.get(self.model, self.num_layers)

    def optim_config(self) -> OptimConfig:
        return OptimConfig(lr=self.lr, warmup_steps=self.lr_warmup_steps,
                           decay_steps=self.lr_decay_steps, weight_decay=self.weight_decay,
                           clip_norm=self.clip_norm)

    def exec_config(self) -> ExecConfig:
        if self.precision not in PRECISIONS:
            raise ValueError(f"--precision {self.precision!r}: choose one of "
                             f"{', '.join(PRECISIONS)}")
        from triax.models.transformer import REMAT_POLICIES
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"--remat {self.remat!r}: choose one of {', '.join(REMAT_POLICIES)}")
        return ExecConfig(compute_dtype=PRECISIONS[self.precision], remat=self.remat)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


FIELDS = {f.name for f in dataclasses.fields(RunConfig)}


def load_config_file(path: str) -> dict:
    """Read a TOML or YAML run config into a dict of RunConfig fields (validated names)."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path!r} does not exist")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        if path.endswith(".toml"):
            import tomllib
            data = tomllib.loads(raw.decode("utf-8"))
        elif path.endswith((".yaml", ".yml")):
            import yaml
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
