"""Analytic communication and memory ideals for one train step (used by bench/strategies.py).

Bytes follow triax.sharding.introspect's payload convention, per device per step:
all-reduce = the buffer, all-gather = the gathered output, reduce-scatter = the full input.
Every term is keyed by (kind, mesh axes) so it lines up with the HLO breakdown.
"""
from __future__ import annotations

from collections import defaultdict

import numpy as np

from triax.mesh import mesh_sizes
from triax.sharding.introspect import placement_table

F32 = 4


def _axes_in(spec) -> set[str]:
    out: set[str] = set()
    for e in spec:
        if e is not None:
            out.update((e,) if isinstance(e, str) else e)
    return out


def weight_sync_terms(trainer) -> dict[tuple[str, tuple[str, ...]], int]:
    """Gradient synchronisation over ``data`` (batch is split there), per parameter.

    ``F`` = the parameter's bytes on one device if it were not split over ``data``.
      * split over data in the parameter rules (FSDP / ZeRO-3): all-gather F in the
        forward, again in the backward (the gathered weight is not kept), reduce-scatter F;
      * split over data only in the optimizer rules (ZeRO-1): reduce-scatter F of the
        gradient, all-gather F of the updated parameter;
      * replicated over data (DP, and norm scales everywhere): all-reduce F.
    """
    am, mesh, st = trainer.abstract, trainer.mesh, trainer.strategy
    d = mesh_sizes(mesh)["data"]
    terms: dict = defaultdict(int)
    if d == 1:
        return terms
    rows = placement_table(am, mesh, st)
    opt_rows = placement_table(am, mesh, st, optimizer=True)
    for r, o in zip(rows, opt_rows):
        if "data" in _axes_in(r.spec):
            F = r.bytes_per_device * d
            terms[("all-gather", ("data",))] += 2 * F
            terms[("reduce-scatter", ("data",))] += F
        elif "data" in _axes_in(o.spec):
            F = r.bytes_per_device
            terms[("reduce-scatter", ("data",))] += F
            terms[("all-gather", ("data",))] += F
        else:
            terms[("all-reduce", ("data",))] += r.bytes_per_device
    return terms


def tensor_terms(cfg, mesh, batch_size: int, seq_len: int) -> dict:
    """Megatron activation traffic over ``tensor`` (b = per-data-shard batch).

    Per block: forward all-reduce after attention-out and after MLP-down; backward
    all-reduce of the input gradient of MLP-in and of attention's fused q/k/v input
    (4 · b·T·D). When ``tensor`` > kv_heads the K/V weights are replicated and each rank
    repeats its own KV head: the backward reduces dK, dV over the tensor/K ranks sharing
    a KV head (2 · b·T·H) and all-gathers them to every rank (2 · b·T·K·H).
    Vocab-parallel embedding: one forward all-reduce (b·T·D). Vocab-parallel logits:
    log-softmax max and sum, the target logit (3 · b·T) and the backward input gradient
    through the head (b·T·D).
    """
    s = mesh_sizes(mesh)
    t, d = s["tensor"], s["data"]
    terms: dict = defaultdict(int)
    if t == 1:
        return terms
    b, T, D, L = batch_size // d, seq_len, cfg.embed_dim, cfg.num_layers
    K, H = cfg.num_kv_heads, cfg.head_dim
    ar = ("all-reduce", ("tensor",))
    act = b * T * D * F32
    terms[ar] += 4 * L * act
    if K % t:
        if t % K:
            raise ValueError(f"no ideal for tensor={t} with kv_heads={K} (neither divides)")
        terms[ar] += L * 2 * b * T * H * F32
        terms[("all-gather", ("tensor",))] += L * 2 * b * T * K * H * F32
    terms[ar] += act                       # embedding forward
    terms[ar] += 3 * b * T * F32 + act     # logits: max, sum-exp, target; backward dx
    return terms


def ideal_collectives(trainer, batch_size: int, seq_len: int) -> dict:
    terms: dict = defaultdict(int)
    for part in (weight_sync_terms(trainer),
                 tensor_terms(trainer.cfg, trainer.mesh, batch_size, seq_len)):
        for k, v in part.items():
            terms[k] += v
    return dict(terms)


# Logical axes of each parameter group's arrays (the layer stack's matrices, its norm
# scales, the embedding table and head, the final norm): a group is ideally split over
# every mesh axis the strategy maps any of them to.
_GROUP_AXES = {"matrices": ("layers", "embed", "mlp"), "norms": ("layers", "norm"),
               "embed": ("vocab", "embed"), "head": ("vocab", "embed"),
               "final_norm": ("norm",)}
ADAM_MOMENTS = 2


def _group_counts(cfg) -> dict[str, int]:
    c = cfg.param_counts()
    norms = 2 * cfg.embed_dim * cfg.num_layers
    return {"matrices": c["layers"] - norms, "norms": norms, "embed": c["embed"],
            "head": c["head"], "final_norm": c["final_norm"]}


def _ideal_shards(rules, sizes: dict, group: str) -> int:
    axes = {a for name in _GROUP_AXES[group] for a in rules.mesh_axes(name)}
    return int(np.prod([sizes.get(a, 1) for a in sorted(axes)]))


def ideal_state_bytes(trainer, batch_size: int, seq_len: int) -> dict[str, int]:
    """Per-device bytes of the step's inputs, derived without the step's own state tree:
    ``ModelConfig.param_counts()`` by group, each split evenly over the mesh axes the
    strategy's rules give it (optimizer rules for AdamW's two fp32 moments), plus the step
    counter and the token batch. Where the compiled step holds more (a dimension that does
    not divide, KV heads replicated over extra tensor ranks), the ratio shows it."""
    cfg, st = trainer.cfg, trainer.strategy
    if cfg.moe is not None:
        raise ValueError("ideal_state_bytes covers dense models (no expert groups)")
    sizes = mesh_sizes(trainer.mesh)
    counts = _group_counts(cfg)
    params = sum(F32 * n // _ideal_shards(st.rules, sizes, g) for g, n in counts.items())
    opt = sum(ADAM_MOMENTS * F32 * n // _ideal_shards(st.optimizer_rules, sizes, g)
              for g, n in counts.items())
    b = batch_size // sizes["data"]
    batch = 2 * b * seq_len * 4  # inputs and targets, int32, replicated over tensor
    step = 4  # the int32 step counter
    return {"params": params, "opt": opt, "batch": batch, "total": params + opt + step + batch}


def qkv_three_buffer_bytes(cfg, sizes: dict, batch_size: int, seq_len: int) -> int:
    """What the ideal leaves out when XLA all-reduces the q, k and v input gradients of the
    attention backward as three buffers instead of one (only when K/V heads are split).
    ``sizes``: mesh axis sizes, e.g. ``{"data": 2, "tensor": 4}``."""
    t, d = sizes.get("tensor", 1), sizes.get("data", 1)
    if t == 1 or cfg.num_kv_heads % t:
        return 0
    return cfg.num_layers * 2 * (batch_size // d) * seq_len * cfg.embed_dim * F32
