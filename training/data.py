"""Token data for training: built-in corpora, user files, deterministic resumable batches.

Token streams (``--data``):
  * ``pydoc``  – English text shipped inside Python (``pydoc_data.topics``, ~0.47 MB).
  * ``markov`` – a random first-order Markov chain whose optimal loss (its entropy rate) is
    known exactly, so tests can check learning against it.
  * a path to a UTF-8 text file (tokenized with ``--tokenizer``, bytes by default) or a
    ``.npy`` of token ids (memory-mapped).
Document files (``.jsonl``, ``.parquet``) are packed instead: ``triax.training.packing``.

A stream is cut into windows of ``seq_len + 1`` tokens; a Grain ``MapDataset`` shuffles the
window ids globally (a new order every epoch) and batches them, so batch ``i`` is a pure
function of ``(seed, split, i)``: the data position is one integer, saved in checkpoints, and
batch ``i`` is the same on any mesh. Each process reads only the rows its devices hold.

    >>> corpus = load_corpus("markov")
    >>> loader = Batches(corpus.train, batch_size=8, seq_len=16, seed=0)
    >>> batch = loader.numpy_batch(0)           # {"inputs": int32[8,16], "targets": ...}
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Optional

import grain
import jax
import numpy as np
from numpy.lib import format as npy_format

from triax.text.tokenizer import Tokenizer, get_tokenizer


class DataError(ValueError):
    """Bad data input (missing/unreadable file, too little data)."""


BUILTIN = ("pydoc", "markov")
_SPLIT_IDS = {"train": 0, "val": 1}


@dataclass(frozen=True)
class Corpus:
    """A token stream split into train and validation parts (views, no copies)."""

    name: str
    tokens: np.ndarray
    val_fraction: float = 0.05
    info: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def split_at(self) -> int:
        return len(self.tokens) - max(int(len(self.tokens) * self.val_fraction), 1)

    @property
    def train(self) -> np.ndarray:
        return self.tokens[:self.split_at]

    @property
    def val(self) -> np.ndarray:
        return self.tokens[self.split_at:]


def pydoc_text() -> str:
    import pydoc_data.topics as topics
    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def markov_chain(num_states: int = 16, length: int = 200_000, seed: int = 1234,
                 concentration: float = 0.3) -> tuple[np.ndarray, float]:
    """Sample a random Markov chain; returns ``(tokens, entropy_rate_nats)``.

    The entropy rate ``Σ_i π_i H(P_i·)`` is the best achievable next-token loss.
    """
    rng = np.random.default_rng(seed)
    P = rng.dirichlet(np.full(num_states, concentration), size=num_states)
    pi = np.full(num_states, 1.0 / num_states)
    for _ in range(1000):
        pi = pi @ P
    with np.errstate(divide="ignore", invalid="ignore"):
        row_h = -np.sum(np.where(P > 0, P * np.log(P), 0.0), axis=1)
    entropy = float(pi @ row_h)
    cum = np.cumsum(P, axis=1)
    u = rng.random(length)
    toks = np.empty(length, np.int32)
    s = int(rng.integers(num_states))
    for t in range(length):  # ~0.5 s for 200k steps; generated once per process
        s = min(int(np.searchsorted(cum[s], u[t])), num_states - 1)
        toks[t] = s
    return toks, entropy


def unigram_loss(tokens: np.ndarray, sample: int = 1_000_000) -> float:
    """Entropy (nats) of the token frequencies: the loss of the best context-free model."""
    counts = np.bincount(np.asarray(tokens[:sample]).astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def load_corpus(source: str, val_fraction: float = 0.05,
                tokenizer: Optional[Tokenizer] = None) -> Corpus:
    """Resolve ``--data``: a built-in name, a text file or a ``.npy`` token file; text is
    tokenized with ``tokenizer`` (bytes when None)."""
    tokenizer = tokenizer or get_tokenizer(None)
    if source == "pydoc":
        toks = tokenizer.encode(pydoc_text())
        return Corpus("pydoc", toks, val_fraction, {"unigram_loss": unigram_loss(toks)})
    if source == "markov":
        toks, h = markov_chain()
        return Corpus("markov", toks, val_fraction,
                      {"optimal_loss": h, "unigram_loss": unigram_loss(toks)})
    return Corpus(os.path.basename(source), _read_file(source, tokenizer), val_fraction)


def _read_file(path: str, tokenizer: Tokenizer) -> np.ndarray:
    hint = (f"pass --data {' | '.join(BUILTIN)} or a path to a .txt, .npy, .jsonl or "
            f".parquet file")
    if not os.path.exists(path):
        raise DataError(f"data file {path!r} does not exist; {hint}")
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise DataError(f"data file {path!r} is not a readable file; {hint}")
    try:
        if path.endswith(".npy"):
            _check_npy_length(path)
            toks = np.load(path, mmap_mode="r")
            if toks.ndim != 1 or toks.dtype.kind not in "iu":
                raise DataError(f"data file {path!r}: expected a 1-D integer array of token ids, "
                                f"got {toks.dtype} with shape {toks.shape}")
            return toks
        with open(path, "rb") as f:
            return tokenizer.encode(decode_utf8(f.read(), path))
    except (OSError, ValueError) as e:
        if isinstance(e, DataError):
            raise
        raise DataError(f"cannot read data file {path!r}: {e}; {hint}") from None


def decode_utf8(raw: bytes, path: str, start: int = 0, line: int = 1) -> str:
    """Text files are UTF-8; a byte sequence that is not names the file, its byte offset and
    line (``raw`` begins at byte ``start``, on line ``line``, of ``path``)."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        at, line = start + e.start, line + raw.count(b"\n", 0, e.start)
        raise DataError(f"data file {path!r} is not UTF-8 text: byte offset {at:,} (line "
                        f"{line}) holds {raw[e.start:e.end]!r} ({e.reason}); re-encode it as UTF-8 "
                        f"(e.g. iconv -t UTF-8), or give token ids as a .npy file") from None


