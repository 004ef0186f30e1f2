"""The device side of one replica: its weights, mesh, KV pool arrays and jitted programs.

A ``ModelRunner`` places one model copy on one (sub-)mesh, allocates the paged KV pool's
arrays (``triax.inference.kv_pool``) and holds the traced prefill, decode and mixed
(decode rows and a prompt chunk in one forward) programs; it keeps no per-request state.
``triax.inference.engine.Engine`` adds the host side (block tables, slot lengths, buckets)
and launches these programs. ``pipe > 1`` decodes through
the pipeline (``triax.inference.forward``). On a mesh with a ``context`` axis (and no
``pipe``) the cache is split along its positions and the prompt along its tokens
(``triax.sharding.context_cache``), each block's positions striped over it.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> run = ModelRunner(config.TINY, None, make_mesh(tensor=-1),
    ...                   ecfg=EngineConfig(max_batch=2, max_len=32))   # abstract: no arrays
    >>> run.abstract, sorted(run.cache)[:2]
    (True, ['k', 'v'])
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from triax import choices
from triax.inference.errors import InferenceError
from triax.inference.forward import check_pipeline, pipelined_forward, plain_forward
from triax.inference.kv_pool import (decode_microbatches, kv_pool, kv_storage_dtype,
                                     scratch_layout, split_context)
from triax.inference.logprobs import prompt_logprobs, scatter_rows
from triax.inference.sampling import SamplingConfig, draw, row_settings, step_tokens
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

class ModelRunner:
    """One model copy on ``mesh``: placed weights, the KV pool's arrays, the jitted
    prefill, decode and mixed programs (see module docstring). ``params=None``: abstract."""

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
        # A LoRA table (many adapters, inference.adapter_table): a per-row adapter input.
        self.table = cfg.lora is not None and cfg.lora.slots > 0
        if self.table and (self.pipelined or self.context is not None):
            raise InferenceError("many adapters (--adapter NAME=DIR) are served on tensor "
                                 "and data layouts; drop pipe and context from --mesh")
        self.cache = self._abstract_cache() if self.abstract else self._zeros_cache()
        # Sampling is data (each row's settings, the engine's seed): changing either compiles
        # nothing; stop tokens are host-side.
        # Each step returns its greedy tokens and its logits; the draw (``sampling.draw``)
        # runs on them only when a row samples: one program per row count, where the sort,
        # softmax and hashes were part of every prefill, decode and mixed program. A
        # decode's draws go to their slots by a small program of their own (``_to_slots``),
        # so a prefill and a decode of as many rows share one draw program.
        self._prefill_jit = jax.jit(self._prefill, donate_argnums=(1,), static_argnums=(7,))
        self._decode_jit = jax.jit(self._decode, donate_argnums=(1,))
        self._mixed_jit = jax.jit(self._mixed, donate_argnums=(1,))
        self._draw_jit = jax.jit(self._draw)
        self._to_slots_jit = jax.jit(self._to_slots)
        self.compiles = {"prefill": set(), "decode": set(), "mixed": set(), "draw": set()}
        self.launches = {"prefill": 0, "decode": 0, "mixed": 0, "draw": 0}   # programs run

    @classmethod
    def from_seed(cls, cfg: ModelConfig, mesh: Mesh, seed: int = 0, strategy=SERVE_STRATEGY, **kw):
        """Over a seeded random init, created already sharded."""
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
        table = jax.ShapeDtypeStruct((B, self.pool.max_blocks), jnp.int32)
        rows = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                            self._rows(B, None))
        return self._decode_jit.lower(self.params, self.cache, table, row, row, rows, row,
                                      **self._adapter_kw("adapters_B", row))

    def fresh_cache(self) -> bool:
        """After a failed program: zeros for the cache if it consumed the donated one
        (True then: every block's contents are gone)."""
        if any(x.is_deleted() for x in jax.tree.leaves(self.cache)):
            self.cache = self._zeros_cache()
            return True
        return False

    # ---- traced programs ---------------------------------------------------------------------
    def _prefill(self, params, cache, table_bM, tokens_bT, lengths_b, slots_b, rows, S=0,
                 start_b=None, read_bM=None, adapters_b=None):
        # MoE: dropless, so padding and batch-mates take nothing; adapters_b: each row's
        # adapter slot in a LoRA table
        with runtime.using(moe_inference=True, adapter_rows=adapters_b):
            return self._prefill_body(params, cache, table_bM, tokens_bT, lengths_b, slots_b,
                                      rows, S, start_b, read_bM)

    def _prefill_body(self, params, cache, table_bM, tokens_bT, lengths_b, slots_b, rows, S,
                      start_b, read_bM):
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
        tok, logits = step_tokens(last_bV, rows,
                                  seen=(tokens_bT, lengths_b, rows.get("prompt_len", lengths_b)))
        if "prompt_logprobs" in rows:   # echo: in token order
            lp = prompt_logprobs(jnp.take(logits_bTV, index, axis=1), tokens_bT)
            tok = {**(tok if isinstance(tok, dict) else {"token": tok}), **lp}
        # striped over context where the pool is (no communication: models.decode)
        cache = write_scratch(cache, tmp, table_bM, group_b,
                              1 if self.context is None else self.context.size, full_b)
        cache = jax.lax.with_sharding_constraint(cache, self._cache_shardings())
        return cache, tok, logits

    def _decode(self, params, cache, table_BM, tokens_B, positions_B, rows, slots_B=None,
                adapters_B=None):
        """One step of a bucket of rows (``B`` here: the bucket's); with ``slots_B``, tokens
        come back scattered to their slots (``max_batch``: padding, dropped); the logits a
        draw reads (``sampling.step_tokens``) in the bucket's order."""
        # Every layer reads the same table: it rides in the cache, scanned with the layers
        # (and split over pipeline stages and micro-batches like the pool).
        paged = {**cache, "table": jnp.broadcast_to(table_BM, (self.cfg.num_layers,
                                                               *table_BM.shape))}
        with runtime.using(moe_inference=True, adapter_rows=adapters_B):
            logits_B1V, paged = self._fwd(params, tokens_B[:, None], positions_B[:, None],
                                          paged)
        cache = jax.lax.with_sharding_constraint({n: paged[n] for n in cache},
                                                 self._cache_shardings())
        tok, logits = step_tokens(logits_B1V[:, 0], rows)
        if slots_B is None:
            return cache, tok, logits
        return cache, scatter_rows(tok, slots_B, self.ecfg.max_batch), logits

    def _mixed(self, params, cache, table_BM, tokens_B, positions_B, rows, slots_B,
               chunk_table_1M, chunk_1C, start_1, length_1, chunk_rows):
        """One fused step: ``_decode``'s rows and one prompt chunk (``length_1`` tokens of
        ``chunk_1C`` from position ``start_1``, the rest padding) as one row of ``B + C``
        tokens, so every weight is read once (``models.decode.mixed_attention`` splits the
        attention). ``(cache, tokens by slot, the chunk's token, the rows' logits, the chunk's
        logits)``: the decode rows' as ``_decode``'s, the chunk's as ``_prefill``'s from its
        last token."""
        B, L = tokens_B.shape[0], self.cfg.num_layers
        tokens_1X = jnp.concatenate([tokens_B, chunk_1C[0]])[None]
        positions_1X = jnp.concatenate(
            [positions_B, start_1 + jnp.arange(chunk_1C.shape[1], dtype=jnp.int32)])[None]
        layers = lambda x: jnp.broadcast_to(x, (L, *x.shape))   # noqa: E731 (as _decode's)
        paged = {**cache, "table": layers(table_BM), "chunk_table": layers(chunk_table_1M),
                 "chunk_end": layers(start_1 + length_1)}
        with runtime.using(moe_inference=True):
            logits_1XV, paged = self._fwd(params, tokens_1X, positions_1X, paged)
        cache = jax.lax.with_sharding_constraint({n: paged[n] for n in cache},
                                                 self._cache_shardings())
        tok, logits = step_tokens(logits_1XV[0, :B], rows)
        last_1V = jax.lax.dynamic_slice_in_dim(logits_1XV[0], B + length_1[0] - 1, 1)
        first, first_logits = step_tokens(last_1V, chunk_rows)
        return (cache, scatter_rows(tok, slots_B, self.ecfg.max_batch), first, logits,
                first_logits)

    def _draw(self, logits, seed, seeds_B, positions_B, rows):
        """A step's sampled tokens (``sampling.draw``) from its ``logits``, one per row."""
        return draw(logits, seed, seeds_B, positions_B, rows)

    def _to_slots(self, tok, slots_B):
        """A decode's drawn tokens (and log-probabilities) scattered to their slots, as the
        step's own are."""
        return scatter_rows(tok, slots_B, self.ecfg.max_batch)

    @property
    def mixes(self) -> bool:
        """Whether this replica runs fused mixed steps (``_mixed``): one row group, an
        unpipelined, unsplit forward, no LoRA table."""
        return not (self.pipelined or self.context is not None or self.table
                    or self.pool.groups > 1)

    def _adapter_kw(self, name: str, rows) -> dict:
        """The step's per-row adapter slots (a keyword argument) when there is a table."""
        return {name: rows} if self.table else {}

    def sampling_seed(self) -> np.ndarray:
        """The engine's global seed as a step's input (a traced scalar, not a constant)."""
        return np.int32(self.sampling.seed)

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

