"""One model copy on one (sub-)mesh: a sharded, paged KV cache, jitted prefill and decode.

The engine owns ``max_batch`` decode slots and one pool of KV blocks
(``triax.inference.kv_pool``); each slot's sequence holds a block table
(``triax.inference.kv_blocks``), takes blocks as it grows, and gives them back when
``release``d. ``prefill`` writes prompts into chosen slots
and samples their first token; ``decode`` advances the live slots by one token. Shapes
are bucketed (prompt length; prefill batch: one row per data shard × 2^k; decode: the live
rows, a power of two per row group), so each compiles once per bucket, never per request.
``pipe > 1`` decodes through the pipeline (``triax.inference.forward``). On a mesh with a
``context`` axis (and no ``pipe``) the cache is split along its positions and the prompt
along its tokens (``triax.sharding.context_cache``), each block's positions striped over it.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> eng = Engine.from_seed(config.TINY, make_mesh(tensor=-1), seed=0,
    ...                        ecfg=EngineConfig(max_batch=2, max_len=32))
    >>> first = eng.prefill([0], [np.array([72, 105])], seeds=[0])     # slot 0 <- prompt
    >>> active = np.array([True, False])
    >>> nxt = eng.decode(np.array([int(first[0]), 0]), active, seeds=np.zeros(2))
    >>> eng.kv.in_use, int(eng.kv.tables[0, 0])       # one block of 16 positions
    (1, 0)
    >>> eng.release(0); eng.kv.in_use
    0
"""
from __future__ import annotations

import dataclasses
import math
import operator
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from triax import choices
from triax.inference.context_length import check_context, positions_needed
from triax.inference.errors import CacheFullError, InferenceError  # noqa: F401 (re-exported)
from triax.inference.forward import check_pipeline, pipelined_forward, plain_forward
from triax.inference.kv_blocks import KVBlocks
from triax.inference.kv_pool import (decode_microbatches, kv_pool, kv_storage_dtype,
                                     scratch_layout, split_context)
from triax.inference.logprobs import prompt_logprobs, scatter_rows
from triax.inference.penalties import TokenHistory
from triax.inference.sampling import SamplingConfig, row_settings, sample_step
from triax.inference.served_weights import place_params, served_dtype
from triax.mesh.build import mesh_sizes
from triax.models.config import ModelConfig
from triax.models.quantize import served_config
from triax.models.decode import read_prefix, write_scratch
from triax.models.runtime import ExecConfig
from triax.models import runtime
from triax.sharding.partition import abstract_model, init_params, param_shardings
from triax.sharding.rules import Strategy, get_strategy
from triax.choices import SERVE_STRATEGY, SLOTS


@dataclass(frozen=True)
class EngineConfig:
    """Static serving shapes: decode slots, a sequence's longest, prompt buckets,
    micro-batches, the KV pool's size (``inference.kv_pool.kv_pool``), and the dtypes of
    the served weights (``dtype``: their floating leaves are cast to it, and it is the
    compute dtype) and of the pool (``kv_dtype``; ``auto``: ``dtype``'s). fp32 here, the
    exact reference; ``triax serve`` defaults to ``choices.SERVE_DTYPE``."""

    max_batch: int = SLOTS
    max_len: int = 128           # positions a sequence may hold (prompt + generated tokens)
    min_bucket: int = 16         # prompt buckets: min_bucket·2^k, capped at max_len
    microbatches: int = 0        # pipeline decode; 0: default_decode_microbatches(pipe)
    kv_blocks: int = 0           # pool blocks (all row groups); 0: from kv_memory, or
    kv_memory: int = 0           # pool bytes per device; both 0: max_batch × max_len's
    block_size: int = choices.KV_BLOCK_SIZE   # positions per block
    dtype: str = "float32"       # served weights and compute: float32 | bfloat16
    kv_dtype: str = "auto"       # the pool: auto | float32 | bfloat16 | int8
    prefix_cache: bool = False   # share cached prompt blocks (inference.prefix_cache)
    quantize: str = "none"       # none | int8: the block projections (models.quantize)

    def __post_init__(self):
        kv_storage_dtype(self.dtype, self.kv_dtype)   # names the flag and the choices
        choices.check("quantize", self.quantize, choices.QUANTIZE)

    @property
    def cache_dtype(self) -> str:
        """What the KV pool stores (``kv_dtype`` resolved)."""
        return kv_storage_dtype(self.dtype, self.kv_dtype)

    def buckets(self) -> tuple[int, ...]:
        out, b = [], self.min_bucket
        while b < self.max_len:
            out.append(b)
            b *= 2
        return tuple(out) + (self.max_len,)


