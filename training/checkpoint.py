"""Orbax checkpoints: async saves, keep-last-N, atomic commits, restore onto any mesh.

A checkpoint step directory holds two items:
  * ``state`` – params, optimizer state and step (sharded arrays, written by every process);
  * ``meta``  – JSON: model config, run config, data position, RNG, mesh and strategy.

Orbax writes each step into a temporary directory and renames it on commit, so a crash
mid-save leaves only a ``*.orbax-checkpoint-tmp-*`` directory, which listing ignores and
the next manager removes. Restore goes through abstract targets that carry the *new*
shardings, so nothing is materialised whole on one device.

    >>> ckpt = Checkpointer("/tmp/run1")
    >>> ckpt.save(10, state, meta)                   # async; returns at once
    >>> state, meta = ckpt.restore(10, trainer.abstract_state())
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from triax.models.config import ModelConfig


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be used as asked (corrupt, partial, mismatched)."""


class Checkpointer:
    """A thin wrapper over ``ocp.CheckpointManager`` with triax's two items."""

    def __init__(self, directory: str, keep: int = 3, async_save: bool = True,
                 read_only: bool = False):
        self.directory = os.path.abspath(directory)
        if os.path.exists(self.directory) and not os.path.isdir(self.directory):
            raise CheckpointError(f"checkpoint path {directory!r} exists and is not a directory")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=not read_only, read_only=read_only,
            cleanup_tmp_directories=not read_only, enable_async_checkpointing=async_save)
        self.manager = ocp.CheckpointManager(self.directory, options=options,
                                             item_names=("state", "meta"))
        # Orbax removes partial saves in the background (awaited at the first save);
        # finish it now so a crashed save's leftovers are gone once we are open.
        getattr(self.manager, "_maybe_await_cleanup_tmp_directory", lambda: None)()

    def steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, step: int, state: Any, meta: dict, wait: bool = False) -> None:
        """Start an (async) save of ``state`` plus the JSON ``meta`` at ``step``."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Block until every started save has committed."""
        self.manager.wait_until_finished()

    def read_meta(self, step: int) -> dict:
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
            return dict(out["meta"])
        except Exception as e:
            raise self._unreadable(step, e) from None

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """Restore ``state`` onto the shardings carried by ``abstract_state``."""
        meta = self.read_meta(step)
        try:
            out = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state)))
        except Exception as e:
            raise self._unreadable(step, e) from None
        return out["state"], meta

    def _unreadable(self, step: int, err: Exception) -> CheckpointError:
        others = [s for s in self.steps() if s != step]
        hint = (f"move {os.path.join(self.directory, str(step))!r} aside to resume from step "
                f"{max(others)}" if others else "start a fresh run with another --checkpoint-dir")
        first = str(err).strip().splitlines()[0][:300] if str(err).strip() else type(err).__name__
        return CheckpointError(f"checkpoint step {step} in {self.directory!r} is corrupt or "
                               f"incomplete ({type(err).__name__}: {first}); {hint}")

    def step_size_bytes(self, step: int) -> int:
        root = os.path.join(self.directory, str(step))
        return sum(os.path.getsize(os.path.join(d, f))
                   for d, _, files in os.walk(root) for f in files)

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def model_config_diff(saved: dict, cfg: ModelConfig) -> dict[str, tuple]:
    """Fields whose saved value differs from ``cfg`` (name -> (saved, requested))."""
    want = json.loads(json.dumps(dataclasses.asdict(cfg)))
    keys = sorted(set(saved) | set(want))
    return {k: (saved.get(k), want.get(k)) for k in keys if saved.get(k) != want.get(k)}


def check_compatible(meta: dict, cfg: ModelConfig, directory: str, step: int) -> None:
    diff = model_config_diff(meta.get("model", {}), cfg)
    if diff:
        fields = "; ".join(f"{k}: checkpoint {a!r} vs requested {b!r}" for k, (a, b) in diff.items())
        raise CheckpointError(
            f"checkpoint step {step} in {directory!r} holds a different model ({fields}); "
            f"pass matching --model/--num-layers, or use another --checkpoint-dir")


def rng_json(seed: int, step: int) -> list[int]:
    """The run's PRNG key at ``step`` as plain ints (for the JSON meta)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return [int(x) for x in jax.random.key_data(key).reshape(-1)]
