"""One replica's host side over its ``ModelRunner``: slots, block tables, buckets.

``Engine`` is a ``triax.inference.model_runner.ModelRunner`` (the device side: placed
weights, the KV pool's arrays, the jitted prefill, decode and mixed programs) plus this replica's
host state: ``max_batch`` decode slots, each slot's block table in the pool
(``triax.inference.kv_blocks``; a sequence takes blocks as it grows and gives them back when
``release``d), its length and token history. ``prefill`` writes prompts into chosen slots
and samples their first token; ``decode`` advances the live slots by one token; ``mixed``
does both in one program, for one prompt chunk beside the live slots. Shapes are
bucketed here (prompt length; prefill batch: one row per data shard × 2^k; decode: the live
rows, a power of two per row group), so each program compiles once per bucket, never per
request. Which request runs in which slot is ``triax.inference.scheduler``'s choice.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> eng = Engine.from_seed(config.TINY, make_mesh(tensor=2, devices=jax.devices()[:2]),
    ...                        seed=0, ecfg=EngineConfig(max_batch=2, max_len=32))
    >>> first = eng.prefill([0], [np.array([72, 105])], seeds=[0])     # slot 0 <- prompt
    >>> active = np.array([True, False])
    >>> nxt = eng.decode(np.array([int(first[0]), 0]), active, seeds=np.zeros(2))
    >>> eng.kv.in_use, int(eng.kv.tables[0, 0])       # one block of 16 positions
    (1, 0)
    >>> eng.release(0); eng.kv.in_use
    0
"""
from __future__ import annotations

import operator
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from triax.choices import SERVE_STRATEGY
from triax.inference.context_length import check_context, positions_needed
from triax.inference.errors import CacheFullError, InferenceError  # noqa: F401 (re-exported)
from triax.inference.kv_blocks import KVBlocks
from triax.inference.model_runner import (EngineConfig, ModelRunner,  # noqa: F401 (re-exported)
                                          held_bytes_per_device)
from triax.inference.penalties import TokenHistory
from triax.inference.sampling import SamplingConfig, draw_rows, draws, row_settings
from triax.models.config import ModelConfig
from triax.models.runtime import ExecConfig
from triax.sharding.rules import Strategy


