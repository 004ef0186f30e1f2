"""Communication per step, per device and per mesh axis, and where each axis runs.

Two numbers per collective:
  * ``payload``: bytes in the convention of ``triax.sharding.introspect`` (all-reduce: the
    buffer; all-gather: the gathered output; reduce-scatter: the full input; all-to-all and
    collective-permute: the buffer), which is what the compiled HLO is checked against;
  * ``wire``: bytes a device actually sends with ring algorithms (all-reduce 2(n−1)/n of the
    buffer, all-gather and reduce-scatter (n−1)/n, all-to-all (n−1)/n, permute 1×), which is
    what the link time uses.

Under LoRA a step reduces the adapters' gradients only (:func:`trained`: the base is frozen,
so no all-reduce or reduce-scatter of a base weight, and a frozen embedding's lookup moves
nothing backward); FSDP still gathers the base, at the compute dtype whatever the base is
stored in (the compiled step casts, or dequantizes, before it gathers); and the adapters add
one rank-wide all-reduce per row-parallel adapter forward and per column-parallel one
backward over ``tensor`` (:func:`_lora_tensor`).

    >>> from triax.models import config
    >>> from triax.costs.workload import Layout, Workload
    >>> w = Workload.of(config.get("tiny"), train=True, dtype="fp32", batch=8, seq=16)
    >>> traffic(w, Layout(data=8))["data"].payload == config.get("tiny").num_params * 4
    True
"""
from __future__ import annotations

from dataclasses import dataclass, field

from triax.costs.fp8 import SCALE_BYTES, gather_bytes, scale_reductions
from triax.costs.hardware import Cluster, Link
from triax.models.lora import is_adapter_path, pair_leaf
from triax.models.moe import capacity
from triax.mesh.build import AXES
from triax.costs.activations import tensor_local
from triax.pipeline.fsdp import layer_passes
from triax.costs.memory import pipelined_fsdp
from triax.costs.param_layout import (layout_rules, leaf_elements, local_param_elements,
                                        param_leaves)
from triax.pipeline.chunk_routes import moving_rounds, routed
from triax.costs.pipeline_math import schedule_table
from triax.costs.workload import FP32, Layout, Workload, ceil_div
from triax.sharding.context_costs import order_collective, scheme_collectives

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_WIRE = {"all-reduce": lambda n: 2 * (n - 1) / n, "all-gather": lambda n: (n - 1) / n,
         "reduce-scatter": lambda n: (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
         "collective-permute": lambda n: 1.0}


@dataclass
class AxisTraffic:
    """Collectives on one mesh axis: payload bytes by kind, ring wire bytes, messages."""

    size: int
    payload_by_kind: dict[str, float] = field(default_factory=dict)
    messages_by_kind: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, payload: float, count: int = 1) -> None:
        self.payload_by_kind[kind] = self.payload_by_kind.get(kind, 0.0) + payload * count
        self.messages_by_kind[kind] = self.messages_by_kind.get(kind, 0) + count

    @property
    def messages(self) -> int:
        return sum(self.messages_by_kind.values())

    @property
    def payload(self) -> float:
        return sum(self.payload_by_kind.values())

    @property
    def wire(self) -> float:
        return sum(_WIRE[k](self.size) * b for k, b in self.payload_by_kind.items())


def _frozen_base(w: Workload) -> bool:
    return w.lora is not None and w.train


def trained(w: Workload, path: str) -> bool:
    """Whether a step reduces the gradient of the parameter at ``path``: every one, or under
    LoRA training only the adapters."""
    return not _frozen_base(w) or is_adapter_path(path.split("/"))


def _trained_part(w: Workload):
    """``local_param_elements``' ``part`` of the parameters whose gradients are reduced."""
    return "adapters" if _frozen_base(w) else None


