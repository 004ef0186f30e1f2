"""The training run's resume policy over ``triax.checkpoint`` (the layout and Checkpointer).

* no ``--checkpoint-dir``: nothing is saved (``--resume`` is an error);
* a directory with checkpoints and no ``--resume``: an error (never overwrite a run);
* ``--resume``: restore the latest step onto this run's mesh and strategy, after checking
  that it holds the same model; an empty directory starts from step 0. A step that is
  corrupt or incomplete (files damaged or missing, an array that fails its checksum) is
  set aside as ``<step>.corrupt`` (never deleted) and the next older step is tried, saying
  so; a model mismatch is not damage and stops the run;
* ``--resume-from STEP``: restore exactly that step (no fallback); newer steps are set
  aside as ``<step>.superseded`` so the run can write its own.

The data position is read from a step's meta by ``data_position`` only, so a change of
what the position is (a data-loader state) touches one function.

    >>> from triax.training.config import RunConfig
    >>> open_checkpoints(RunConfig.of(resume=True), None)
    Traceback (most recent call last):
    ...
    ValueError: --resume needs --checkpoint-dir DIR
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Optional

from triax.checkpoint import (CheckpointError, Checkpointer, CorruptCheckpoint,
                              check_same_model, check_writable)
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


@dataclass
class Opened:
    """A checkpoint directory whose resume policy is checked and whose model matches, with
    nothing written or restored yet: ``resume`` opens it and restores onto a Trainer.
    ``train`` checks before it compiles the step (a wrong directory or model fails in a
    second, not after the compile) and opens after the memory check (a step that does not
    fit leaves the directory untouched)."""

    run: RunConfig
    cfg: ModelConfig

    def resume(self, trainer, note: Callable) -> Resumed:
        """The policy's start: a fresh one, or the chosen step restored on ``trainer``'s
        shardings (``trainer`` gives the restore target)."""
        ck = self.run.checkpoint
        if not ck.checkpoint_dir:
            return Resumed()
        ckpt = Checkpointer(ck.checkpoint_dir, keep=ck.keep_checkpoints, read_only=ck.no_save)
        try:
            return self._restore(ckpt, trainer, note)
        except BaseException:
            ckpt.close()
            raise

    def _restore(self, ckpt: Checkpointer, trainer, note: Callable) -> Resumed:
        ck, steps = self.run.checkpoint, ckpt.steps()
        if not steps:
            if ck.resume or ck.resume_from is not None:
                note(f"triax train: no checkpoint in {ckpt.directory}; starting from step 0")
            return Resumed(ckpt)
        if ck.resume_from is not None:
            step = ck.resume_from
            state, meta = restore_step(ckpt, step, self.cfg, trainer)   # an explicit pick
            for newer in (s for s in steps if s > step and not ck.no_save):
                note(f"triax train: --resume-from {step}: set newer step {newer} aside as "
                     f"{ckpt.set_aside(newer, 'superseded')}")
        else:
            state, meta, step = _newest_intact(ckpt, steps, self.cfg, trainer, ck.no_save, note)
        note(f"triax train: resumed step {step} from {ckpt.directory} (saved on "
             f"{meta.get('mesh')} / {meta.get('strategy')}; now {describe(trainer.mesh)} / "
             f"{trainer.strategy.name})")
        return Resumed(ckpt, state, data_position(meta), step, meta.get("data_state"))


def open_checkpoints(run: RunConfig, cfg: ModelConfig) -> Opened:
    """Apply the resume policy above up to the restore, writing nothing: the directory
    (writable unless --no-save), which step, and that it holds ``cfg`` (its meta alone)."""
    ck = run.checkpoint
    resume = ck.resume or ck.resume_from is not None
    if not ck.checkpoint_dir:
        if resume:
            raise ValueError(f"{'--resume' if ck.resume else '--resume-from'} needs "
                             f"--checkpoint-dir DIR")
        if run.loop.on_nonfinite == "rollback":
            raise ValueError("--on-nonfinite rollback needs --checkpoint-dir DIR (it restores "
                             "the last checkpoint)")
        return Opened(run, cfg)
    if os.path.exists(ck.checkpoint_dir) and not os.path.isdir(ck.checkpoint_dir):
        Checkpointer(ck.checkpoint_dir, read_only=True)   # its error: not a directory
    if not ck.no_save:
        check_writable(ck.checkpoint_dir, create=False)
    if not os.path.exists(ck.checkpoint_dir):
        if ck.resume_from is not None:
            raise CheckpointError(f"--resume-from {ck.resume_from}: "
                                  f"{os.path.abspath(ck.checkpoint_dir)!r} holds no such step "
                                  f"(steps [])")
        return Opened(run, cfg)
    with Checkpointer(ck.checkpoint_dir, read_only=True) as ckpt:
        steps = ckpt.steps()
        if ck.resume_from is not None and ck.resume_from not in steps:
            raise CheckpointError(f"--resume-from {ck.resume_from}: {ckpt.directory!r} holds "
                                  f"no such step (steps {steps})")
        if steps and not resume:
            raise CheckpointError(f"{ckpt.directory!r} already holds checkpoints (steps "
                                  f"{steps}); pass --resume to continue from step "
                                  f"{steps[-1]}, or choose another --checkpoint-dir")
        if steps:
            # The step a restore takes first (a meta that does not read is the restore's to
            # set aside); the restore checks it again, and each older one it falls back to.
            first = ck.resume_from if ck.resume_from is not None else steps[-1]
            try:
                meta = ckpt.read_meta(first)
            except CorruptCheckpoint:
                meta = None
            if meta is not None:
                _check_model(ckpt, first, meta, cfg)
    return Opened(run, cfg)


def _newest_intact(ckpt: Checkpointer, steps: list[int], cfg, trainer, keep_in_place: bool,
                   note: Callable):
    """The newest step that restores whole; the damaged newer ones are set aside once an
    intact one is found (with none, every step stays where it is and the run stops)."""
    damaged = []
    for step in reversed(steps):
        try:
            state, meta = restore_step(ckpt, step, cfg, trainer)
        except CorruptCheckpoint as e:
            damaged.append(e)
            continue
        for e in damaged:
            kept = ("left in place (--no-save)" if keep_in_place else
                    f"set aside as {ckpt.set_aside(e.step, 'corrupt')}, not deleted")
            note(f"triax train: checkpoint step {e.step} in {ckpt.directory} is corrupt or "
                 f"incomplete ({e.cause}); {kept}; falling back to step {step}")
        return state, meta, step
    causes = "; ".join(f"step {e.step}: {e.cause}" for e in damaged)
    raise CheckpointError(f"no intact checkpoint in {ckpt.directory!r} ({causes}); every step "
                          f"is kept for inspection; start a fresh run with another "
                          f"--checkpoint-dir")


def restore_step(ckpt: Checkpointer, step: int, cfg: ModelConfig, trainer) -> tuple[Any, dict]:
    """Step ``step``'s state on ``trainer``'s shardings and its meta, after checking that it
    holds ``cfg`` (``ModelMismatch``) and reads back whole (``CorruptCheckpoint``)."""
    _check_model(ckpt, step, ckpt.read_meta(step), cfg)
    state, meta = ckpt.restore(step, trainer.saved_abstract_state())   # the model's form
    return trainer.restored(state), meta


def _check_model(ckpt: Checkpointer, step: int, meta: dict, cfg: ModelConfig) -> None:
    check_same_model(meta.get("model", {}), cfg,
                     where=f"checkpoint step {step} in {ckpt.directory!r}",
                     fix="pass matching --model/--num-layers, or use another --checkpoint-dir")


def data_position(meta: dict) -> int:
    """Where the data stream stands after a saved step (``training_meta`` writes it)."""
    return int(meta["data_position"])
