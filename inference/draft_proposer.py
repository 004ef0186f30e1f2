"""A draft model's proposals: a small model with its own engine (weights and paged KV cache)
on the target's mesh, run ``k`` tokens ahead of each row.

The draft's cache holds a row's positions up to (not including) the target's last token,
or one fewer: after a step that kept every proposal, the last one was never fed to the draft.
A step feeds that one (if any) and the last token in one forward over two positions, draws
``d_1`` from its distribution ``q_1``, then feeds ``d_i`` one position at a time for
``d_2..d_k``; every draw uses the key of the position it fills (the target's: the two draws
share their noise, which raises acceptance and changes no distribution, as each acceptance
uniform and residual draw has a key of its own, ``inference.rejection``). The tokens and
``q`` stay on the device for the target's verify. After it, the draft's length rolls back to
the accepted tokens (``rolled_back``). A slot whose request changed (a new request, a
preempted one readmitted) or that fell behind (plain steps for penalized rows) is prefilled
again from its tokens.

    >>> from triax.mesh import make_mesh
    >>> from triax.models import config
    >>> draft = load_draft("tiny", config.TINY, make_mesh(devices=jax.devices()[:1]), "tp",
    ...                    seed=0, num_layers=1)
    >>> draft.num_layers
    1
"""
from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from triax.inference.engine import Engine, EngineConfig
from triax.inference.errors import InferenceError
from triax.inference.sampling import sample_rows
from triax.inference.speculative import extend_forward, sink_table
from triax.models.config import ModelConfig


def load_draft(source: str, target: ModelConfig, mesh, strategy, seed: int = 0,
               num_layers: Optional[int] = None):
    """The draft named by ``source``, loaded on ``mesh``: a Hugging Face model directory
    (``config.json``), a training checkpoint directory, or a preset (initialised from
    ``seed``, ``num_layers`` overriding its depth). Its vocabulary must be the target's."""
    from triax.inference.checkpoint import load_params
    if os.path.isfile(os.path.join(source, "config.json")):
        from triax.hf.load import load_params as hf_params, read_model_config
        cfg = read_model_config(source)
        _check_vocab(source, cfg, target)   # before any weight is read or placed
        params, _ = hf_params(source, cfg, mesh, strategy)
    elif os.path.isdir(source):
        cfg, params = load_params(mesh, checkpoint=source, strategy=strategy)
    else:
        cfg, params = load_params(mesh, model=source, seed=seed, strategy=strategy,
                                  num_layers=num_layers)
    _check_vocab(source, cfg, target)
    return DraftWeights(cfg, params)


def _check_vocab(source: str, cfg: ModelConfig, target: ModelConfig) -> None:
    if cfg.vocab_size != target.vocab_size:
        raise InferenceError(f"--draft-model {source!r} has a vocabulary of {cfg.vocab_size} "
                             f"ids and the target {target.vocab_size}: a draft must share the "
                             f"target's tokenizer")


@dataclasses.dataclass
class DraftWeights:
    """A loaded draft model: its config and weights (on one mesh)."""

    cfg: ModelConfig
    params: object

    @property
    def num_layers(self) -> int:
        return self.cfg.num_layers


def draft_for(weights: DraftWeights):
    """``engine -> DraftProposer``: a draft engine beside each target engine (its mesh,
    strategy, slots and sequence length; a pool of its own, slots × ``max_len``)."""
    def make(target: Engine) -> DraftProposer:
        ecfg = dataclasses.replace(target.ecfg, kv_blocks=0, kv_memory=0, prefix_cache=False)
        if weights.cfg.max_seq_len < ecfg.max_len:
            raise InferenceError(f"the draft model's context ({weights.cfg.max_seq_len}) is "
                                 f"shorter than --max-len {ecfg.max_len}")
        return DraftProposer(Engine(weights.cfg, weights.params, target.mesh, target.strategy,
                                    ecfg, target.sampling))
    return make