def traffic(w: Workload, lay: Layout) -> dict[str, AxisTraffic]:
    """Per-device collective bytes of one training step (or one forward) by mesh axis."""
    out = {a: AxisTraffic(s) for a, s in lay.sizes.items() if s > 1}
    if "data" in out and w.train:
        _data_axis(w, lay, out["data"])
    if w.train and w.cfg is not None:
        _other_batch_axes(w, lay, out)
    if w.cfg is None:
        return out
    # Tokens one device runs: a training step's B·T (T/C of each sequence under context
    # parallelism), or one decode step's B new tokens.
    rules = lay.strategy.rules
    tokens = w.batch / lay.batch_shards * (
        w.seq / rules.split_size("seq", lay.sizes) if w.train else 1)
    act = tokens * w.cfg.embed_dim * w.dtype_bytes       # one B·T·D activation
    layers = ceil_div(w.cfg.num_layers, lay.pipe)
    passes = 2 if w.train else 1                          # forward (+ backward)
    if "tensor" in out and "heads" in lay.strategy.rules.as_dict():
        _tensor_axis(w, lay, out["tensor"], act, layers, passes)
    if "pipe" in out:
        _pipe_axis(w, lay, out["pipe"], act, passes)
    if "expert" in out and w.cfg.moe is not None:
        # Dispatch and combine move each sequence's whole capacity buffer: 2 per layer/pass,
        # and 2 more in a rematerialised layer's recomputed forward (no remat policy saves
        # an all-to-all's output).
        recomputed = 1 if w.train and w.remat != "none" else 0
        out["expert"].add("all-to-all", _moe_buffer(w, lay), 2 * layers * (passes + recomputed))
    if "context" in out and w.train:
        _context_axis(w, lay, out["context"], layers)
    scales = scale_reductions(w, layers)   # fp8's current scales: one amax each
    for axis in rules.mesh_axes("batch") if scales else ():
        if axis in out:
            out[axis].add("all-reduce", SCALE_BYTES, scales)
    return out


def _context_axis(w: Workload, lay: Layout, t: AxisTraffic, layers: int) -> None:
    """Context parallelism: each layer's attention moves K/V over ``context`` by its scheme
    (``sharding.context_costs``: all-gather forward and reduce-scatter backward, or the
    ring's permutes; a recomputed forward moves them again), the keys' order once per step,
    and ``context`` is a batch axis for the weights: every gradient is all-reduced over it
    at the optimizer's sharding (the embedding table's whole where that splits it over
    ``data``), and under FSDP an exchanged lookup's output is gathered over ``context``
    once (``fsdp_gathers_table``: not where the table itself is gathered)."""
    cfg = w.cfg
    rows = w.batch / lay.batch_shards           # sequences on the device (pipe == 1)
    kv = tensor_local("act_kv_heads", cfg.num_kv_heads, lay.tensor,
                      lay.strategy.rules)
    forward_again = 2 if w.remat != "none" else 1
    size = {"compute": w.dtype_bytes, "float32": FP32, "int32": 4}
    for kind, elements, fwd, bwd, dtype in scheme_collectives(
            lay.context_attention, seq=w.seq, context=lay.context, kv_heads=kv,
            head_dim=cfg.head_dim):
        count = (fwd * forward_again + bwd) * layers
        if count:
            t.add(kind, rows * elements * size[dtype], count)
    kind, elements, ops = order_collective(lay.context_attention, seq=w.seq,
                                           context=lay.context)
    if ops:
        t.add(kind, rows * elements * 4, ops)                   # int32
    st = lay.strategy
    fsdp = st.fsdp and lay.data > 1
    whole = lay.unsharded_over_data().strategy.rules
    grads = 0
    opts = leaf_elements(cfg, st.optimizer_rules, lay.sizes)   # at the optimizer's (ZeRO-1)
    fulls = leaf_elements(cfg, whole, lay.sizes)               # sharding
    for i, (path, _, _) in enumerate(param_leaves(cfg)):
        if not trained(w, path):
            continue
        opt = opts[i]
        table = path.startswith("embed/") and opt < fulls[i]
        grads += fulls[i] if table else opt
    t.add("all-reduce", grads * FP32)
    if fsdp and not fsdp_gathers_table(w, lay):    # the exchanged lookup's output
        t.add("all-gather", rows * w.seq * cfg.embed_dim * w.dtype_bytes)


def _moe_buffer(w: Workload, lay: Layout) -> float:
    """Bytes of one device's MoE capacity buffers (E·C slots of D per sequence), as
    models.moe / sharding.experts build them."""
    seq = w.seq if w.train else 1
    slots = w.cfg.moe.num_experts * capacity(w.cfg.moe, seq)
    return w.batch / lay.batch_shards * slots * w.cfg.embed_dim * w.dtype_bytes