class Engine(ModelRunner):
    """KV-cache generation for one model copy on ``mesh`` (see module docstring): the
    ``ModelRunner``'s programs, driven by this replica's host-side slot state."""

    def __init__(self, cfg: ModelConfig, params: Any, mesh: Mesh,
                 strategy: str | Strategy = SERVE_STRATEGY,
                 ecfg: EngineConfig = EngineConfig(), sampling: SamplingConfig = SamplingConfig(),
                 exe: ExecConfig = ExecConfig()):
        super().__init__(cfg, params, mesh, strategy, ecfg, sampling, exe)
        B = ecfg.max_batch
        # Prefix caching reads cached blocks into an unstriped scratch: not under context.
        self.prefix_cache = ecfg.prefix_cache and self.context is None
        self.kv = KVBlocks(self.pool.groups, self.pool.blocks, self.pool.block_size, B,
                           self.pool.max_blocks, self.prefix_cache)
        # each slot's adapter in a LoRA table, and each adapter slot's prefix-cache salt
        self.adapter_of = np.zeros(B, np.int32)
        self.adapter_keys = [b""] * ((cfg.lora.slots + 1) if self.table else 1)
        self.lengths = np.zeros(B, np.int64)  # tokens held in each slot's cache
        self.history = TokenHistory(B, ecfg.max_len)   # what each slot saw (penalties)
        self.speculator = None   # speculative decoding's steps (inference.speculative)

    def recover(self) -> None:
        """After a failed prefill or decode: a fresh cache if the failed program consumed
        the donated one (its slots' requests have failed; the server refills them)."""
        if self.fresh_cache():
            self.kv.forget_cached()   # the cached prefixes' blocks are zeros now

    # ---- host API ------------------------------------------------------------------------------
    def check_prompt(self, n_tokens: int, max_new_tokens: int) -> None:
        """Raise if a prompt of ``n_tokens`` cannot generate ``max_new_tokens`` here."""
        if n_tokens == 0:
            raise InferenceError("empty prompt: give at least one token (e.g. a BOS token)")
        if max_new_tokens < 1:
            raise InferenceError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        check_context(n_tokens, max_new_tokens, self.ecfg.max_len, self.cfg.max_seq_len)
        need = positions_needed(n_tokens, max_new_tokens)
        if self.kv.need(need) > self.kv.blocks:
            raise InferenceError(
                f"prompt of {n_tokens} tokens plus max_new_tokens={max_new_tokens} needs "
                f"{self.kv.need(need)} KV blocks of {self.kv.block_size} positions, and the "
                f"pool holds {self.kv.blocks} per row group; raise --kv-blocks or --kv-memory "
                f"(or shorten the request)")

    def check_token_ids(self, prompt: Sequence) -> list[int]:
        """The prompt as a list of ints; raise if an entry is not an integer id in the
        model's vocabulary (an embedding lookup would silently clamp it)."""
        out = []
        for i, t in enumerate(prompt):
            try:
                out.append(operator.index(t))
            except TypeError:
                raise InferenceError(f"prompt entry {i} is {t!r}, not an integer token id; "
                                     f"encode text with the model's tokenizer") from None
        V = self.cfg.vocab_size
        bad = [(i, t) for i, t in enumerate(out) if not 0 <= t < V]
        if bad:
            shown = ", ".join(f"{t} at position {i}" for i, t in bad[:4])
            raise InferenceError(f"prompt token id(s) outside the vocabulary [0, {V}): {shown}"
                                 f"{' ...' if len(bad) > 4 else ''}; encode with the model's "
                                 f"own tokenizer")
        return out

    def _bucket(self, n_tokens: int) -> int:
        T = next(b for b in self.ecfg.buckets() if b >= n_tokens)
        return T if self.context is None else self.context.length(T)   # splits over context

    def _prefill_batches(self) -> tuple[int, ...]:
        """Prefill batch buckets: one row per data shard (and micro-batch) times 2^k, capped
        at all slots (a few prompts run a few rows, not every slot's)."""
        b, out = self.sizes["data"] * (self.microbatches if self.pipelined else 1), []
        while b < self.ecfg.max_batch:
            out.append(b)
            b *= 2
        return tuple(out) + (self.ecfg.max_batch,)

    def _run_prefill(self, slots, prompts, seeds, b: int, T: int, settings=None,
                     with_logits=False, cached=None, prompt_lens=None, adapters=None,
                     padded=False, draw=False):
        """``cached``: each row's positions already in its blocks (whole cached blocks; the
        rest of its prompt computed); None: none cached (the plain program). ``padded``:
        the bucket's ``b`` rows come back, unsliced (``prefill``). ``draw``: run the draw
        program even if no row samples (the warm-up's)."""
        n, P = len(prompts), self.pool.block_size
        start = np.zeros(b, np.int32)
        if cached is not None:
            start[:n] = cached
        S = self._scratch_length(int(start.max()) + T) if cached is not None else 0
        width = max(self.pool.max_blocks, -(-(S or T) // P))
        table = np.full((b, width), self.pool.blocks, np.int32)  # no block
        tokens = np.zeros((b, T), np.int32)
        lengths = np.ones(b, np.int32)
        slot_arr = np.full(b, self.ecfg.max_batch, np.int32)  # out of range: write dropped
        seed_arr = np.zeros(b, np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p) - start[i]] = p[start[i]:]
            lengths[i] = len(p) - start[i]
        slot_arr[:n], seed_arr[:n] = list(slots), list(seeds)
        table[:n, :self.pool.max_blocks] = self.kv.tables[list(slots)]
        extra = ()
        if cached is not None:
            read = table[:, :self.pool.max_blocks].copy()
            for i in range(n):   # the cached blocks are read, never written
                table[i, :start[i] // P] = self.pool.blocks
            extra = (start, read)
        self.compiles["prefill"].add((b, T, S) if S else (b, T))   # S: a cached prefix's
        self.launches["prefill"] += 1
        ad = np.zeros(b, np.int32)
        ad[:n] = adapters if adapters is not None else 0
        rows = self._rows(b, settings, prompt_lens)
        self.cache, tok, logits = self._prefill_jit(
            self.params, self.cache, table, tokens, lengths, slot_arr, rows, S, *extra,
            **self._adapter_kw("adapters_b", ad))
        tok = self._sampled(tok, logits, seed_arr, start + lengths, rows, force=draw)
        out = (tok, logits[0])
        if n == 0:   # the warm-up's: a slice to no rows would be a program of its own
            return out
        if padded:
            return tuple(out) if with_logits else out[0]
        return tuple(jax.tree.map(lambda x: x[:n], x) for x in out) if with_logits else \
            jax.tree.map(lambda x: x[:n], out[0])

    def _scratch_length(self, n: int) -> int:
        """A cached prefix's scratch: a prompt bucket, or past ``max_len`` whole buckets."""
        if n <= self.ecfg.max_len:
            return self._bucket(n)
        return -(-n // self.ecfg.min_bucket) * self.ecfg.min_bucket

    def prefill(self, slots: Sequence[int], prompts: Sequence[np.ndarray],
                seeds: Sequence[int], settings: Optional[Sequence[SamplingConfig]] = None,
                with_logits: bool = False, cached: Optional[Sequence[int]] = None,
                prompt_lens: Optional[Sequence[int]] = None,
                adapters: Optional[Sequence[int]] = None, padded: bool = False):
        """Write ``prompts`` into ``slots``; return their first sampled tokens (async array).
        ``settings``: each prompt's sampling (temperature, top-k, top-p); default the engine's.
        ``with_logits``: return ``(tokens, logits)``, each prompt's ``[V]`` logits the
        token was drawn from (a program of its own: serving never moves them).
        A slot's sequence takes its prompt's blocks (from its reservation, ``kv.reserve``,
        else from the free ones); a sequence still in the slot ends first. ``cached``: the
        positions of each prompt its slot already holds in shared blocks (``kv.lookup``,
        reserved with ``kv.reserve(..., shared=)``): only the rest is computed.
        ``prompt_lens``: each row's request prompt (a resumed row's ``prompts`` hold what it
        generated too, which penalties count as output); default the whole row.
        ``adapters``: each prompt's adapter slot in the LoRA table (default 0: none); its
        rows keep it while they decode. ``padded``: return the batch bucket's rows, the
        prompts' first and then padding, as the program gives them (the server reads the
        first rows on the host; slicing on the device compiles a program per bucket and
        number of prompts)."""
        lens = [len(p) for p in prompts]
        cached = list(cached) if cached is not None and any(cached) else None
        prompt_lens, adapters = self._start_prompts(slots, prompts, cached, prompt_lens,
                                                    adapters)
        b = next(b for b in self._prefill_batches() if b >= len(prompts))
        T = self._bucket(max(n - c for n, c in zip(lens, cached or [0] * len(lens))))
        out = self._run_prefill(slots, prompts, seeds, b, T, settings, with_logits, cached,
                                prompt_lens, adapters, padded)
        self._prompts_written(slots, prompts, adapters)
        return out

    def _start_prompts(self, slots, prompts, cached, prompt_lens, adapters):
        """A prefill's host side before it runs: each slot's blocks, history and adapter;
        ``(prompt_lens, adapters)`` defaulted."""
        lens = [len(p) for p in prompts]
        for n in lens:
            self.check_prompt(n, 1)
        for i, (s, n) in enumerate(zip(slots, lens)):
            if self.kv.held[s] and not (cached and cached[i]):
                self.release(s)
            self.kv.grow(s, n)
        prompt_lens = list(prompt_lens) if prompt_lens is not None else lens
        for s, p, k in zip(slots, prompts, prompt_lens):
            self.history.start(s, p, k)
        adapters = [0] * len(slots) if adapters is None else list(adapters)
        self.adapter_of[list(slots)] = adapters
        return prompt_lens, adapters

    def _prompts_written(self, slots, prompts, adapters) -> None:
        """After a prefill: the slots' lengths, and their full blocks in the prefix cache."""
        self.lengths[list(slots)] = [len(p) for p in prompts]
        for s, p, a in zip(slots, prompts, adapters):
            self.kv.register(s, p, self.adapter_keys[a])

    def warmup(self, prompt_lengths: Sequence[int],
               progress: Optional[Callable[[str], None]] = None, mixed_tokens: int = 0,
               sampled: bool = True) -> None:
        """Compile prefill (every batch bucket × the needed length buckets) and decode ahead
        of serving, so served timings exclude compilation; with ``mixed_tokens`` (a chunked
        server's ``max_step_tokens``) the mixed steps too, every decode bucket × the chunk
        buckets up to it; with ``sampled`` (requests that may sample) the draw program of
        every row count too. Call it with no live slots (its rows are all padding: nothing
        is written). ``progress(line)`` hears each program compiled: which bucket, k of n,
        and its seconds."""
        B = self.ecfg.max_batch
        zeros = np.zeros(B, np.int32)
        runs = [(f"prefill {b} rows × {T} tokens",   # every row dropped: cache unchanged
                 lambda b=b, T=T: self._run_prefill([], [], [], b, T, draw=sampled))
                for T in sorted({self._bucket(n) for n in prompt_lengths})
                for b in self._prefill_batches()]
        runs += [(f"decode {self.pool.groups * k} rows",   # every row padding: nothing written
                  lambda k=k: self._run_decode(np.full(self.pool.groups * k, B), zeros, zeros,
                                               zeros, None, draw=sampled))
                 for k in self._decode_buckets()]
        if mixed_tokens and self.mixes:   # a chunk is at most the budget, or one block
            longest = self._bucket(min(max(mixed_tokens, self.pool.block_size),
                                       self.ecfg.max_len))
            none = np.full((1, self.pool.max_blocks), self.pool.blocks, np.int32)
            one = np.zeros(1, np.int32)
            runs += [(f"mixed {k} rows + {C} tokens",   # no rows, an empty chunk: no writes
                      lambda k=k, C=C: self._run_decode(
                          np.full(k, B), zeros, zeros, zeros, None, chunk=(
                              none, np.zeros((1, C), np.int32), one, one,
                              self._rows(1, None)), draw=sampled))
                     for C in self.ecfg.buckets() if C <= longest
                     for k in self._decode_buckets()]
        for i, (what, run) in enumerate(runs, 1):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            if progress is not None:
                progress(f"compiled {what} ({i}/{len(runs)}) in "
                         f"{time.perf_counter() - t0:.1f} s")
        if self.speculator is not None:   # its verify (and draft) programs too
            self.speculator.warmup(prompt_lengths, progress, sampled)

    def _decode_buckets(self) -> tuple[int, ...]:
        """Rows per row group a decode step may run: powers of two, capped at its slots."""
        per = self.ecfg.max_batch // self.pool.groups
        return tuple(sorted({min(per, 1 << i) for i in range(per.bit_length() + 1)}))

    def _decode_rows(self, active: np.ndarray) -> np.ndarray:
        """The slots a step runs, group by group: each row group's live slots, padded with
        ``max_batch`` (no slot) to the same bucket, so a row stays in its group's blocks."""
        B, G = self.ecfg.max_batch, self.pool.groups
        live = [np.flatnonzero(a) + g * (B // G) for g, a in enumerate(np.split(active, G))]
        k = next(b for b in self._decode_buckets() if b >= max(map(len, live)))
        rows = np.full((G, k), B)
        for g, x in enumerate(live):
            rows[g, :len(x)] = x
        return rows.reshape(-1)

    def _run_decode(self, rows, tokens, positions, seeds, settings, with_logits=False,
                    chunk=None, chunk_seed=0, draw=False):
        """``chunk``: the mixed step's chunk arguments (``ModelRunner._mixed``), drawn with
        ``chunk_seed``; ``draw``: run the draw programs even if no row samples (the
        warm-up's)."""
        B = self.ecfg.max_batch
        real = rows < B
        s = np.where(real, rows, 0)
        pick = lambda a: np.where(real, np.asarray(a)[s], 0).astype(np.int32)  # noqa: E731
        table = np.where(real[:, None], self.kv.tables[s], self.pool.blocks).astype(np.int32)
        given = list(settings) if settings else [self.sampling] * B
        configs = [given[i] if r else self.sampling for i, r in zip(s, real)]
        settings_B = self.history.seen_rows(
            row_settings(configs, self.history.generated(s, real)), s, real)
        slots_B = rows.astype(np.int32)
        args = (self.params, self.cache, table, pick(tokens), pick(positions), settings_B,
                slots_B)
        seeds_B, next_B = pick(seeds), pick(positions) + 1   # each row's key: its next position
        if chunk is not None:
            self.compiles["mixed"].add((*rows.shape, chunk[1].shape[1]))
            self.launches["mixed"] += 1
            self.cache, tok, first, logits, first_logits = self._mixed_jit(*args, *chunk)
            _, _, start_1, length_1, chunk_rows = chunk
            return (self._sampled(tok, logits, seeds_B, next_B, settings_B, slots_B, draw),
                    self._sampled(first, first_logits, [chunk_seed], start_1 + length_1,
                                  chunk_rows, force=draw))
        self.compiles["decode"].add(rows.shape)
        self.launches["decode"] += 1
        self.cache, tok, logits = self._decode_jit(
            *args, **self._adapter_kw("adapters_B", np.where(real, self.adapter_of[s], 0)))
        tok = self._sampled(tok, logits, seeds_B, next_B, settings_B, slots_B, draw)
        if not with_logits:
            return tok
        by_slot = np.zeros((B, logits[0].shape[-1]), logits[0].dtype)   # as the tokens are
        by_slot[s[real]] = np.asarray(logits[0])[real]
        return tok, by_slot

    def _sampled(self, tok, logits, seeds, positions, rows, slots=None, force=False):
        """A step's tokens: its own (greedy), or, where a row samples (or ``force``), the
        draw program's from its ``logits`` (``sampling.draw``; one per row count, compiled
        by the warm-up), with ``slots`` put in them (``_to_slots``: the draw itself is a
        prefill's of as many rows). The step's prompt log-probabilities stay."""
        if not (force or draws(rows)):
            return tok
        self.compiles["draw"].add(len(seeds))
        self.launches["draw"] += 1
        drawn = self._draw_jit(logits, self.sampling_seed(), np.asarray(seeds, np.int32),
                               np.asarray(positions, np.int32), draw_rows(rows))
        if slots is not None:
            drawn = self._to_slots_jit(drawn, slots)
        if isinstance(tok, dict):
            return {**tok, **(drawn if isinstance(drawn, dict) else {"token": drawn})}
        return drawn

    def decode(self, tokens: np.ndarray, active: np.ndarray, seeds: np.ndarray,
               settings: Optional[Sequence[SamplingConfig]] = None, with_logits: bool = False):
        """Feed one token per slot (``active`` rows advance); return the next tokens (one per
        slot; only the active ones mean anything). Only the active rows run: a bucket of
        them per row group (``_decode_rows``; one compile per bucket). ``settings``: one
        ``SamplingConfig`` per slot (default: the engine's for all). ``with_logits``: return
        ``(tokens, logits)``, the ``[slots, V]`` logits each token was drawn from."""
        positions = self._start_decode(tokens, active)
        out = self._run_decode(self._decode_rows(np.asarray(active, bool)), tokens, positions,
                               seeds, settings, with_logits)
        self.lengths[active] += 1
        return out

    def _start_decode(self, tokens: np.ndarray, active: np.ndarray) -> np.ndarray:
        """A decode's host side before it runs: each active slot's next block and history;
        every slot's position (its length)."""
        full = active & (self.lengths >= self.ecfg.max_len)
        if full.any():
            raise CacheFullError(
                f"KV cache full for slot(s) {np.flatnonzero(full).tolist()}: all "
                f"{self.ecfg.max_len} positions used; finish or free the slot, or raise max_len")
        for s in np.flatnonzero(active):   # the new token's position needs its block
            self.kv.grow(int(s), int(self.lengths[s]) + 1)
        self.history.feed(np.flatnonzero(active), tokens)
        return np.minimum(self.lengths, self.ecfg.max_len - 1).astype(np.int32)

    def mixed(self, tokens: np.ndarray, active: np.ndarray, seeds: np.ndarray,
              settings: Optional[Sequence[SamplingConfig]], slot: int, prompt: np.ndarray,
              cached: int, seed: int, setting: Optional[SamplingConfig] = None):
        """``decode(tokens, active, seeds, settings)`` and ``prefill([slot], [prompt],
        [seed], [setting], cached=[cached])`` in one program (``ModelRunner._mixed``; the
        replica must ``mixes``): ``(tokens by slot, the prompt's first token)``, the first
        meaningful only when ``prompt`` is whole (a chunk's end: its next chunk extends it).
        The chunk is ``prompt[cached:]``, padded to a prompt bucket (the padding writes
        nothing); ``cached`` is a whole number of blocks the slot holds already. Tokens
        equal the two programs' (seeded by position)."""
        if not self.mixes:
            raise InferenceError("a mixed step needs one row group, no pipe or context split "
                                 "and no LoRA table; run prefill and decode")
        if active[slot] or cached % self.pool.block_size:
            raise InferenceError(f"mixed step: slot {slot} must not decode, and its cached "
                                 f"positions ({cached}) be whole blocks")
        self._start_prompts([slot], [prompt], [cached] if cached else None, None, None)
        positions = self._start_decode(tokens, active)
        rows = self._decode_rows(np.asarray(active, bool))
        n = len(prompt) - cached
        C = self._bucket(n)
        chunk = np.zeros((1, C), np.int32)
        chunk[0, :n] = prompt[cached:]
        out = self._run_decode(rows, tokens, positions, seeds, settings, chunk=(
            self.kv.tables[slot][None], chunk, np.array([cached], np.int32),
            np.array([n], np.int32), self._rows(1, [setting or self.sampling])),
            chunk_seed=seed)
        self.lengths[active] += 1
        self._prompts_written([slot], [prompt], [0])
        return out

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` ended: its blocks go back to the pool."""
        self.kv.release(slot)
        self.lengths[slot] = 0