class DraftProposer:
    """Draft proposals on the device (``propose_device``), one draft engine per target."""

    host_side = False

    def __init__(self, engine: Engine):
        self.engine = engine
        B = engine.ecfg.max_batch
        self.owner: list = [None] * B
        self.fed_end = np.zeros(B, np.int64)
        self._step_jit = jax.jit(self._step, donate_argnums=(1,))

    def _step(self, params, cache, table_RM, tokens_RT, positions_RT, pick_R, seeds_R, key_R,
              seed, rows):
        tokens_RT = tokens_RT.reshape(positions_RT.shape)   # a step after the first: [R]
        logits_RTV, cache = extend_forward(self.engine, params, cache, table_RM, tokens_RT,
                                           positions_RT)
        logits_RV = jnp.take_along_axis(logits_RTV, pick_R[:, None, None], 1)[:, 0]
        logits_RV = logits_RV.astype(jnp.float32)
        return cache, sample_rows(logits_RV, seed, seeds_R, key_R, rows), logits_RV

    def _resync(self, slots, lengths, contexts, owners) -> None:
        """Prefill the slots whose draft cache does not hold their tokens before the last."""
        eng = self.engine
        stale = [s for s in slots if self.owner[s] != owners[s]
                 or not 0 <= lengths[s] - eng.lengths[s] <= 1]
        if stale:
            eng.prefill(stale, [np.asarray(contexts[s][:lengths[s]]) for s in stale],
                        seeds=[0] * len(stale), padded=True)   # its tokens: unread
            for s in stale:
                self.owner[s] = owners[s]

    def propose_device(self, k, rows, real, L_R, n_R, last_R, contexts, owners, seeds_R, seed,
                       row_arrays):
        """``k`` proposals per row of the step and the draft's logits for each, on the
        device, one ``[R]`` / ``[R, V]`` array per step (rows ``real`` are slots ``rows``;
        ``L_R`` their lengths, ``n_R`` the proposals each verifies, ``last_R`` their last
        tokens)."""
        eng = self.engine
        B, N, P = eng.ecfg.max_batch, eng.pool.blocks, eng.pool.block_size
        if any(x.is_deleted() for x in jax.tree.leaves(eng.cache)):   # a failed step's
            eng.recover()
            self.owner = [None] * B   # its contents are gone: every row is prefilled again
        slots = rows[real].tolist()
        lengths = np.zeros(B, np.int64)
        lengths[slots] = L_R[real]
        self._resync(slots, lengths, contexts, owners)
        s = np.where(real, rows, 0)
        for slot, n in zip(slots, n_R[real]):
            self.fed_end[slot] = lengths[slot] + max(int(n), 1)
            eng.kv.grow(slot, int(self.fed_end[slot]))
        table = sink_table(eng.kv.tables[s], real, N)
        sink = (table.shape[1] - 1) * P
        dL_R = np.where(real, eng.lengths[s], 0)
        gap = np.where(real, L_R - dL_R, 0)
        ctx_prev = np.array([contexts[r][dL] if r_ok and g else 0 for r, r_ok, dL, g in
                             zip(s, real, dL_R, gap)], np.int32)
        tokens = np.stack([np.where(gap == 1, ctx_prev, last_R),
                           np.where(gap == 1, last_R, 0)], axis=1).astype(np.int32)
        positions = np.stack([np.where(gap == 1, dL_R, L_R),
                              np.where(gap == 1, L_R, sink)], axis=1)
        positions = np.where(real[:, None], positions, sink).astype(np.int32)
        drafts, logits = [], []
        d, pick = tokens, gap.astype(np.int32)
        for i in range(1, k + 1):
            if i > 1:
                d = d_prev
                positions = np.where(real & (i <= n_R), L_R + i - 1, sink)[:, None]
                positions = positions.astype(np.int32)
                pick = np.zeros(len(rows), np.int32)
            eng.cache, d_prev, q = self._step_jit(eng.params, eng.cache, table, d, positions,
                                                  pick, seeds_R, (L_R + i).astype(np.int32),
                                                  seed, row_arrays)
            drafts.append(d_prev)
            logits.append(q)
        return tuple(drafts), tuple(logits)   # stacked inside the verify step

    def rolled_back(self, rnd, accepted) -> None:
        """After the target's verify: each row's draft cache keeps its accepted tokens."""
        eng = self.engine
        for s in rnd.rows[rnd.real].tolist():
            keep = min(int(self.fed_end[s]), int(rnd.lengths[s]) + int(accepted[s]) + 1)
            eng.lengths[s] = keep
            eng.kv.shrink(s, keep)


def speculate(engines, engine_config, seed: int = 0) -> None:
    """Attach ``triax serve``'s speculative decoding (``serve_config.Engine``'s
    ``speculative``, ``num_speculative_tokens``, ``draft_model``) to each replica engine; a
    draft model is loaded onto each replica's own mesh."""
    from triax.inference.speculative import SpeculativeConfig, attach
    e = engine_config
    if e.speculative == "off":
        return
    config = SpeculativeConfig(e.speculative, e.num_speculative_tokens, e.draft_model)
    attach(engines, config, lambda eng: draft_for(load_draft(
        config.draft_model, eng.cfg, eng.mesh, eng.strategy, seed))(eng))