def _tensor_axis(w: Workload, lay: Layout, t: AxisTraffic, act: float, layers: int,
                 passes: int) -> None:
    """Megatron: per block, forward all-reduces the attention and MLP outputs; backward
    all-reduces the input gradients of q, k and v (three buffers: the projections are
    separate weights; k's and v's at their own width when KV heads are replicated) and of
    the MLP input (one buffer: gate/up are fused). An MoE block's
    expert FFN does the same on its capacity buffers (gate and up separate: two backward).
    Plus the vocab-parallel embedding (forward) and the head's input gradient (backward)."""
    train = 1 if w.train else 0
    if lay.tp_overlap:
        _overlapped_tensor(w, lay, t, act, layers, passes)
        return
    # KV heads that tensor does not divide are replicated: each rank's k and v gradients are
    # partial sums over its own query heads, all-reduced at their own width (tokens·K·H)
    # before the replicated projections' backward, not at the residual's (tokens·D).
    K, H = w.cfg.num_kv_heads, w.cfg.head_dim
    replicated = tensor_local("act_kv_heads", K, lay.tensor, lay.strategy.rules) == K
    kv = act * K * H / w.cfg.embed_dim if replicated else act
    t.add("all-reduce", kv, 2 * train * layers)   # the input gradients of k and v
    if w.lora is not None:
        _lora_tensor(w, lay, t, act, layers)
    if w.cfg.moe is None:
        t.add("all-reduce", act, (2 + 2 * train) * layers + passes)
        return
    t.add("all-reduce", act, (1 + train) * layers + passes)
    t.add("all-reduce", _moe_buffer(w, lay), (1 + 2 * train) * layers)


def _overlapped_tensor(w: Workload, lay: Layout, t: AxisTraffic, act: float, layers: int,
                       passes: int) -> None:
    """``--tp-overlap`` (``sharding.collective_matmul``): each of a block's projections into
    and out of the residual stream is a ring of ``n − 1`` permutes of one sequence chunk
    (``act / n``), in the forward and again (transposed) in the backward: four rings per
    pass for a dense block, two for an MoE block's attention (its expert FFN reduces as
    without). q, k and v share one ring each way, so the k/v input gradients need no
    all-reduce of their own, unless ``tensor`` does not divide the KV heads (replicated
    K/V: their gradients are still summed at their own width). The vocab-parallel
    embedding and the head's input gradient still all-reduce."""
    n = lay.tensor
    train = 1 if w.train else 0
    rings = 2 if w.cfg.moe is not None else 4
    t.add("collective-permute", act / n, (n - 1) * rings * passes * layers)
    K, H = w.cfg.num_kv_heads, w.cfg.head_dim
    if tensor_local("act_kv_heads", K, n, lay.strategy.rules) == K:
        t.add("all-reduce", act * K * H / w.cfg.embed_dim, 2 * train * layers)
    if w.cfg.moe is not None:
        t.add("all-reduce", _moe_buffer(w, lay), (1 + 2 * train) * layers)
    t.add("all-reduce", act, passes)


def _lora_tensor(w: Workload, lay: Layout, t: AxisTraffic, act: float, layers: int) -> None:
    """The adapters' own all-reduces over ``tensor``, one ``tokens × rank`` buffer each,
    where the rules split a factor over ``tensor`` (``Rules.splits_over``): an ``A`` (a
    row-parallel base: its input split) sums ``x·A`` per forward (a remat's recomputed
    forward too); a ``B`` (column-parallel: its output split) sums the backward's ``dy·Bᵀ``
    (KV heads that ``tensor`` does not divide are whole: k's and v's sum nothing)."""
    rank = act / w.cfg.embed_dim * w.lora.rank          # one tokens × rank buffer's bytes
    forwards = 2 if w.train and w.remat != "none" else 1
    rules = layout_rules(w, lay)
    for path, shape, logical in param_leaves(w.cfg):
        leaf = pair_leaf(path.split("/"))
        if leaf is None or not rules.splits_over(logical, shape, lay.sizes, "tensor"):
            continue
        if leaf[1] == "a":
            t.add("all-reduce", rank, forwards * layers)
        elif w.train:
            t.add("all-reduce", rank, layers)


