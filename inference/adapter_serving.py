"""``Server``'s many-adapter side (``inference.adapter_table``): each request names its
adapter (None: the base), and adapters load and unload while the server serves.

A request's adapter is resolved to its table slot when it is submitted, under the server's
lock, so an unload either sees it in flight (and is refused) or happens before it (and the
request is refused, naming the loaded adapters). A load writes every replica's table before
the name becomes visible, so no step runs a row of a half-written slot.
"""
from __future__ import annotations

from typing import Optional

from triax.inference.adapter_table import AdapterTable, Loaded
from triax.inference.errors import InferenceError


class AdapterServing:
    """The mixin ``Server`` serves many adapters with (``self.adapters``: the table's names,
    None when its engines have no table)."""

    adapters: Optional[AdapterTable] = None

    @property
    def adapter_names(self) -> list[str]:
        """The loaded adapters' names (the models a request may name besides the base)."""
        return [] if self.adapters is None else self.adapters.names()

    def adapter_dirs(self) -> dict[str, str]:
        """Each loaded adapter's directory, by name."""
        return {} if self.adapters is None else {
            n: x.directory for n, x in self.adapters.by_name.items()}

    def _table(self) -> AdapterTable:
        if self.adapters is None:
            raise InferenceError("this server has no adapter table: start it with --adapter "
                                 "NAME=DIR or --max-adapters N to load adapters")
        return self.adapters

    def _adapter_slot(self, adapter: Optional[str]) -> int:
        """The table slot of ``adapter`` (the caller holds the lock); None: 0, the base."""
        if adapter is None:
            return 0
        return self._table().slot_of(adapter)

    def _adapters_kw(self, slots: list[int]) -> dict:
        """``Engine.prefill``'s ``adapters`` argument when the engines have a table."""
        return {} if self.adapters is None else {"adapters": slots}

    def load_adapter(self, name: str, directory: str) -> Loaded:
        """Load the PEFT adapter in ``directory`` as ``name`` into a free slot of every
        replica's table (no step recompiles); requests may name it once this returns."""
        if not name:
            raise InferenceError("an adapter needs a name")
        table = self._table()

        def register(apply):
            with self._lock:
                apply()
        return table.load(name, directory, self.engines, register)

    def unload_adapter(self, name: str) -> Loaded:
        """Free ``name``'s slot; refused while a queued or running request uses it."""
        def in_flight(slot: int, remove) -> int:
            with self._lock:
                n = sum(x.adapter == slot for sch in self.schedulers for x in sch.queue) + sum(
                    x is not None and x.adapter == slot for row in self.slots for x in row)
                if not n:
                    remove()
                return n
        return self._table().unload(name, in_flight)
