"""Orbax checkpoints: async saves, keep-last-N, atomic commits, restore onto any mesh.

Orbax writes each step into a temporary directory and renames it on commit, so a crash
mid-save leaves only a ``*.orbax-checkpoint-tmp-*`` directory, which listing ignores and
the next writer removes. Restores go through abstract targets that carry the *new*
shardings, so nothing is materialised whole on one device.

    >>> import tempfile, jax.numpy as jnp
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
    >>> ckpt.save(10, {"w": jnp.arange(4.0)}, {"step": 10}, wait=True)
    >>> ckpt.steps(), ckpt.read_meta(10)
    ([10], {'step': 10})
    >>> ckpt.close()
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import orbax.checkpoint as ocp

from triax.checkpoint.layout import ITEMS, META, STATE, CheckpointError, first_line


class _ReadOnlyNotice(logging.Filter):
    """Orbax logs at WARNING that a manager opened for reading is read-only (``absl``, once
    per open). Every read triax does is meant so; only that exact record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Given directory is read only=%s"


logging.getLogger("absl").addFilter(_ReadOnlyNotice())


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` with triax's two items.

    A context manager: ``with Checkpointer.existing(d) as ckpt:`` closes Orbax's manager (its
    background threads) on the way out, so nothing is left to fail at interpreter exit.
    """

    def __init__(self, directory: str, keep: Optional[int] = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint path {directory!r} exists and is not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        # Orbax removes partial saves in the background (awaited at the first save);
        # finish it now so a crashed save's leftovers are gone once we are open.
        getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    @classmethod
    def existing(cls, directory: str) -> "Checkpointer":
        """Open a directory that must exist, for reading only."""
        if not os.path.isdir(directory):
            raise FileNotFoundError(f"checkpoint directory {directory!r} does not exist")
        return cls(directory, read_only=True)

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, wait: bool = False) -> None:
        """Start an (async) save of ``state`` plus the JSON ``meta`` at ``step``."""
        self.manager.save(step, args=ocp.args.Composite(**{
            STATE: ocp.args.StandardSave(state), META: ocp.args.JsonSave(meta)}), force=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until every started save has committed."""
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                **{META: ocp.args.JsonRestore()}))
            return dict(out[META])
        except Exception as e:
            raise self._unreadable(step, e) from None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore ``state`` onto the shardings carried by ``abstract_state``."""
        meta = self.read_meta(step)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                **{STATE: ocp.args.StandardRestore(abstract_state)}))
        except Exception as e:
            raise self._unreadable(step, e) from None
        return out[STATE], meta

    def restore_part(self, step: int, target: Any) -> Any:
        """Restore only the subtree of ``state`` that ``target`` names (e.g. ``{"params": …}``,
        skipping the optimizer state), onto ``target``'s shardings. Orbax errors pass through."""
        return self.manager.restore(step, args=ocp.args.Composite(**{STATE: ocp.args.PyTreeRestore(
            item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)}))[STATE]

    def _unreadable(self, step: int, err: Exception) -> CheckpointError:
        others = [s for s in self.steps() if s != step]
        hint = (f"move {os.path.join(self.directory, str(step))!r} aside to resume from step "
                f"{max(others)}" if others else "start a fresh run with another --checkpoint-dir")
        return CheckpointError(f"checkpoint step {step} in {self.directory!r} is corrupt or "
                               f"incomplete ({type(err).__name__}: {first_line(err)}); {hint}")

    def step_size_bytes(self, step: int) -> int:
        root = os.path.join(self.directory, str(step))
        return sum(os.path.getsize(os.path.join(d, f))
                   for d, _, files in os.walk(root) for f in files)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