def _pipe_axis(w: Workload, lay: Layout, t: AxisTraffic, act: float, passes: int) -> None:
    """Stage-to-stage permutes of one micro-batch's activations (forward) and their
    gradients (backward). triax.pipeline's executor permutes every tick of its table, idle
    or not (DualPipeV, whose F&B sends two messages, each buffer both ways); without the table, each micro-batch crosses each boundary once per pass
    (v times when interleaved). Training also all-reduces the gradients of parameters
    that every stage holds (embedding, head, final norm) over ``pipe``."""
    M = max(lay.microbatches, 1)
    table = schedule_table(lay.schedule, lay.pipe, M, lay.virtual)
    sends = table.ticks if table is not None else M * lay.virtual
    if table is not None and table.sends_two:   # F&B: each buffer goes both ways per tick
        sends *= 2
    t.add("collective-permute", act / M, sends * passes)
    rules = lay.strategy.rules
    if routed(w.cfg.num_layers, lay.pipe, lay.virtual):
        # Interleaved and ZB-V: each step moves chunks from their storage stage to the stage that runs
        # them (and their gradients back), one chunk per device per moving round.
        elems = leaf_elements(w.cfg, rules, lay.sizes)
        chunk = sum(elems[i] for i, (p, _, _) in enumerate(param_leaves(w.cfg))
                    if p.startswith("blocks/")) * FP32 / lay.virtual   # fp32 masters, grads
        v_shape = lay.schedule is not None and lay.schedule.v_shape
        t.add("collective-permute", chunk,
              moving_rounds(lay.pipe, lay.virtual, v_shape) * passes)
    if w.train:   # summed over pipe whole over data, before FSDP's reduce-scatter
        whole = lay.unsharded_over_data().strategy.rules
        elems = leaf_elements(w.cfg, whole, lay.sizes)
        shared = sum(elems[i] for i, (p, _, _) in enumerate(param_leaves(w.cfg))
                     if not p.startswith("blocks/") and trained(w, p))
        if shared:
            t.add("all-reduce", shared * FP32)


def _other_batch_axes(w: Workload, lay: Layout, out: dict) -> None:
    """Batch axes besides ``data`` (the MoE rules split the batch over ``expert`` too): each
    gradient is all-reduced over those of them its parameter is not split over."""
    rules = lay.strategy.rules
    for axis in rules.mesh_axes("batch"):
        if axis == "data" or axis not in out:
            continue
        elems = leaf_elements(w.cfg, rules, lay.sizes)
        total = sum(elems[i] for i, (p, _, l) in enumerate(param_leaves(w.cfg))
                    if not any(axis in rules.mesh_axes(n) for n in l) and trained(w, p))
        out[axis].add("all-reduce", total * FP32)


def _data_axis(w: Workload, lay: Layout, t: AxisTraffic) -> None:
    """Gradient reduction (DP), plus parameter gathers (ZeRO-1 after the update; FSDP in
    the forward and again in the backward). Under LoRA only the adapters' gradients are
    reduced and only they are gathered after a ZeRO-1 update."""
    st = lay.strategy
    sharded_opt = "data" in st.optimizer_rules.mesh_axes("embed")
    # this replica's trained params (all of them, or the LoRA adapters)
    full = local_param_elements(w, lay.unsharded_over_data(), part=_trained_part(w))
    if not sharded_opt:
        t.add("all-reduce", full * FP32)
    elif w.cfg is None:                     # a --params estimate: every leaf split
        t.add("reduce-scatter", full * FP32)
        t.add("all-gather", full * w.dtype_bytes, 2 if st.fsdp else 1)
    elif not st.fsdp:                       # ZeRO-1, by leaf
        _zero1(w, lay, t)
    else:
        _fsdp(w, lay, t)


def _zero1(w: Workload, lay: Layout, t: AxisTraffic) -> None:
    """ZeRO-1: a trained leaf the optimizer rules split over ``data`` has its gradient
    reduce-scattered and its update gathered; one they keep whole (a norm scale, an
    adapter's rank-by-heads B) is all-reduced."""
    opt = lay.strategy.optimizer_rules
    whole = lay.unsharded_over_data().strategy.rules
    fulls, locals_ = (leaf_elements(w.cfg, r, lay.sizes) for r in (whole, opt))
    for i, (path, _, _) in enumerate(param_leaves(w.cfg)):
        if not trained(w, path):
            continue
        full = fulls[i]
        if locals_[i] < full:
            t.add("reduce-scatter", full * FP32)
            t.add("all-gather", full * w.dtype_bytes)
        else:
            t.add("all-reduce", full * FP32)


def fsdp_gathers_table(w: Workload, lay: Layout) -> bool:
    """XLA's choice for the FSDP-split embedding lookup, as the compiled HLO shows it: the
    table is gathered over ``data`` when it is smaller than the lookup's output for the
    replica's sequences (B/data · T · D); otherwise the activations are exchanged (tiny:
    exchanged at 2 × 32 and 2 × 128 tokens, gathered at 2 × 256 and 2 × 512)."""
    tokens = w.batch / lay.batch_shards * w.seq
    return w.cfg.vocab_size < tokens