def held_bytes_per_device(cfg: ModelConfig, mesh: Mesh, strategy: str | Strategy,
                          ecfg: EngineConfig) -> dict[str, int]:
    """What an engine would hold on each device, known before it allocates anything: its
    shard of the weights and of the KV cache (k and v)."""
    st = get_strategy(strategy)
    am = abstract_model(served_config(cfg, ecfg.quantize))
    weights = sum(math.prod(sh.shard_shape(s.shape)) * served_dtype(s.dtype, ecfg.dtype).itemsize
                  for s, sh in zip(jax.tree.leaves(am.shapes),
                                   jax.tree.leaves(param_shardings(am, mesh, st))))
    return {"weights": weights, "KV cache": kv_pool(cfg, mesh, st, ecfg).bytes_per_device()}


class Engine:
    """KV-cache generation for one model copy on ``mesh`` (see module docstring)."""

    def __init__(self, cfg: ModelConfig, params: Any, mesh: Mesh,
                 strategy: str | Strategy = SERVE_STRATEGY,
                 ecfg: EngineConfig = EngineConfig(), sampling: SamplingConfig = SamplingConfig(),
                 exe: ExecConfig = ExecConfig()):
        if ecfg.max_len > cfg.max_seq_len:
            raise InferenceError(f"cache length max_len={ecfg.max_len} exceeds the model's "
                                 f"context max_seq_len={cfg.max_seq_len}; lower max_len")
        given_cfg, cfg = cfg, served_config(cfg, ecfg.quantize)   # --quantize: int8 projections
        self.cfg, self.mesh, self.strategy = cfg, mesh, get_strategy(strategy)
        self.ecfg, self.sampling = ecfg, sampling
        self.exe = exe = dataclasses.replace(exe, compute_dtype=ecfg.dtype)
        self.sizes = mesh_sizes(mesh)
        self.am = abstract_model(cfg)
        self.param_shardings = param_shardings(self.am, mesh, self.strategy)
        # params=None: an abstract engine (ShapeDtypeStructs, nothing allocated), for
        # ahead-of-time compiles of its programs (``lower_decode``; --plan auto).
        self.abstract = params is None
        self.params = jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, served_dtype(s.dtype, ecfg.dtype),
                                               sharding=sh),
            self.am.shapes, self.param_shardings) if self.abstract \
            else place_params(params, given_cfg, self.am, mesh, self.strategy, ecfg.dtype,
                              self.param_shardings)
        B = ecfg.max_batch
        self.pipelined = self.sizes["pipe"] > 1
        self.microbatches = decode_microbatches(mesh, ecfg.microbatches)
        self.context = split_context(mesh, self.strategy)
        if self.pipelined:
            check_pipeline(self.am, mesh, B, self.microbatches)
            self._fwd = pipelined_forward(self.am, mesh, self.strategy, exe, self.microbatches)
        else:
            self._fwd = plain_forward(self.am, mesh, self.strategy, exe,
                                      self.context and self.context.attention_hook())
        if B % self.sizes["data"]:
            raise InferenceError(f"max_batch={B} decode slots must divide over "
                                 f"data={self.sizes['data']}; choose a multiple")
        self.pool = kv_pool(cfg, mesh, self.strategy, ecfg)
        self.cache_sharding = self.pool.sharding
        # Prefix caching reads cached blocks into an unstriped scratch: not under context.
        self.prefix_cache = ecfg.prefix_cache and self.context is None
        self.kv = KVBlocks(self.pool.groups, self.pool.blocks, self.pool.block_size, B,
                           self.pool.max_blocks, self.prefix_cache)
        # A LoRA table (many adapters, inference.adapter_table): each slot's adapter, and
        # each adapter slot's prefix-cache salt.
        self.table = cfg.lora is not None and cfg.lora.slots > 0
        self.adapter_of = np.zeros(B, np.int32)
        self.adapter_keys = [b""] * ((cfg.lora.slots + 1) if self.table else 1)
        if self.table and (self.pipelined or self.context is not None):
            raise InferenceError("many adapters (--adapter NAME=DIR) are served on tensor "
                                 "and data layouts; drop pipe and context from --mesh")
        self.cache = self._abstract_cache() if self.abstract else self._zeros_cache()
        self.lengths = np.zeros(B, np.int64)  # tokens held in each slot's cache
        self.history = TokenHistory(B, ecfg.max_len)   # what each slot saw (penalties)
        # The sampling rule is static (a new rule compiles anew); stop tokens are host-side.
        self._prefill_jit = jax.jit(self._prefill, donate_argnums=(1,),
                                    static_argnums=(7, 9, 10))
        self._decode_jit = jax.jit(self._decode, donate_argnums=(1,), static_argnums=(6, 9))
        self.compiles = {"prefill": set(), "decode": set()}
        self.speculator = None   # speculative decoding's steps (inference.speculative)

    @classmethod
    def from_seed(cls, cfg: ModelConfig, mesh: Mesh, seed: int = 0, strategy=SERVE_STRATEGY, **kw):
        """An engine over a seeded random init, created already sharded."""
        params = init_params(abstract_model(cfg), mesh, strategy, seed)
        return cls(cfg, params, mesh, strategy, **kw)

    # ---- placement -------------------------------------------------------------------------
    def _zeros_cache(self):
        lay = self.pool.arrays()
        make = jax.jit(lambda: {n: jnp.zeros(s, d) for n, (s, d, _) in lay.items()},
                       out_shardings={n: sh for n, (_, _, sh) in lay.items()})
        return make()

    def _abstract_cache(self):
        return {n: jax.ShapeDtypeStruct(s, d, sharding=sh)
                for n, (s, d, sh) in self.pool.arrays().items()}

    def _cache_shardings(self) -> dict:
        return {n: sh for n, (_, _, sh) in self.pool.arrays().items()}

    def lower_decode(self):
        """The decode step of every slot (the largest bucket), lowered on abstract inputs
        (nothing allocated): ``.compile().memory_analysis()`` is a replica's serving peak."""
        B = self.ecfg.max_batch
        row = jax.ShapeDtypeStruct((B,), jnp.int32)
        table = jax.ShapeDtypeStruct(self.kv.tables.shape, jnp.int32)
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            self._rows(B, None))
        return self._decode_jit.lower(self.params, self.cache, table, row, row, row,
                                      self._rule(), rows, row, False, **self._adapter_kw(
                                          "adapters_B", row))

    def recover(self) -> None:
        """After a failed prefill or decode: a fresh cache if the failed program consumed
        the donated one (its slots' requests have failed; the server refills them)."""
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            self.cache = self._zeros_cache()
            self.kv.forget_cached()   # the cached prefixes' blocks are zeros now

    # ---- traced programs ---------------------------------------------------------------------
    def _prefill(self, params, cache, table_bM, tokens_bT, lengths_b, slots_b, seeds_b, rule,
                 rows=None, with_logits=False, S=0, start_b=None, read_bM=None,
                 adapters_b=None):
        # MoE: dropless, so padding and batch-mates take nothing; adapters_b: each row's
        # adapter slot in a LoRA table
        with runtime.using(moe_inference=True, adapter_rows=adapters_b):
            return self._prefill_body(params, cache, table_bM, tokens_bT, lengths_b, slots_b,
                                      seeds_b, rule, rows, with_logits, S, start_b, read_bM)

    def _prefill_body(self, params, cache, table_bM, tokens_bT, lengths_b, slots_b, seeds_b,
                      rule, rows, with_logits, S, start_b, read_bM):
        """The prompts' tokens from ``start_b`` (cached prefixes: their first blocks, read
        through ``read_bM`` into a scratch of ``S`` positions; none: 0, ``S = T``) attend
        within a scratch cache, then enter the pool (``table_bM``: the blocks to write)."""
        b, T = tokens_bT.shape
        shape, sh = scratch_layout(self.cfg, self.mesh, self.strategy, b, S or T)
        # int8: the prompt attends unquantized, its blocks enter the pool quantized.
        dtype = self.exe.dtype if self.pool.quantized else jnp.dtype(self.pool.dtype)
        tmp = jax.lax.with_sharding_constraint(
            {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}, sh)
        group_b = slots_b // (self.ecfg.max_batch // self.pool.groups)  # padding: >= G
        # The position of each token as it enters: in order, or striped over `context`.
        order = np.arange(T) if self.context is None else self.context.order(T)
        index = jnp.asarray(np.argsort(order), jnp.int32)   # where each position sits
        positions = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, T))
        if start_b is not None:   # unstriped: prefixes are cached without a context split
            tmp = jax.lax.with_sharding_constraint(
                read_prefix(cache, tmp, read_bM, group_b, start_b), sh)
            positions = positions + start_b[:, None]
        logits_bTV, tmp = self._fwd(params, jnp.take(tokens_bT, order, axis=1), positions, tmp)
        last_b = index[lengths_b - 1]
        last_bV = jnp.take_along_axis(logits_bTV, last_b[:, None, None], axis=1)[:, 0]
        full_b = lengths_b if start_b is None else start_b + lengths_b
        # Penalized rows see their whole prompt here (they never start from cached blocks);
        # a resumed row's prompt is its request's, the rest it generated (``prompt_len``).
        tok = sample_step(last_bV, rule, seeds_b, full_b, rows,
                          seen=(tokens_bT, lengths_b, (rows or {}).get("prompt_len", lengths_b)))
        if rows is not None and "prompt_logprobs" in rows:   # echo: in token order
            lp = prompt_logprobs(jnp.take(logits_bTV, index, axis=1), tokens_bT)
            tok = {**(tok if isinstance(tok, dict) else {"token": tok}), **lp}
        # striped over context where the pool is (no communication: models.decode)
        cache = write_scratch(cache, tmp, table_bM, group_b,
                              1 if self.context is None else self.context.size, full_b)
        cache = jax.lax.with_sharding_constraint(cache, self._cache_shardings())
        return (cache, tok, last_bV) if with_logits else (cache, tok)

    def _decode(self, params, cache, table_BM, tokens_B, positions_B, seeds_B, rule,
                rows=None, slots_B=None, with_logits=False, adapters_B=None):
        """One step of a bucket of rows (``B`` here: the bucket's); with ``slots_B``, tokens
        (and logits, ``with_logits``) come back scattered to their slots (``max_batch``:
        padding, dropped)."""
        # Every layer reads the same table: it rides in the cache, scanned with the layers
        # (and split over pipeline stages and micro-batches like the pool).
        paged = {**cache, "table": jnp.broadcast_to(table_BM, (self.cfg.num_layers,
                                                               *table_BM.shape))}
        with runtime.using(moe_inference=True, adapter_rows=adapters_B):
            logits_B1V, paged = self._fwd(params, tokens_B[:, None], positions_B[:, None],
                                          paged)
        cache = jax.lax.with_sharding_constraint({n: paged[n] for n in cache},
                                                 self._cache_shardings())
        tok = sample_step(logits_B1V[:, 0], rule, seeds_B, positions_B + 1, rows)
        if slots_B is None:
            return (cache, tok, logits_B1V[:, 0]) if with_logits else (cache, tok)
        n = self.ecfg.max_batch
        tok_n = scatter_rows(tok, slots_B, n)
        if not with_logits:
            return cache, tok_n
        logits_nV = jnp.zeros((n, logits_B1V.shape[-1]), logits_B1V.dtype).at[slots_B].set(
            logits_B1V[:, 0], mode="drop")
        return cache, tok_n, logits_nV

    def _adapter_kw(self, name: str, rows) -> dict:
        """The step's per-row adapter slots (a keyword argument) when there is a table."""
        return {name: rows} if self.table else {}

    def _rule(self) -> SamplingConfig:
        return dataclasses.replace(self.sampling, stop_tokens=())

    def _rows(self, n: int, settings: Optional[Sequence[SamplingConfig]],
              prompt_lens: Optional[Sequence[int]] = None) -> dict:
        """Per-row sampling arrays for ``n`` rows: each request's own settings, the engine's
        default for the rest (padding rows and callers that give none); penalized rows
        also their prompts' lengths (``prompt_lens``: a resumed row's request's prompt)."""
        given = list(settings or ())
        rows = row_settings(given + [self.sampling] * (n - len(given)), prefill=True)
        if "presence" in rows and prompt_lens is not None:
            lens = np.zeros(n, np.int32)
            lens[:len(prompt_lens)] = prompt_lens
            rows["prompt_len"] = lens
        return rows

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
                     with_logits=False, cached=None, prompt_lens=None, adapters=None):
        """``cached``: each row's positions already in its blocks (whole cached blocks; the
        rest of its prompt computed); None: none cached (the plain program)."""
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
        ad = np.zeros(b, np.int32)
        ad[:n] = adapters if adapters is not None else 0
        self.cache, *out = self._prefill_jit(
            self.params, self.cache, table, tokens, lengths, slot_arr, seed_arr, self._rule(),
            self._rows(b, settings, prompt_lens), with_logits, S, *extra,
            **self._adapter_kw("adapters_b", ad))
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
                adapters: Optional[Sequence[int]] = None):
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
        rows keep it while they decode."""
        lens = [len(p) for p in prompts]
        cached = list(cached) if cached is not None and any(cached) else None
        for n in lens:
            self.check_prompt(n, 1)
        for i, (s, n) in enumerate(zip(slots, lens)):
            if self.kv.held[s] and not (cached and cached[i]):
                self.release(s)
            self.kv.grow(s, n)
        prompt_lens = list(prompt_lens) if prompt_lens is not None else lens
        for s, p, k in zip(slots, prompts, prompt_lens):
            self.history.start(s, p, k)
        b = next(b for b in self._prefill_batches() if b >= len(prompts))
        T = self._bucket(max(n - c for n, c in zip(lens, cached or [0] * len(lens))))
        adapters = [0] * len(slots) if adapters is None else list(adapters)
        self.adapter_of[list(slots)] = adapters
        out = self._run_prefill(slots, prompts, seeds, b, T, settings, with_logits, cached,
                                prompt_lens, adapters)
        self.lengths[list(slots)] = lens
        for s, p, a in zip(slots, prompts, adapters):
            self.kv.register(s, p, self.adapter_keys[a])
        return out

    def warmup(self, prompt_lengths: Sequence[int],
               progress: Optional[Callable[[str], None]] = None) -> None:
        """Compile prefill (every batch bucket × the needed length buckets) and decode ahead
        of serving, so served timings exclude compilation. Call it with no live slots (its
        rows are all padding: nothing is written). ``progress(line)`` hears each program
        compiled: which bucket, k of n, and its seconds."""
        B = self.ecfg.max_batch
        zeros = np.zeros(B, np.int32)
        runs = [(f"prefill {b} rows × {T} tokens",   # every row dropped: cache unchanged
                 lambda b=b, T=T: self._run_prefill([], [], [], b, T))
                for T in sorted({self._bucket(n) for n in prompt_lengths})
                for b in self._prefill_batches()]
        runs += [(f"decode {self.pool.groups * k} rows",   # every row padding: nothing written
                  lambda k=k: self._run_decode(np.full(self.pool.groups * k, B), zeros, zeros,
                                               zeros, None))
                 for k in self._decode_buckets()]
        for i, (what, run) in enumerate(runs, 1):
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            if progress is not None:
                progress(f"compiled {what} ({i}/{len(runs)}) in "
                         f"{time.perf_counter() - t0:.1f} s")
        if self.speculator is not None:   # its verify (and draft) programs too
            self.speculator.warmup(prompt_lengths, progress)

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

    def _run_decode(self, rows, tokens, positions, seeds, settings, with_logits=False):
        B = self.ecfg.max_batch
        real = rows < B
        s = np.where(real, rows, 0)
        pick = lambda a: np.where(real, np.asarray(a)[s], 0).astype(np.int32)  # noqa: E731
        table = np.where(real[:, None], self.kv.tables[s], self.pool.blocks).astype(np.int32)
        given = list(settings) if settings else [self.sampling] * B
        configs = [given[i] if r else self.sampling for i, r in zip(s, real)]
        self.compiles["decode"].add(rows.shape)
        self.cache, *out = self._decode_jit(
            self.params, self.cache, table, pick(tokens), pick(positions), pick(seeds),
            self._rule(), self.history.seen_rows(
                row_settings(configs, self.history.generated(s, real)), s, real),
            rows.astype(np.int32), with_logits,
            **self._adapter_kw("adapters_B", np.where(real, self.adapter_of[s], 0)))
        return tuple(out) if with_logits else out[0]

    def decode(self, tokens: np.ndarray, active: np.ndarray, seeds: np.ndarray,
               settings: Optional[Sequence[SamplingConfig]] = None, with_logits: bool = False):
        """Feed one token per slot (``active`` rows advance); return the next tokens (one per
        slot; only the active ones mean anything). Only the active rows run: a bucket of
        them per row group (``_decode_rows``; one compile per bucket). ``settings``: one
        ``SamplingConfig`` per slot (default: the engine's for all). ``with_logits``: return
        ``(tokens, logits)``, the ``[slots, V]`` logits each token was drawn from."""
        full = active & (self.lengths >= self.ecfg.max_len)
        if full.any():
            raise CacheFullError(
                f"KV cache full for slot(s) {np.flatnonzero(full).tolist()}: all "
                f"{self.ecfg.max_len} positions used; finish or free the slot, or raise max_len")
        for s in np.flatnonzero(active):   # the new token's position needs its block
            self.kv.grow(int(s), int(self.lengths[s]) + 1)
        positions = np.minimum(self.lengths, self.ecfg.max_len - 1).astype(np.int32)
        self.history.feed(np.flatnonzero(active), tokens)
        out = self._run_decode(self._decode_rows(np.asarray(active, bool)), tokens, positions,
                               seeds, settings, with_logits)
        self.lengths[active] += 1
        return out

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` ended: its blocks go back to the pool."""
        self.kv.release(slot)
        self.lengths[slot] = 0
