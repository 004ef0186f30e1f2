"""Speculative decoding for one engine: propose ``k`` tokens per row, verify them all in one
forward pass of the target over ``k + 1`` positions, keep the accepted ones.

A row whose cache holds ``L`` positions and whose last token is ``t`` is fed ``t, d_1..d_n``
at positions ``L..L+n`` (``n <= k`` proposals: the proposer's, capped by the row's
remaining ``max_tokens``, its ``max_len`` and the blocks its group has free), like a small
prefill against the paged cache; the acceptance rule (``inference.rejection``) keeps
``a <= n`` of them and draws one more token, so a step emits ``a + 1`` tokens per row.
**Rollback**: K/V are written for all ``n + 1`` positions, but the row's length advances by
``a + 1`` only; the rejected positions are overwritten by the next step before any query
can see them (``models.decode``), and the blocks taken for them past the new length go back
to the pool (``KVBlocks.shrink``). Positions past ``n`` (a row with fewer proposals than the
batch's ``k``) go to a **sink**: one more table column naming no block, so their writes are
dropped. Prefix caching keys blocks only from prompts (``KVBlocks.register``), never from a
step's proposals.

Proposers: ``ngram`` (prompt lookup, ``inference.ngram_proposer``) and ``draft`` (a small
model with its own paged cache on the same mesh, ``inference.draft_proposer``). Rows whose
sampling reads the tokens seen (penalties, ``logit_bias``, ``min_tokens``, a grammar), and rows
served with a LoRA adapter of a table (``inference.adapter_table``), are not speculated: a
step with one of them live is a plain decode step (``Speculator.usable``).

Exactness (``tests/test_speculative.py``): greedy rows emit plain decoding's tokens; sampled
rows emit them too under ``ngram`` (the coupled rule draws with plain decoding's keys) and
the target's distribution under ``draft`` (the rejection rule); stop tokens, ``max_tokens``,
log-probabilities and cancellation act on the emitted tokens one by one, in order.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from triax.inference.errors import CacheFullError, InferenceError
from triax.inference.logprobs import row_entry, scatter_rows, with_logprobs
from triax.inference.rejection import (coupled_accept, probabilities, per_position,
                                       rejection_accept, target_draws)
from triax.inference.sampling import SamplingConfig, draws, row_settings
from triax.models import runtime

METHODS = ("ngram", "draft")


@dataclass(frozen=True)
class SpeculativeConfig:
    """``method``: ``ngram`` or ``draft``; ``k``: proposals per row and step; ``draft_model``
    (``draft``): a preset, a training checkpoint or a Hugging Face directory."""

    method: str = "ngram"
    k: int = 4
    draft_model: Optional[str] = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise InferenceError(f"--speculative {self.method!r}: choose one of "
                                 f"{', '.join(METHODS)}")
        if self.k < 1:
            raise InferenceError(f"--num-speculative-tokens {self.k}: give at least 1")
        if (self.method == "draft") != (self.draft_model is not None):
            raise InferenceError("--speculative draft needs --draft-model (a preset, "
                                 "checkpoint or Hugging Face directory), and only it takes one")


def _stacked(x):
    """A draft's proposals (or distributions), one array per step, stacked on axis 1."""
    return jnp.stack(x, 1) if isinstance(x, tuple) else x


def usable(config: SamplingConfig) -> bool:
    """Whether a row with these settings may be speculated: its draw reads nothing but its
    logits (no penalties, bias, ``min_tokens`` or grammar, which read the tokens seen)."""
    return (config.presence_penalty == 0 and config.frequency_penalty == 0
            and config.repetition_penalty == 1 and not config.logit_bias
            and not config.min_tokens and config.constraint is None)


def sink_table(tables_RM, real_R, blocks: int) -> np.ndarray:
    """Each row's block table with one more column naming no block (padding rows: all)."""
    t = np.where(real_R[:, None], tables_RM, blocks)
    return np.concatenate([t, np.full((len(t), 1), blocks)], axis=1).astype(np.int32)