def _fsdp(w: Workload, lay: Layout, t: AxisTraffic) -> None:
    """FSDP by parameter: block weights are gathered in the forward and again in the
    backward (the layer scan frees them), the head once (a pipeline gathers every leaf once
    per step, ``pipeline.fsdp``); every gradient but the embedding
    table's is reduce-scattered. The embedding table stays split over ``embed``: the
    lookup's activations are exchanged instead (an all-to-all each way), or, where the table
    is the smaller (``fsdp_gathers_table``), the table is gathered for the forward and the
    backward and its gradient all-reduced. A frozen LoRA base leaf is gathered the same but
    reduces no gradient, and a frozen table moves only in the forward."""
    sharded = lay.strategy.rules
    whole = lay.unsharded_over_data().strategy.rules
    fulls, locals_ = (leaf_elements(w.cfg, r, lay.sizes) for r in (whole, sharded))
    for i, (path, _, _) in enumerate(param_leaves(w.cfg)):
        full = fulls[i]
        split = locals_[i] < full
        grad = 1 if trained(w, path) else 0      # a frozen LoRA base leaf reduces nothing
        if pipelined_fsdp(w, lay, "layer") and split and path.startswith("blocks/"):
            gathers, scatters = layer_passes(lay.schedule.split_backward, lay.microbatches)
            t.add("all-gather", full * FP32, gathers)     # per layer per op (pipeline.fsdp)
            t.add("reduce-scatter", full * FP32, scatters * grad)
            continue
        if pipelined_fsdp(w, lay) or pipelined_fsdp(w, lay, "layer"):   # every fp32 leaf
            t.add("reduce-scatter" if split else "all-reduce", full * FP32, grad)
            if split:                                            # gathered once per step,
                t.add("all-gather", full * FP32)                 # outside the ticks
            continue
        if path.startswith("embed/"):
            if fsdp_gathers_table(w, lay):
                t.add("all-gather", full * w.dtype_bytes, 1 + grad)
                t.add("all-reduce", full * FP32, grad)
                continue
            tokens = w.batch / lay.batch_shards * w.seq
            t.add("all-to-all", tokens * w.cfg.embed_dim * w.dtype_bytes, 1 + grad)
            continue
        t.add("reduce-scatter" if split else "all-reduce", full * FP32, grad)
        if split:   # under fp8 a projection weight is gathered as its e4m3 bytes
            t.add("all-gather", full * gather_bytes(w, path),
                  2 if path.startswith("blocks/") else 1)


# ---- placement on links ------------------------------------------------------------------
INNER_TO_OUTER = tuple(reversed(AXES))   # tensor innermost, then context, expert, pipe, data


def axis_links(lay: Layout, cluster: Cluster) -> dict[str, Link]:
    """Which link each mesh axis runs on: an axis stays in a node when it and every axis
    inside it fit in ``gpus_per_node`` (the mesh puts ``tensor`` innermost)."""
    links, span = {}, 1
    for a in INNER_TO_OUTER:
        span *= lay.sizes[a]
        inside = span <= cluster.gpus_per_node and cluster.gpus_per_node % span == 0
        links[a] = cluster.intra if inside else cluster.inter
    return links


def _hops(t: AxisTraffic, kinds) -> int:
    """Latencies paid by ``t``'s messages of ``kinds``: a ring collective's n−1 hops each,
    a permute's one (it goes to one neighbour)."""
    return sum(c * (1 if k == "collective-permute" else t.size - 1)
               for k, c in t.messages_by_kind.items() if k in kinds)


def comm_seconds(traffic_by_axis: dict[str, AxisTraffic], links: dict[str, Link],
                 efficiency: float) -> dict[str, float]:
    """Wire bytes over achieved bandwidth, plus a latency per hop (ring: n−1 per message,
    a permute one)."""
    return {a: t.wire / (links[a].bandwidth * efficiency)
            + _hops(t, KINDS) * links[a].latency
            for a, t in traffic_by_axis.items()}


def kind_seconds(t: AxisTraffic, link: Link, efficiency: float, kinds) -> float:
    """The part of ``comm_seconds`` for one axis that collectives of ``kinds`` take (their
    wire bytes and messages)."""
    wire = sum(_WIRE[k](t.size) * b for k, b in t.payload_by_kind.items() if k in kinds)
    return wire / (link.bandwidth * efficiency) + _hops(t, kinds) * link.latency


def crossing_axes(lay: Layout, cluster: Cluster) -> list[str]:
    links = axis_links(lay, cluster)
    return [a for a in INNER_TO_OUTER if lay.sizes[a] > 1 and links[a] is cluster.inter
            and cluster.nodes > 1]
