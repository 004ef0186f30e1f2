"""Document data through Grain: global shuffle, per-process shards, packing with boundaries.

    records --shuffle(seed, split), repeat--> this process's every n-th record --tokenize-->
    [tokens, weights] --shift, cut to seq_len--> pieces --first-fit pack into `rows` bins-->
    batch {inputs, targets, weights, segment_ids, positions}

Many documents share one row: ``segment_ids`` (1, 2, … per document; 0 is padding) keep
attention inside each document and ``positions`` restart at 0 for each, so a packed document
sees exactly what it would see alone (``triax.models.visibility.packed_visibility``). Padding and
fine-tuning prompts have weight 0. Documents longer than a row are cut into row-sized pieces.

Each process packs only its own records into the rows its devices hold; its Grain iterator
state (``get_state``) goes into the checkpoint, so a resumed run continues bit-identically.

    >>> from triax.text import ByteTokenizer
    >>> docs = [{"text": "ab"}, {"text": "cde"}, {"text": "f"}]
    >>> it = PackedBatches(docs, ByteTokenizer(), batch_size=1, seq_len=8, seed=0)
    >>> b = it.numpy_next()
    >>> b["segment_ids"].tolist(), b["positions"].tolist()
    ([[1, 1, 2, 2, 2, 3, 3, 0]], [[0, 1, 0, 1, 2, 0, 1, 0]])
"""
from __future__ import annotations

import grain
import grain.experimental as gx

from triax.text.tokenizer import Tokenizer
from triax.training.data import split_seed, to_global
from triax.training.documents import to_example

PACKED_KEYS = ("inputs", "targets", "weights", "segment_ids", "positions")
_PIECE = ("inputs", "targets", "weights")
PACK_BATCHES = 4   # batches packed together (first-fit over 4 × rows bins)


class _ShiftAndCut(gx.FlatMapTransform):
    """An example -> next-token pieces of at most ``seq_len`` (inputs, targets, weights)."""

    max_fan_out = 1 << 16

    def __init__(self, seq_len: int):
        self.T = seq_len

    def flat_map(self, ex):
        toks, w = ex["tokens"], ex["weights"]
        n = len(toks) - 1   # a one-token document predicts nothing
        return [{"inputs": toks[s:s + self.T][: n - s], "targets": toks[s + 1:s + 1 + self.T],
                 "weights": w[s + 1:s + 1 + self.T]} for s in range(0, max(n, 0), self.T)]


class PackedBatches:
    """Packed batches of ``batch_size`` rows; this process builds only ``rows`` of them.

    ``rows`` is the contiguous range this process holds (``triax.training.data.process_rows``);
    it also picks the process's share of the records (range k of n: every n-th record from
    k), so processes never pack the same document. ``get_state``/``set_state`` resume.
    """

    def __init__(self, records: list, tokenizer: Tokenizer, batch_size: int, seq_len: int,
                 seed: int, split: str = "train", rows: slice = slice(None)):
        local = range(batch_size)[rows]
        if not local or batch_size % len(local) or local.start % len(local):
            raise ValueError(f"rows {rows} must be one of equal contiguous shares of "
                             f"{batch_size} rows")
        self.B, self.T, self.rows = batch_size, seq_len, len(local)
        shard, shards = local.start // self.rows, batch_size // self.rows
        ds = (grain.MapDataset.source(records).shuffle(seed=split_seed(seed, split))
              .repeat(None))[shard::shards]
        # Tokenizing in the calling thread: cheap next to a step, and no thread pool to start.
        ds = ds.map(lambda rec: to_example(rec, tokenizer)).to_iter_dataset(
            grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        ds = gx.FlatMapIterDataset(ds, _ShiftAndCut(seq_len))
        # A multiple of the rows as bins (each emission is whole batches; more bins fill rows
        # better) and no bin shuffling, so the order is the records' shuffled order.
        ds = gx.FirstFitPackIterDataset(ds, length_struct={k: seq_len for k in _PIECE},
                                        num_packing_bins=self.rows * PACK_BATCHES,
                                        shuffle_bins=False)
        self._iter = iter(ds.batch(self.rows, drop_remainder=True).map(_rename))
        self.position = 0   # batches drawn (reported; the Grain state is what resumes)

    def numpy_next(self) -> dict:
        """This process's rows of the next batch (numpy)."""
        self.position += 1
        return next(self._iter)

    def next(self, sharding) -> dict:
        """The next batch as global ``jax.Array``s placed by ``sharding``."""
        return to_global(self.numpy_next(), sharding, (self.B, self.T))

    def get_state(self) -> dict:
        """This process's iterator state (the checkpoint's ``data_state``)."""
        return {"grain": self._iter.get_state(), "position": self.position}

    def set_state(self, state: dict) -> None:
        self._iter.set_state(state["grain"])
        self.position = int(state["position"])

    def seek(self, position: int) -> None:
        """Continue at batch ``position``, drawing (and dropping) batches up to it. A packed
        stream cannot rewind: a batch already drawn past ``position`` stays skipped, and
        ``position`` reports where the stream really is (the next checkpoint saves it)."""
        while self.position < position:
            self.numpy_next()


def _rename(b: dict) -> dict:
    """Grain's packer names the boundaries after each feature; one copy is enough."""
    return {"inputs": b["inputs"], "targets": b["targets"], "weights": b["weights"],
            "segment_ids": b["inputs_segment_ids"], "positions": b["inputs_positions"]}