def extend_forward(eng, params, cache, table_RM, tokens_RT, positions_RT):
    """The target's (or a draft's) forward over ``T`` tokens per row at ``positions_RT``
    against its paged cache: ``(logits_RTV, cache)``."""
    paged = {**cache, "table": jnp.broadcast_to(table_RM, (eng.cfg.num_layers,
                                                           *table_RM.shape))}
    with runtime.using(moe_inference=True):
        logits_RTV, paged = eng._fwd(params, tokens_RT, positions_RT, paged)
    return logits_RTV, jax.lax.with_sharding_constraint({n: paged[n] for n in cache},
                                                        eng._cache_shardings())


@dataclass
class Round:
    """One launched step: its rows (slots; ``max_batch`` pads), what each row was given
    and the device outputs, read by ``Speculator.collect``."""

    rows: np.ndarray
    real: np.ndarray
    lengths: np.ndarray   # per slot, before the step
    counts: np.ndarray    # proposals verified, per slot
    last: np.ndarray      # each slot's last token (fed first)
    out: dict


class Speculator:
    """Speculative decoding steps for one engine (``Engine.speculator``): ``launch`` runs a
    step's programs asynchronously, ``collect`` reads the tokens and advances the rows."""

    def __init__(self, engine, config: SpeculativeConfig, proposer):
        self.engine, self.config, self.k, self.proposer = engine, config, config.k, proposer
        # The verify step takes each row's longest run of the target's argmaxes; where a row
        # samples, the acceptance program (``_accept``: the rejection rule, or the target's
        # own draws) runs on its logits: the verify step holds no sort, softmax or hashes.
        self._verify_jit = jax.jit(self._verify, donate_argnums=(1,))
        self._accept_jit = jax.jit(self._accept)
        self.stats = {"rounds": 0, "proposed": 0, "accepted": 0}

    def usable(self, settings: Sequence[SamplingConfig], active) -> bool:
        """Whether this step may speculate: every active row's sampling allows it
        (``usable``) and none runs a LoRA adapter of a table (the verify pass does not apply
        per-row adapters)."""
        rows = np.flatnonzero(active)
        if getattr(self.engine, "table", False) and self.engine.adapter_of[rows].any():
            return False
        return all(usable(settings[i]) for i in rows)

    # ---- traced --------------------------------------------------------------------------
    def _verify(self, params, cache, table_RM, last_R, positions_RT, n_R, drafts_RK, rows,
                slots_R):
        """The target's forward over each row's last token and proposals; the greedy rows'
        tokens (each proposal kept while it is the target's argmax: what the rejection rule
        gives a point-mass target and draft), and the logits ``_accept`` reads."""
        drafts_RK = _stacked(drafts_RK)
        tokens_RT = jnp.concatenate([last_R[:, None], drafts_RK], axis=1)   # t, d_1..d_k
        logits_RTV, cache = extend_forward(self.engine, params, cache, table_RM, tokens_RT,
                                           positions_RT)
        logits_RTV = logits_RTV.astype(jnp.float32)
        a_R, tok_RT = coupled_accept(jnp.argmax(logits_RTV, -1).astype(jnp.int32), drafts_RK,
                                     n_R)
        return cache, self._out(logits_RTV, a_R, tok_RT, rows, slots_R), logits_RTV

    def _accept(self, logits_RTV, drafts_RK, q_RKV, n_R, seeds_R, base_R, seed, rows, slots_R):
        """Each row's accepted proposals and tokens by its own sampling, from the verify
        step's logits: the rejection rule against the draft's distributions ``q_RKV``, or
        for point-mass proposals (None) the target's own draws."""
        drafts_RK = _stacked(drafts_RK)
        R, T, V = logits_RTV.shape
        if q_RKV is None:   # point-mass proposals
            a_R, tok_RT = coupled_accept(target_draws(logits_RTV, seed, seeds_R, base_R, rows),
                                         drafts_RK, n_R)
        else:
            q = probabilities(_stacked(q_RKV).reshape(R * (T - 1), V),
                              per_position(rows, T - 1))
            a_R, tok_RT = rejection_accept(logits_RTV, drafts_RK, q.reshape(R, T - 1, V), n_R,
                                           seed, seeds_R, base_R, rows)
        return self._out(logits_RTV, a_R, tok_RT, rows, slots_R)

    def _out(self, logits_RTV, a_R, tok_RT, rows, slots_R):
        R, T, V = logits_RTV.shape
        out = {"token": tok_RT, "accepted": a_R}
        if "logprobs" in rows:   # the model's own, at every position (raw logits)
            lp = with_logprobs(logits_RTV.reshape(R * T, V), tok_RT.reshape(-1),
                               {"logprobs": None})
            out.update({k: v.reshape(R, T, *v.shape[1:]) for k, v in lp.items()
                        if k != "token"})
        return scatter_rows(out, slots_R, self.engine.ecfg.max_batch)

    # ---- host --------------------------------------------------------------------------
    def _counts(self, slots, wanted, budgets) -> np.ndarray:
        """Proposals each slot verifies: the proposer's, capped by its remaining tokens,
        ``max_len`` and the free blocks of its group (taken here)."""
        eng = self.engine
        n = np.zeros(eng.ecfg.max_batch, np.int64)
        for s in slots:
            L = int(eng.lengths[s])
            if L >= eng.ecfg.max_len:
                raise CacheFullError(f"KV cache full for slot {s}: all {eng.ecfg.max_len} "
                                     f"positions used; finish or free the slot, or raise "
                                     f"max_len")
            c = int(min(wanted[s], budgets[s] - 1, eng.ecfg.max_len - 1 - L))
            while c > 0 and (eng.kv.need(L + c + 1) - max(int(eng.kv.held[s]),
                                                          int(eng.kv.reserved[s]))
                             > eng.kv.available(s)):
                c -= 1
            n[s] = max(c, 0)
            eng.kv.grow(s, L + n[s] + 1)
        return n

    def launch(self, last, active, seeds, settings, contexts, budgets, owners=None,
               rows=None, draw=False) -> Round:
        """Start one step for the ``active`` slots: ``last`` their last tokens, ``contexts``
        each one's tokens so far (prompt and generated, ``last`` at the end), ``budgets``
        the tokens each may still emit, ``owners`` what holds each slot (a draft proposer
        re-syncs a slot whose owner changed). ``rows``: the step's row layout (default the
        engine's decode buckets of the active slots). ``draw``: run the acceptance program
        even if no row samples (the warm-up's)."""
        eng, K = self.engine, self.k
        B, N, P = eng.ecfg.max_batch, eng.pool.blocks, eng.pool.block_size
        active = np.asarray(active, bool)
        slots = np.flatnonzero(active)
        rows = eng._decode_rows(active) if rows is None else rows
        real = rows < B
        s = np.where(real, rows, 0)
        lengths = eng.lengths.copy()
        wanted = np.full(B, K)
        drafts = np.zeros((B, K), np.int32)
        if self.proposer.host_side:
            got, cnt = self.proposer.propose([contexts[i] if active[i] else None
                                              for i in range(B)], K)
            drafts, wanted = got, cnt
        counts = self._counts(slots, wanted, budgets)
        n_R = np.where(real, counts[s], 0).astype(np.int32)
        L_R = np.where(real, lengths[s], 0).astype(np.int32)
        given = [settings[i] if r else eng.sampling for i, r in zip(s, real)]
        row_arrays = row_settings(given)
        seeds_R = np.where(real, np.asarray(seeds)[s], 0).astype(np.int32)
        table = sink_table(eng.kv.tables[s], real, N)
        sink = (table.shape[1] - 1) * P   # the sink column's first position
        i = np.arange(K + 1)[None]
        ok = i <= n_R[:, None]
        positions = np.where(ok, L_R[:, None] + i, sink).astype(np.int32)
        last_R = np.where(real, np.asarray(last)[s], 0).astype(np.int32)
        seed = eng.sampling_seed()
        if self.proposer.host_side:
            d_RK = np.where(real[:, None], drafts[s], 0).astype(np.int32)
            q = None
        else:
            d_RK, q = self.proposer.propose_device(K, rows, real, L_R, n_R, last_R, contexts,
                                                   owners, seeds_R, seed, row_arrays)
        eng.compiles.setdefault("verify", set()).add(rows.shape)
        slots_R = rows.astype(np.int32)
        eng.cache, out, logits = self._verify_jit(eng.params, eng.cache, table, last_R,
                                                  positions, n_R, d_RK, row_arrays, slots_R)
        if draw or draws(row_arrays):
            eng.compiles.setdefault("accept", set()).add(rows.shape)
            eng.launches["accept"] = eng.launches.get("accept", 0) + 1
            out = self._accept_jit(logits, d_RK, q, n_R, seeds_R, L_R, seed, row_arrays,
                                   slots_R)
        return Round(rows, real, lengths, counts, np.asarray(last), out)

    def warmup(self, prompt_lengths, progress=None, sampled: bool = True) -> None:
        """Compile the verify step (with ``sampled``, its acceptance program too; and a
        draft's programs) for every decode bucket, on rows that are all padding (nothing is
        written), so served timings exclude compilation."""
        eng = self.engine
        B = eng.ecfg.max_batch
        if not self.proposer.host_side:
            self.proposer.engine.warmup(prompt_lengths, sampled=sampled)
        for k in eng._decode_buckets():
            t0 = time.perf_counter()
            rnd = self.launch(np.zeros(B, np.int32), np.zeros(B, bool), np.zeros(B, np.int32),
                              [eng.sampling] * B, [None] * B, [0] * B, [None] * B,
                              rows=np.full(eng.pool.groups * k, B), draw=sampled)
            jax.block_until_ready(rnd.out)
            if progress is not None:
                progress(f"compiled speculative verify {eng.pool.groups * k} rows × "
                         f"{self.k + 1} positions in {time.perf_counter() - t0:.1f} s")

    def collect(self, rnd: Round) -> dict[int, tuple[list[int], list]]:
        """Read a launched step: advance each row by its accepted tokens (rolling back the
        rest: lengths, blocks, the draft's cache) and return ``{slot: (tokens, entries)}``,
        ``entries`` each token's log-probabilities (``logprobs.row_entry``; None: not
        asked)."""
        eng = self.engine
        out = {k: np.asarray(v) for k, v in rnd.out.items()}
        tok, acc = out.pop("token"), out.pop("accepted")
        result = {}
        for s in rnd.rows[rnd.real].tolist():
            a, L = int(acc[s]), int(rnd.lengths[s])
            fed = np.zeros(eng.ecfg.max_batch, np.int32)
            for t in [rnd.last[s], *tok[s, :a].tolist()]:   # what the cache now holds
                fed[s] = t
                eng.history.feed([s], fed)
            eng.lengths[s] = L + a + 1
            eng.kv.shrink(s, L + a + 1)
            self.stats["rounds"] += 1
            self.stats["proposed"] += int(rnd.counts[s])
            self.stats["accepted"] += a
            entries = [row_entry({k: v[:, j] for k, v in out.items()}, s) if out else None
                       for j in range(a + 1)]
            result[s] = (tok[s, :a + 1].tolist(), entries)
        if not self.proposer.host_side:
            self.proposer.rolled_back(rnd, acc)
        return result


def spec_launch(spec: Speculator, live, last, seeds, settings) -> Round:
    """``Speculator.launch`` for a replica's slots as the server holds them (``live``: each
    slot's request record or None)."""
    active = np.array([x is not None for x in live])
    return spec.launch(last, active, seeds, settings,
                       [x.tokens_to_prefill() if x else None for x in live],
                       [x.max_new - len(x.result.tokens) if x else 0 for x in live],
                       [(x.result.request_id, x.result.preemptions) if x else None
                        for x in live])


def attach(engines, config: SpeculativeConfig, draft=None) -> None:
    """Give each engine a ``Speculator`` for ``config``; ``draft(engine)``: the draft
    proposer of one engine (``inference.draft_proposer.draft_for``), for ``draft``."""
    from triax.inference.ngram_proposer import NgramProposer
    for eng in engines:
        if config.method == "draft" and draft is None:
            raise InferenceError("--speculative draft: no draft model was loaded; give "
                                 "--draft-model")
        proposer = NgramProposer() if config.method == "ngram" else draft(eng)
        eng.speculator = Speculator(eng, config, proposer)
