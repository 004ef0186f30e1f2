"""``--data`` and ``--tokenizer`` -> a run's loaders: shuffled windows of a token stream
(``triax.training.data``) or packed documents (``triax.training.packing``).

Every loader has ``next(sharding)``, ``position`` and ``get_state``/``set_state``; the
checkpoint keeps each process's state (``gather_states``), so a resume is bit-identical.

    >>> from triax.text import ByteTokenizer
    >>> batch_keys("markov"), batch_keys("sft.jsonl")[-2:]
    (('inputs', 'targets'), ('segment_ids', 'positions'))
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from triax.text.tokenizer import Tokenizer
from triax.training.data import Batches, DataError, check_vocab, load_corpus
from triax.training.documents import is_document_file, read_records
from triax.training.packing import PACKED_KEYS, PackedBatches

STREAM_KEYS = ("inputs", "targets")


def batch_keys(data: str) -> tuple:
    """The keys of the batches ``--data`` gives (they shape the compiled step)."""
    return PACKED_KEYS if is_document_file(data) else STREAM_KEYS


@dataclass
class DataSource:
    """The run's data: a name, a size for the log, and a loader per split."""

    name: str
    size: str                   # for the start-up line, e.g. "470,000 tokens"
    tokenizer: Tokenizer
    splits: dict                # split -> a token array (stream) or a list of records
    packed: bool
    info: dict = field(default_factory=dict)

    def loader(self, split: str, batch_size: int, seq_len: int, seed: int,
               rows: slice = slice(None)) -> Any:
        """A fresh loader at batch 0; ``rows``: this process's rows (packed data only: a
        stream reads its rows per batch)."""
        if self.packed:
            return PackedBatches(self.splits[split], self.tokenizer, batch_size, seq_len, seed,
                                 split, rows)
        return Batches(self.splits[split], batch_size, seq_len, seed, split)


def open_data(data: str, tokenizer: Tokenizer, vocab_size: int,
              val_fraction: float = 0.05) -> DataSource:
    """Read ``--data``; check the tokenizer and tokens fit the model's vocabulary."""
    if tokenizer.vocab_size > vocab_size:
        raise DataError(f"the tokenizer has {tokenizer.vocab_size} ids but the model's "
                        f"vocabulary is {vocab_size}; use a model with vocab_size >= "
                        f"{tokenizer.vocab_size} (or the matching --tokenizer)")
    if is_document_file(data):
        records = read_records(data)
        n_val = max(int(len(records) * val_fraction), 1)
        if len(records) <= n_val:
            raise DataError(f"data file {data!r} has {len(records)} record(s); need more than "
                            f"{n_val} to hold out a validation split (or lower --val-fraction)")
        return DataSource(data.rsplit("/", 1)[-1], f"{len(records):,} documents, packed",
                          tokenizer, {"train": records[:-n_val], "val": records[-n_val:]}, True)
    corpus = load_corpus(data, val_fraction, tokenizer)
    check_vocab(corpus, vocab_size, data)
    return DataSource(corpus.name, f"{len(corpus.tokens):,} tokens", tokenizer,
                      {"train": corpus.train, "val": corpus.val}, False, corpus.info)


def gather_states(state: dict) -> list:
    """Every process's loader state, in process order (for the checkpoint's meta)."""
    if jax.process_count() == 1:
        return [state]
    raw = np.frombuffer(json.dumps(state).encode(), np.uint8)
    sizes = multihost_utils.process_allgather(np.int32(raw.size))
    padded = np.zeros(int(np.max(sizes)), np.uint8)
    padded[:raw.size] = raw
    got = multihost_utils.process_allgather(padded)
    return [json.loads(bytes(got[i, :int(n)])) for i, n in enumerate(np.asarray(sizes))]


def restore_state(loader, states: list | None, position: int) -> None:
    """Put ``loader`` where the checkpoint left it: this process's saved state, or (an older
    checkpoint of a stream) the batch position."""
    if states is None:
        if isinstance(loader, PackedBatches) and position:
            raise DataError("the checkpoint has no data iterator state for packed documents; "
                            "resume it with the data it was trained on, or start afresh")
        loader.position = position
        return
    if len(states) != jax.process_count():
        raise DataError(f"the checkpoint's data state was saved by {len(states)} process(es) "
                        f"but this run has {jax.process_count()}; resume with the same "
                        f"number of processes")
    loader.set_state(states[jax.process_index()])
