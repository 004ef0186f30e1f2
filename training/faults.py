"""What a run does when a step or a save fails: the errors it stops with and their messages.

``--on-nonfinite`` chooses what a NaN/inf loss does:

* ``stop`` (default): stop naming the step, nothing saved (``NonFiniteLoss``);
* ``skip``: the step keeps the old parameters and optimizer state (decided inside the
  compiled step, ``Trainer(skip_nonfinite=True)``); the step counter and the data position
  advance as usual, and the batch position is logged;
* ``rollback``: restore the last checkpoint and continue after the offending batch: the data
  between that checkpoint and the bad batch is skipped (the step counter goes back, the data
  position does not; both are saved, so a resume stays deterministic). After
  ``MAX_ROLLBACKS`` the run stops instead.

A save that fails (a full disk, a storage error) stops the run with ``SaveFailed``: a run
that trains on without saving loses hours. The previous checkpoint stays intact and the
half-written step is never listed (Orbax commits by rename).

    >>> print(SaveFailed.of(7, "/ck", ValueError("RESOURCE_EXHAUSTED: Failed writing "
    ...                     "/ck/7.orbax-checkpoint-tmp/d/1a: No space left on device"), 5))
    saving checkpoint step 7 to /ck failed: No space left on device (ValueError: RESOURCE_EXHAUSTED: Failed writing /ck/7.orbax-checkpoint-tmp/d/1a: No space left on device); training stopped rather than run on without checkpoints. The last committed step 5 is intact; free space (or fix the storage) and rerun with --resume
"""
from __future__ import annotations

from typing import Optional

from triax.checkpoint import CheckpointError
from triax.checkpoint.layout import first_line
from triax.training.config import NONFINITE_MODES

MAX_ROLLBACKS = 3   # a NaN that comes back after this many rollbacks is not one bad batch
# Storage errors reach us wrapped (TensorStore, Orbax threads) in long messages: name the
# cause up front when it is one of these.
_STORAGE_CAUSES = ("No space left on device", "Disk quota exceeded", "Read-only file system",
                   "Permission denied", "Input/output error")


class NonFiniteLoss(ValueError):
    """The loss became NaN or inf; the run stopped without saving the bad state."""


class SaveFailed(CheckpointError):
    """A checkpoint save failed; the run stopped with the previous checkpoint intact."""

    @classmethod
    def of(cls, step: int, directory: str, err: BaseException,
           last: Optional[int]) -> "SaveFailed":
        kept = (f"The last committed step {last} is intact" if last is not None
                else "No step was committed")
        text = str(err)
        cause = next((f": {c}" for c in _STORAGE_CAUSES if c in text), "")
        return cls(f"saving checkpoint step {step} to {directory} failed{cause} "
                   f"({type(err).__name__}: {first_line(err)}); training stopped rather than "
                   f"run on without "
                   f"checkpoints. {kept}; free space (or fix the storage) and rerun with "
                   f"--resume")


class Rollback(Exception):
    """Internal to the loop (``rollback`` mode): step ``step`` (batch ``index``) went bad."""

    def __init__(self, step: int, index: int, what: str):
        super().__init__(f"{what} at step {step} (batch {index})")
        self.step, self.index, self.what = step, index, what


def nonfinite_message(what: str, step: int, index: int, last: Optional[int],
                      directory: Optional[str]) -> str:
    kept = (f"; the last good checkpoint (step {last}) in {directory} is untouched"
            if last is not None else "; no checkpoint was written for this state")
    return (f"{what} at step {step} (batch {index}); stopped without saving{kept}. Try a "
            f"lower --lr or --precision fp32, or --on-nonfinite skip|rollback")


__all__ = ["MAX_ROLLBACKS", "NONFINITE_MODES", "NonFiniteLoss", "Rollback", "SaveFailed",
           "nonfinite_message"]
