"""Many LoRA adapters served at once: which adapter holds which slot of the engines' table.

A table config (:func:`table_config`: the base with ``LoraConfig(slots=N)``) gives every
adapted projection a stacked table (``models.lora_table``) of ``N + 1`` slots, slot 0 no
adapter, each of rank ``rank`` at most and on the table's targets. :class:`AdapterTable` keeps
the names: loading reads a PEFT directory (``hf.peft``: its options and shapes checked), pads
its factors to the table's rank (zeros), folds its ``alpha / r`` into B, and writes them into
a free slot of every replica's table; unloading frees the slot. The tables' shapes never
change, so neither does any compiled step (a load compiles one small write program, once).

Each load gets a serial number, the salt of its rows' prefix-cache keys
(``Engine.adapter_keys``): a prompt's KV blocks are shared only between rows of the same
load of the same adapter (slot 0, the base, keeps the plain keys).

    >>> from triax.models import config
    >>> cfg = table_config(config.TINY, slots=2, rank=4, targets=("q_proj", "v_proj"))
    >>> cfg.lora.slots, cfg.lora.rank, cfg.lora.targets
    (2, 4, ('q_proj', 'v_proj'))
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import numpy as np

from triax.choices import PEFT_TARGETS
from triax.hf.files import HFError
from triax.hf.peft import read_adapters, read_config
from triax.inference.errors import InferenceError
from triax.models.config import LoraConfig, ModelConfig
from triax.models import lora
from triax.models.lora import PREFIX, WEIGHTS
from triax.sharding.partition import abstract_model

DEFAULT_RANK = 16   # the table's rank when no adapter is named at start (vLLM's max_lora_rank)


class AdapterNotFound(InferenceError):
    """A request or unload names an adapter that is not loaded."""


def table_config(base: ModelConfig, slots: int, rank: int,
                 targets: Sequence[str]) -> ModelConfig:
    """``base`` with a serving table of ``slots`` adapters of rank ``rank`` at most on
    ``targets`` (alpha = rank: the table's scale is 1; each adapter's is in its B)."""
    if slots < 1:
        raise InferenceError(f"--max-adapters {slots}: a table needs at least one slot")
    return base.replace(lora=LoraConfig(rank=rank, alpha=float(rank), targets=tuple(targets),
                                        slots=slots))


def planned_table(base: ModelConfig, named: Sequence[tuple[str, str]], slots: int = 0,
                  rank: int = 0, targets: str = "") -> ModelConfig:
    """The table config a server starts with (``Source``'s ``--adapter NAME=DIR``,
    ``--max-adapters``, ``--max-adapter-rank``, ``--adapter-targets``): slots, rank and
    targets as given, else the named adapters' count, largest rank (``DEFAULT_RANK``
    without one) and targets' union (every target without one)."""
    loras = {name: read_config(d) for name, d in named}
    widest = max((x.rank for x in loras.values()), default=DEFAULT_RANK)
    if rank and rank < widest:
        name = max(loras, key=lambda n: loras[n].rank)
        raise InferenceError(f"--max-adapter-rank {rank}: adapter {name!r} has r={widest}; "
                             f"give --max-adapter-rank {widest} or more")
    union = {t for x in loras.values() for t in x.targets}
    chosen = tuple(t.strip() for t in targets.split(",") if t.strip()) if targets else \
        tuple(t for t in PEFT_TARGETS if t in union) or PEFT_TARGETS
    missing = sorted(union - set(chosen))
    if missing:
        raise InferenceError(f"--adapter-targets {targets}: the named adapters also adapt "
                             f"{','.join(missing)}; add them")
    try:
        return table_config(base, slots or len(named), rank or widest, chosen)
    except ValueError as e:
        raise InferenceError(str(e)) from None


def with_empty_table(cfg: ModelConfig, base: dict) -> dict:
    """The base parameters joined with ``cfg``'s table, every slot zeros (host arrays)."""
    shapes = lora.split(abstract_model(cfg).shapes)[0]
    return lora.join(jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes), base)


def read_factors(directory: str, base: ModelConfig, table: LoraConfig) -> dict:
    """``{target: (a [L, *in, R], b [L, R, *out])}`` of the PEFT adapter in ``directory``,
    for every target of ``table``: zero-padded to its rank ``R``, ``alpha / r`` in ``b``
    (a target the adapter leaves out: zeros)."""
    try:
        lora = read_config(directory)
    except (HFError, OSError, ValueError) as e:
        raise InferenceError(str(e)) from None
    if lora.rank > table.rank:
        raise InferenceError(f"adapter {directory!r}: r={lora.rank} exceeds the table's rank "
                             f"{table.rank}; restart with --max-adapter-rank {lora.rank}")
    extra = [t for t in lora.targets if t not in table.targets]
    if extra:
        wider = [t for t in PEFT_TARGETS if t in table.targets or t in extra]
        raise InferenceError(f"adapter {directory!r}: target_modules {','.join(extra)} are "
                             f"not in the table's ({','.join(table.targets)}); restart with "
                             f"--adapter-targets {','.join(wider)}")
    try:
        tree = read_adapters(directory, base.replace(lora=lora))
    except (HFError, OSError) as e:
        raise InferenceError(str(e)) from None
    out = {}
    for t in table.targets:
        in_shape, _, out_shape, _ = base.lora_io(t)
        a = np.zeros((base.num_layers,) + in_shape + (table.rank,), np.float32)
        b = np.zeros((base.num_layers, table.rank) + out_shape, np.float32)
        if t in lora.targets:
            pair = tree["blocks"][WEIGHTS[t][0]][PREFIX + t]
            a[..., :lora.rank] = pair["a"]
            b[:, :lora.rank] = pair["b"] * np.float32(lora.scale)
        out[t] = (a, b)
    return out