def _check_npy_length(path: str) -> None:
    """A ``.npy`` cut short (a bad copy, a full disk) is named with where it ends, before
    ``np.load``'s memory map fails without saying which file or where."""
    with open(path, "rb") as f:
        read_header = (npy_format.read_array_header_1_0 if npy_format.read_magic(f) == (1, 0)
                       else npy_format.read_array_header_2_0)
        shape, _, dtype = read_header(f)
        header = f.tell()
    count = math.prod(shape)
    need, size = header + count * dtype.itemsize, os.path.getsize(path)
    if size < need:
        raise DataError(f"data file {path!r} is truncated: its header promises {count:,} "
                        f"{dtype} ids (bytes {header:,}..{need:,}) but the file ends at byte "
                        f"{size:,}, inside id {(size - header) // dtype.itemsize:,}; re-create "
                        f"or re-copy it")


def check_vocab(corpus: Corpus, vocab_size: int, source: Optional[str] = None,
                chunk: int = 1 << 24) -> None:
    """Every token id must be a row of the embedding (one outside gives NaN or garbage):
    the first that is not is named with its position. Scans the whole stream, in chunks."""
    toks = corpus.tokens
    for start in range(0, len(toks), chunk):
        part = np.asarray(toks[start:start + chunk])
        if part.min() >= 0 and part.max() < vocab_size:
            continue
        i = int(np.flatnonzero((part < 0) | (part >= vocab_size))[0])
        raise DataError(f"data {source or corpus.name!r}: token id {int(part[i])} at position "
                        f"{start + i:,} (of {len(toks):,}) is outside the model's vocabulary "
                        f"of {vocab_size} ids (0..{vocab_size - 1}); the ids come from another "
                        f"tokenizer: use a model whose vocab_size covers them (and that "
                        f"--tokenizer), or re-tokenize the data")


class Batches:
    """Shuffled windows of a token stream, batched by Grain; ``position`` = batches drawn.

    Batch ``i`` depends only on ``(seed, split, i)``, so a resumed run (position restored
    from the checkpoint) sees exactly the batches an uninterrupted run would.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int,
                 split: str = "train", position: int = 0):
        if len(tokens) < seq_len + 2:
            raise DataError(f"{split} split has {len(tokens)} tokens; need at least "
                            f"{seq_len + 2} for --seq-len {seq_len} (use more data or a "
                            f"shorter --seq-len)")
        self.tokens, self.B, self.T = tokens, batch_size, seq_len
        self.seed, self.split, self.position = seed, split, position
        windows = (len(tokens) - 1) // seq_len   # window w: tokens[w*T : w*T + T + 1]
        self.window_ids = (grain.MapDataset.range(windows)
                           .shuffle(seed=split_seed(seed, split)).repeat(None)
                           .batch(batch_size))

    def numpy_batch(self, index: int, rows: slice = slice(None)) -> dict:
        starts = np.asarray(self.window_ids[index])[rows] * self.T
        win = np.stack([np.asarray(self.tokens[s:s + self.T + 1]) for s in starts])
        win = win.astype(np.int32)
        return {"inputs": win[:, :-1], "targets": win[:, 1:]}

    def global_batch(self, index: int, sharding) -> dict:
        """Batch ``index`` as global ``jax.Array``s; this process reads only its rows."""
        rows = process_rows(sharding, (self.B, self.T))
        return to_global(self.numpy_batch(index, rows), sharding, (self.B, self.T))

    def next(self, sharding) -> dict:
        batch = self.global_batch(self.position, sharding)
        self.position += 1
        return batch

    def get_state(self) -> dict:
        """This process's iterator state (the checkpoint's ``data_state``)."""
        return {"position": self.position}

    def set_state(self, state: dict) -> None:
        self.position = int(state["position"])

    def seek(self, position: int) -> None:
        """Continue at batch ``position`` (``--on-nonfinite rollback`` skips a window)."""
        self.position = int(position)


def split_seed(seed: int, split: str) -> int:
    """One shuffle seed per (run seed, split), so validation never replays training order."""
    return int(np.random.SeedSequence([seed, _SPLIT_IDS[split]]).generate_state(1)[0])


def to_global(local: dict, sharding, shape) -> dict:
    """This process's rows of a batch -> global ``jax.Array``s of ``shape`` (rows, seq)."""
    return {k: jax.make_array_from_process_local_data(sharding, v, shape)
            for k, v in local.items()}


def process_rows(sharding, shape) -> slice:
    """The contiguous row range this process's devices hold under ``sharding``."""
    idx = sharding.addressable_devices_indices_map(shape).values()
    starts = [(s[0].start or 0) for s in idx]
    stops = [(s[0].stop if s[0].stop is not None else shape[0]) for s in idx]
    return slice(min(starts), max(stops))
