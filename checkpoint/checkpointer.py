"""Orbax checkpoints: async saves, keep-last-N, atomic commits, restore onto any mesh.

Orbax writes each step into a temporary directory and renames it on commit, so a crash
mid-save leaves only a ``*.orbax-checkpoint-tmp-*`` directory, which listing ignores and
the next writer removes. Restores go through abstract targets that carry the *new*
shardings, so nothing is materialised whole on one device. Every save writes a checksum of
each array into the meta item (``triax.checkpoint.integrity``) and every restore checks
them, naming the step and the array that differ; ``verify`` checks a step without a target.
A step found damaged is never deleted: ``set_aside`` renames it out of Orbax's listing.

In one process, a replicated array is written by that process whole
(``use_replica_parallel=False``): Orbax's default splits its write among the devices that
hold copies, which is for many processes, and in one it only compiles a slice program per
device and array shape at the first save (48 programs for 6 replicated arrays on 8 devices).

    >>> import tempfile, jax.numpy as jnp
    >>> ckpt = Checkpointer(tempfile.mkdtemp(), async_save=False)
    >>> ckpt.save(10, {"w": jnp.arange(4.0)}, {"step": 10}, wait=True)
    >>> ckpt.steps(), ckpt.read_meta(10)["step"], ckpt.verify(10)
    ([10], 10, None)
    >>> ckpt.close()
"""
from __future__ import annotations

import logging
import os
from typing import Any, Optional

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from triax.checkpoint.integrity import CHECKSUMS, checksums, mismatched
from triax.checkpoint.layout import (ITEMS, META, STATE, CheckpointError, CorruptCheckpoint,
                                     first_line)


class _ReadOnlyNotice(logging.Filter):
    """Orbax logs at WARNING that a manager opened for reading is read-only (``absl``, once
    per open). Every read triax does is meant so; only that exact record is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "Given directory is read only=%s"


logging.getLogger("absl").addFilter(_ReadOnlyNotice())


def _registry():
    """Orbax's standard type handlers; in one process, jax.Arrays written without
    replica-parallel slicing (see the module doc)."""
    th = ocp.type_handlers
    return th.create_type_handler_registry(
        *((t, th.ScalarHandler()) for t in (int, float, bytes, np.number)),
        (np.ndarray, th.NumpyHandler()), (str, th.StringHandler()),
        (jax.Array, th.ArrayHandler(use_replica_parallel=jax.process_count() > 1)))


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
        if not read_only:
            check_writable(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep, save_interval_steps=0 if read_only else 1,
            create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
            STATE: ocp.PyTreeCheckpointHandler(type_handler_registry=_registry()),
            META: ocp.JsonCheckpointHandler()})
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
        """The last step committed on disk. Not the manager's own list: Orbax lists a step
        as soon as its save starts, so after a failed save it would name the broken step."""
        committed = ocp.utils.checkpoint_steps(self.directory) if os.path.isdir(
            self.directory) else []
        return max(committed, default=None)

    def save(self, step: int, state: Any, meta: dict, wait: bool = False) -> None:
        """Start an (async) save of ``state`` plus the JSON ``meta`` at ``step``; the meta
        gains the arrays' checksums. A failed earlier async save raises here."""
        meta = {**meta, CHECKSUMS: checksums(state)}
        self.manager.save(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeSave(state), META: ocp.args.JsonSave(meta)}), force=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until every started save has committed (raises if one failed)."""
        self.manager.wait_until_finished()

    def check_for_errors(self) -> None:
        """Raise now if an async save already failed in the background (cheap: no wait).
        The manager's finalize thread keeps a failed commit's error until the next wait, so
        once no save is in progress, that (instant) wait raises it."""
        self.manager.check_for_errors()
        if not self.manager.is_saving_in_progress():
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
            out = self.manager.restore(step, args=ocp.args.Composite(**{
                STATE: ocp.args.PyTreeRestore(item=abstract_state, restore_args=(
                    ocp.checkpoint_utils.construct_restore_args(abstract_state)))}))
        except Exception as e:
            raise self._unreadable(step, e) from None
        self._check_sums(step, meta, out[STATE])
        return out[STATE], meta

    def restore_part(self, step: int, target: Any) -> Any:
        """Restore only the subtree of ``state`` that ``target`` names (e.g. ``{"params": …}``,
        skipping the optimizer state), onto ``target``'s shardings, checking its checksums.
        Orbax errors pass through."""
        state = self.manager.restore(step, args=ocp.args.Composite(**{
            STATE: ocp.args.PyTreeRestore(
                item=target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True)}))[STATE]
        self._check_sums(step, self.read_meta(step), state)
        return state

    def verify(self, step: int) -> Optional[str]:
        """None if step ``step`` reads back whole and matches its checksums, else what is
        wrong. Arrays come back as host numpy arrays (no target, any device count)."""
        try:
            meta = self.read_meta(step)
            path = os.path.join(self.directory, str(step), STATE)
            with ocp.PyTreeCheckpointer() as reader:   # no target: a reader of its own
                tree = reader.metadata(path).item_metadata
                args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
                state = reader.restore(path, args=ocp.args.PyTreeRestore(restore_args=args))
            self._check_sums(step, meta, state)
        except CheckpointError as e:
            return str(e)
        except Exception as e:
            return str(self._unreadable(step, e))
        return None   # a step written before checksums: it decodes, which is all we know

    def _check_sums(self, step: int, meta: dict, state: Any) -> None:
        bad = mismatched(meta.get(CHECKSUMS, {}), state)
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            raise self._unreadable(step, CheckpointError(
                f"array {bad[0]}{more} does not match the checksum saved with it"))

    def set_aside(self, step: int, reason: str) -> str:
        """Rename step ``step`` to ``<step>.<reason>`` (never deleted; Orbax no longer lists
        it) and return the new path. Process 0 renames; every process then sees it."""
        src = os.path.join(self.directory, str(step))
        dst, n = f"{src}.{reason}", 1
        while os.path.exists(dst):
            dst, n = f"{src}.{reason}-{n}", n + 1
        if jax.process_index() == 0:
            os.rename(src, dst)
        if jax.process_count() > 1:   # every process agrees on dst: it read the same listing
            multihost_utils.sync_global_devices(f"triax set_aside {step}")
        self.manager.reload()
        return dst

    def _unreadable(self, step: int, err: Exception) -> CorruptCheckpoint:
        others = [s for s in self.steps() if s != step]
        hint = (f"--resume falls back to step {max(others)} (and sets this one aside), or "
                f"pass --resume-from STEP" if others else
                "start a fresh run with another --checkpoint-dir")
        cause = (first_line(err) if isinstance(err, CheckpointError)
                 else f"{type(err).__name__}: {first_line(err)}")
        return CorruptCheckpoint(step, self.directory, cause, hint)

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

def check_writable(directory: str, create: bool = True) -> None:
    """Fail now, not at the first save hours later, if ``directory`` cannot be written (a
    real write: permission bits say nothing to root or on a read-only mount).
    ``create=False`` leaves nothing behind: a directory not made yet is probed in the
    nearest existing one above it, where it would be made."""
    try:
        where = os.path.abspath(directory)
        if create:
            os.makedirs(where, exist_ok=True)
        while not os.path.exists(where):
            where = os.path.dirname(where)
        probe = os.path.join(where, f".triax-write-probe-{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"--checkpoint-dir {directory!r} is not writable ({e.strerror}); "
                              f"choose a writable directory, or pass --no-save to only read "
                              f"it") from None
