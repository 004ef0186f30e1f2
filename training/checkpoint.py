"""The training run's resume policy over ``triax.checkpoint`` (the layout and Checkpointer).

* no ``--checkpoint-dir``: nothing is saved (``--resume`` is an error);
* a directory with checkpoints and no ``--resume``: an error (never overwrite a run);
* ``--resume``: restore the latest step onto this run's mesh and strategy, after checking
  that it holds the same model; an empty directory starts from step 0.

    >>> from triax.training.config import RunConfig
    >>> open_checkpoints(RunConfig(resume=True), None, None, print)
    Traceback (most recent call last):
    ...
    ValueError: --resume needs --checkpoint-dir DIR
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from triax.checkpoint import CheckpointError, Checkpointer, check_same_model
from triax.mesh import describe
from triax.models.config import ModelConfig
from triax.training.config import RunConfig


@dataclass
class Resumed:
    """Where a run starts: its checkpointer (None without a directory), the restored state
    (None: initialise), the data position and per-process data states, and the step."""

    ckpt: Optional[Checkpointer] = None
    state: Any = None
    data_position: int = 0
    step: int = 0
    data_state: Optional[list] = None   # None: a checkpoint from before data states


def open_checkpoints(run: RunConfig, cfg: ModelConfig, trainer, note: Callable) -> Resumed:
    """Apply the resume policy above; ``trainer`` gives the restore target's shardings."""
    if not run.checkpoint_dir:
        if run.resume:
            raise ValueError("--resume needs --checkpoint-dir DIR")
        return Resumed()
    ckpt = Checkpointer(run.checkpoint_dir, keep=run.keep_checkpoints, read_only=run.no_save)
    latest = ckpt.latest_step()
    if latest is None:
        if run.resume:
            note(f"triax train: no checkpoint in {ckpt.directory}; starting from step 0")
        return Resumed(ckpt)
    if not run.resume:
        raise CheckpointError(f"{ckpt.directory!r} already holds checkpoints (steps "
                              f"{ckpt.steps()}); pass --resume to continue from step {latest}, "
                              f"or choose another --checkpoint-dir")
    meta = ckpt.read_meta(latest)
    check_same_model(meta.get("model", {}), cfg,
                     where=f"checkpoint step {latest} in {ckpt.directory!r}",
                     fix="pass matching --model/--num-layers, or use another --checkpoint-dir")
    state, meta = ckpt.restore(latest, trainer.abstract_state())
    note(f"triax train: resumed step {latest} from {ckpt.directory} (saved on "
         f"{meta.get('mesh')} / {meta.get('strategy')}; now {describe(trainer.mesh)} / "
         f"{trainer.strategy.name})")
    return Resumed(ckpt, state, int(meta["data_position"]), latest, meta.get("data_state"))