def _leaves(params: dict, targets) -> dict:
    """``{(target, "a" | "b"): leaf}`` of a params tree's table."""
    return {(t, f): params["blocks"][WEIGHTS[t][0]][PREFIX + t][f]
            for t in targets for f in ("a", "b")}


def _set_slot(table: dict, new: dict, slot):
    return {k: v.at[:, slot].set(new[k].astype(v.dtype)) for k, v in table.items()}


def write_slot(engine, slot: int, factors: dict, key: bytes) -> None:
    """Write ``factors`` (:func:`read_factors`) into ``slot`` of ``engine``'s table and key
    its rows' prefix blocks with ``key``. The new table replaces the old one whole (no
    donation: a step in flight still reads the old arrays)."""
    targets = engine.cfg.lora.targets
    old = _leaves(engine.params, targets)
    write = getattr(engine, "_write_slot", None)
    if write is None:   # compiled once per engine; the slot is an argument
        write = engine._write_slot = jax.jit(
            _set_slot, out_shardings={k: v.sharding for k, v in old.items()})
    new = write(old, {(t, f): factors[t][i] for t in targets for i, f in enumerate("ab")},
                np.int32(slot))
    params = jax.tree.map(lambda x: x, engine.params)   # a new tree, the same base arrays
    for (t, f), v in new.items():
        params["blocks"][WEIGHTS[t][0]][PREFIX + t][f] = v
    engine.params = params
    engine.adapter_keys[slot] = key


@dataclass(frozen=True)
class Loaded:
    """One loaded adapter: its name, directory, table slot and load serial."""

    name: str
    directory: str
    slot: int
    serial: int

    @property
    def key(self) -> bytes:
        """The salt of its rows' prefix-cache keys."""
        return f"adapter:{self.serial}".encode()


class AdapterTable:
    """The names of the adapters in the engines' table (``cfg``: the table config; ``base``:
    the model without it). Thread-safe; loads are serialized."""

    def __init__(self, cfg: ModelConfig, base: ModelConfig):
        self.cfg, self.base = cfg, base
        self.by_name: dict[str, Loaded] = {}
        self._serial = 0
        self._lock = threading.Lock()   # one load or unload at a time

    @property
    def slots(self) -> int:
        return self.cfg.lora.slots

    def names(self) -> list[str]:
        return list(self.by_name)

    def slot_of(self, name: Optional[str]) -> int:
        """The slot serving ``name`` (None: the base, slot 0)."""
        if name is None:
            return 0
        loaded = self.by_name.get(name)
        if loaded is None:
            raise AdapterNotFound(f"no adapter named {name!r} is loaded (loaded: "
                                  f"{', '.join(self.by_name) or 'none'})")
        return loaded.slot

    def load(self, name: str, directory: str, engines, register) -> Loaded:
        """Read ``directory`` and write it into a free slot of every engine; then
        ``register(apply)`` makes it visible (the server calls ``apply`` under its lock)."""
        with self._lock:
            if name in self.by_name:
                raise InferenceError(f"an adapter named {name!r} is already loaded (from "
                                     f"{self.by_name[name].directory}); unload it first")
            used = {x.slot for x in self.by_name.values()}
            free = [s for s in range(1, self.slots + 1) if s not in used]
            if not free:
                raise InferenceError(f"all {self.slots} adapter slots are taken ("
                                     f"{', '.join(self.by_name)}); unload one, or restart "
                                     f"with a larger --max-adapters")
            if not os.path.isdir(directory):
                raise InferenceError(f"adapter {name!r}: {directory!r} is not a directory")
            factors = read_factors(directory, self.base, self.cfg.lora)
            self._serial += 1
            loaded = Loaded(name, directory, free[0], self._serial)
            for eng in engines:
                write_slot(eng, loaded.slot, factors, loaded.key)
            register(lambda: self.by_name.__setitem__(name, loaded))
            return loaded

    def unload(self, name: str, in_flight) -> Loaded:
        """Free ``name``'s slot unless ``in_flight(slot)`` requests still use it."""
        with self._lock:
            loaded = self.by_name.get(name)
            if loaded is None:
                raise AdapterNotFound(f"no adapter named {name!r} is loaded (loaded: "
                                      f"{', '.join(self.by_name) or 'none'})")
            busy = in_flight(loaded.slot, lambda: self.by_name.pop(name))
            if busy:
                raise InferenceError(f"adapter {name!r} serves {busy} request(s) now; unload "
                                     f"it once they finish")
            return loaded
