"""Chunked prefill: a long prompt enters its slot a chunk per serving step, inside a token
budget, while the running streams decode one token between its chunks.

With ``Server(max_step_tokens=N)`` (``triax serve --max-step-tokens N``), each serving step
of a replica spends at most ``N`` tokens: every running decode row counts one, and the rest
of the budget goes to the admitted prompts, oldest first. A prompt that fits what is left is
prefilled whole; a longer one gets a chunk of as many whole KV blocks as fit, and its next
chunk the next step. Rows still prefilling do not decode; the one whose last chunk ran
samples its first token and decodes from the same step on. So the running streams wait
at most one chunk's prefill between two tokens, not a whole long prompt's.

A chunk is the prefix-cache path (``Engine.prefill``'s ``cached``): the positions its row
holds already (a cached prefix, earlier chunks) are read from the pool through its block
table and attended to, and only the chunk's positions ``[start, end)`` are computed and
written. Chunks end on block boundaries, so a chunk never rewrites a block an earlier one
filled; each chunk's full blocks are registered in the prefix cache at once, so a prompt
arriving meanwhile can share them. The last chunk samples from the same position, seed and
logits as a whole prefill, so greedy and sampled tokens are those of an unchunked run
(tests/test_chunked_prefill.py, fp32; an int8 pool's later chunks read the quantized
prefix, as a prefix-cache hit does).

**Fused steps** (``Server(fused_steps=True)``, the default): a replica whose step has one
chunk beside running decode rows runs both as one program (``Engine.mixed``,
``ModelRunner._mixed``): the rows' single tokens and the chunk's, padded to a prompt bucket,
go through every dense layer as one row, so the step reads its weights once, not once per
program; only attention splits, each part through its own block tables
(``models.decode.mixed_attention``), the chunk's padding writing nothing. Its row samples its
first token (a last chunk) in that step and decodes from the next. Tokens are those of two
programs (seeded by position); an int8 pool's chunk attends to its own positions quantized,
as decode rows do (two programs: unquantized). The two programs (a prefill, then the decode)
run instead when the step has several chunks or prompts, no decode rows, or a row that must
go whole (below), and always on replicas with ``pipe > 1``, a ``context`` split, row groups
(``data > 1``), a LoRA table of adapters or speculative decoding; whole-prompt serving
(``max_step_tokens=0``) keeps its own prefill too.

Not chunked (prefilled whole, at once, when their turn comes): requests whose sampling
reads the whole prompt in the prefill (penalties, ``prompt_logprobs``), and every request
on an engine that splits its cache over ``context`` (a striped prompt has no cached path).
When the decode rows alone use up the budget, a prompt still gets one block per step, so
it always makes progress.

    >>> rows = [Pending(live=None, slot=0, tokens=list(range(40)), done=0),
    ...         Pending(live=None, slot=1, tokens=list(range(5)), done=0)]
    >>> [(p.slot, end) for p, end in plan_chunks(rows, budget=20, block_size=8)]
    [(0, 16)]
    >>> rows[0].done = 32
    >>> [(p.slot, end) for p, end in plan_chunks(rows, budget=20, block_size=8)]
    [(0, 40), (1, 5)]
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from triax.inference.engine import Engine
from triax.inference.penalties import reads_prompt


@dataclass
class Pending:
    """An admitted request still prefilling: its slot, what it prefills, and how far."""

    live: Any          # the server's record of the request (``inference.request._Live``)
    slot: int
    tokens: list[int]  # its prompt, and after a preemption what it generated (recomputed)
    done: int          # positions its blocks hold already (a cached prefix, earlier chunks)
    whole: bool = False   # prefilled in one piece (its sampling reads the whole prompt)


def plan_chunks(pending: Sequence[Pending], budget: int,
                block_size: int) -> list[tuple[Pending, int]]:
    """``(row, end)`` for the rows that prefill this step, oldest first: positions
    ``[row.done, end)``, at most ``budget`` tokens in all. A row's rest that fits is taken
    whole; else as many whole blocks as fit (none left: the step ends there). The first
    row always runs (one block, or its rest if smaller), so a prompt never stalls."""
    out, left = [], budget
    for row in pending:
        rest = len(row.tokens) - row.done
        if rest <= left or (not out and (row.whole or rest <= block_size)):
            out.append((row, len(row.tokens)))
            left -= rest
            continue
        take = 0 if row.whole else left // block_size * block_size
        if not out:
            take = max(take, block_size)
        if take:
            out.append((row, row.done + take))
        break
    return out


@dataclass
class Chunk:
    """One prompt chunk a replica's fused step runs beside its decode rows."""

    slot: int
    live: Any
    tokens: np.ndarray   # its row's tokens up to the chunk's end
    cached: int          # positions before the chunk, in its blocks already
    final: bool          # its prompt's last chunk: its sampled token is the first


class ChunkedPrefill:
    """The serving loop's prefill work, whole or in chunks (``Server`` holds the state:
    ``max_step_tokens``, ``prefilling``, each replica's pending rows by slot, and
    ``fused_steps`` with this step's ``mixing``: each replica's chunk for its fused step)."""

    max_step_tokens: int
    prefilling: list[dict[int, Pending]]
    fused_steps: bool
    mixing: dict[int, Chunk]

    def _decoding(self, r: int) -> list:
        """Replica ``r``'s slots, with the requests still prefilling as None (they do not
        decode yet; nor does the row whose chunk a fused step runs, even its last)."""
        rows, mixing = self.prefilling[r], self.mixing.get(r)
        return [None if i in rows and rows[i].live is live
                or mixing is not None and mixing.live is live else live
                for i, live in enumerate(self.slots[r])]

    def _fuse(self, r: int, eng: Engine, work) -> bool:
        """Whether replica ``r`` runs this step's prefill ``work`` fused with its decode
        (one chunk beside running rows; see the module docstring): then it is kept in
        ``mixing`` for the decode phase to launch."""
        slots, batch, prompts, cached, final = work
        if not (self.fused_steps and self.max_step_tokens and len(batch) == 1 and eng.mixes
                and eng.speculator is None
                and not reads_prompt(batch[0].sampling or eng.sampling)
                and any(x is not None for x in self._decoding(r))):
            return False
        self.mixing[r] = Chunk(slots[0], batch[0], prompts[0], cached[0], final[0])
        return True

    def _prefill_work(self, r: int, eng: Engine, slots: list[int], batch: list):
        """``(slots, batch, prompts, cached, final)``: what replica ``r`` prefills this step,
        given the requests just admitted into ``slots``. Unchunked: each whole, from its
        cached prefix. Chunked: the planned chunks (``final``: a row's last, whose sampled
        token is its first)."""
        P = eng.kv.block_size
        if not self.max_step_tokens and not self.prefilling[r]:   # (none left mid-prompt)
            return (slots, batch, [np.asarray(x.tokens_to_prefill()) for x in batch],
                    [int(eng.kv.held[s]) * P for s in slots], [True] * len(batch))
        rows = self.prefilling[r]
        for slot in [s for s, p in rows.items() if self.slots[r][s] is not p.live]:
            del rows[slot]   # preempted, cancelled or failed since
        for slot, live in zip(slots, batch):
            rows[slot] = Pending(live, slot, live.tokens_to_prefill(),
                                 int(eng.kv.held[slot]) * P,
                                 eng.context is not None
                                 or reads_prompt(live.sampling or eng.sampling))
        decode_rows = sum(x is not None for x in self._decoding(r))
        plan = plan_chunks(sorted(rows.values(), key=lambda p: p.live.admitted),
                           self.max_step_tokens - decode_rows, P)
        # each row's tokens up to the chunk's end, its positions before it already cached
        work = ([row.slot for row, _ in plan], [row.live for row, _ in plan],
                [np.asarray(row.tokens[:end]) for row, end in plan],
                [row.done for row, _ in plan], [end == len(row.tokens) for row, end in plan])
        self.stats["prefill_chunks"] += len(plan)
        for row, end in plan:
            row.done = end
            if end == len(row.tokens):
                del rows[row.slot]
        return work
