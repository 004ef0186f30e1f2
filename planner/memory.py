"""Per-device memory, term by term: parameters, gradients, optimizer, activations, KV cache.

Parameter-shaped terms are exact: they walk the model's real parameter tree
(``sharding.partition.abstract_model``: shapes and logical axes, no allocation) and resolve
every leaf through the strategy's rules for the given mesh sizes, as ``param_shardings``
does, without needing that many devices. A ``--params N`` estimate (no config) shards the
whole count over the axes that would hold it.

    >>> from triax.models import config
    >>> from triax.planner.workload import Layout, Workload
    >>> w = Workload.of(config.get("tiny"), train=True, dtype="fp32", batch=8, seq=16)
    >>> m = estimate(w, Layout(data=8))
    >>> m.params == config.get("tiny").num_params * 4
    True
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import asdict, dataclass
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from triax.models.attention_memory import AttentionMemory, attention_memory, kernel_for
from triax.models.config import ModelConfig
from triax.models.layers import ExecConfig
from triax.models.moe import MoE
from triax.models.transformer import REMAT_POLICIES
from triax.planner.pipeline_math import peak_in_flight
from triax.planner.workload import Layout, Workload, ceil_div, prod
from triax.sharding.partition import abstract_model, path_str
from triax.pipeline import ScheduleKind
from triax.pipeline.buffer_sizes import activation_buffer_bytes
from triax.pipeline.jaxpr_split import reads
from triax.pipeline.pipelined import PipelineConfig
from triax.pipeline.stage_layers import StageLayers, pipeline_strategy
from triax.sharding.context_costs import scheme_memory
from triax.sharding.experts import varying_weight_axes
from triax.sharding.rules import Rules, get_strategy
from triax.training.config import PRECISIONS

ADAM_MOMENTS = 2        # mu and nu, fp32
FP32 = 4


@dataclass(frozen=True)
class Assumptions:
    """Stated constants of the model (reported with every plan)."""

    overhead_bytes: float = 2e9        # CUDA/NCCL context, allocator slack, per device
    overhead_frac: float = 0.05        # fragmentation, as a fraction of the modelled terms
    compute_efficiency: float = 0.45   # achieved / peak FLOP/s for the matmuls
    comm_efficiency: float = 0.8       # achieved / nominal link bandwidth
    data_overlap: float = 0.5          # DP/FSDP traffic hidden under this share of compute

    def describe(self) -> str:
        return (f"compute at {self.compute_efficiency:.0%} of peak, links at "
                f"{self.comm_efficiency:.0%} of nominal, DP/FSDP traffic overlapping "
                f"{self.data_overlap:.0%} of compute, TP/PP/EP traffic exposed, overhead "
                f"{self.overhead_bytes / 1e9:g} GB + {self.overhead_frac:.0%} per device")


@dataclass(frozen=True)
class Memory:
    """Bytes per device, by term. ``total`` includes ``overhead``."""

    params: float
    grads: float
    optimizer: float
    activations: float
    kv_cache: float
    overhead: float
    block_weights: float = 0.0  # one block's weights made ready for compute (see estimate)

    @property
    def modelled(self) -> float:
        """Everything but the overhead: what XLA's memory_analysis sees."""
        return (self.params + self.grads + self.optimizer + self.activations + self.kv_cache
                + self.block_weights)

    @property
    def total(self) -> float:
        return self.modelled + self.overhead

    def as_dict(self) -> dict:
        return {**{k: int(v) for k, v in asdict(self).items()}, "total": int(self.total)}


# ---- the parameter tree -------------------------------------------------------------------
Leaf = tuple[str, tuple[int, ...], tuple]   # (path, shape, logical axes)


@functools.lru_cache(maxsize=32)
def param_leaves(cfg: ModelConfig) -> tuple[Leaf, ...]:
    """(path, shape, logical axes) for every parameter of the real model."""
    am = abstract_model(cfg)
    flat = jax.tree_util.tree_flatten_with_path(am.shapes)[0]
    logical = jax.tree.leaves(am.logical, is_leaf=lambda x: isinstance(x, tuple))
    return tuple((path_str(p), tuple(s.shape), tuple(l)) for (p, s), l in zip(flat, logical))


def local_elements(shape, logical, rules: Rules, sizes: dict[str, int]) -> int:
    """Elements of one parameter on one device: its shape divided as ``Rules.spec`` places
    it on a mesh of ``sizes`` (the placement the step compiles with)."""
    return _local_elements(tuple(shape), tuple(logical), rules, tuple(sorted(sizes.items())))


@functools.lru_cache(maxsize=1 << 16)   # the search asks the same leaf on the same mesh often
def _local_elements(shape, logical, rules: Rules, items) -> int:
    sizes = dict(items)
    spec = rules.spec(logical, shape, sizes)
    n = 1
    for i, dim in enumerate(shape):
        e = spec[i] if i < len(spec) else None
        n *= dim // prod(sizes[a] for a in ((e,) if isinstance(e, str) else e or ()))
    return n


def layout_rules(w: Workload, lay: Layout, optimizer: bool = False) -> Rules:
    """The rules the step places parameters with: the strategy's, as the pipeline adapts
    them for ``pipe`` (``pipeline_strategy``: an uneven layer count keeps every layer on
    every stage)."""
    st = get_strategy(lay.strategy)
    if lay.pipe > 1 and w.cfg is not None:
        st = pipeline_strategy(st, w.cfg.num_layers, lay.pipe)
    return st.optimizer_rules if optimizer else st.rules


def local_param_elements(w: Workload, lay: Layout, optimizer: bool = False) -> int:
    """Per-device parameter elements under the strategy's (or optimizer's) rules."""
    rules = layout_rules(w, lay, optimizer)
    if w.cfg is None:   # quick estimate: shard the count over the axes that would hold it
        shards = lay.pipe
        if "tensor" in rules.mesh_axes("mlp"):
            shards *= lay.tensor
        if "data" in rules.mesh_axes("embed"):
            shards *= lay.data
        return ceil_div(w.params, shards)
    return sum(local_elements(s, l, rules, lay.sizes) for _, s, l in param_leaves(w.cfg))


# ---- activations --------------------------------------------------------------------------
_TP_RULES = get_strategy("tp").rules


def tensor_local(logical: str, n: int, tensor: int) -> int:
    """``n`` (a head count, an MLP width named ``logical``) on one of ``tensor`` ranks, as
    the rules place it (``Rules.local_size``): split, whole for KV heads that ``tensor``
    does not divide (replicated), a ShardingError for query heads or a width it does not."""
    return _TP_RULES.local_size(logical, n, {"tensor": tensor})


def layer_activation_elements(cfg: ModelConfig, tokens: int, seq: int, tensor: int,
                              remat: str, residual_split: int = 1,
                              attention: Optional[float] = None) -> float:
    """Elements one block saves for its backward pass, for ``tokens`` tokens on a device.

    No remat: norm inputs/outputs and residuals (~6·D), q/k/v around rope, the kernel's
    operands and the attention output (5·N·H + 3·K·H, whatever the kernel), what the
    attention kernel keeps beyond (``attention``, per token: ``attention_per_token``; None:
    the reference kernel on the whole sequence, its scores and probabilities, 2·N·T;
    ``models.attention_memory``), SwiGLU's fused gate/up, silu, product and its input
    (5·F); TP divides everything but the D-sized terms.
    (Coefficients checked against memory_analysis of tiny and small; see docs/planner.md.)
    MoE: SwiGLU's term is replaced by what ``models.moe`` keeps, traced, not a coefficient
    (:func:`moe_residual_elements`).
    ``full`` keeps only the block input (D); ``dots`` keeps the matmul outputs.
    ``tokens`` are the device's own (under context parallelism T/C of each sequence).
    ``residual_split`` (``residual_split(rules, sizes)``: the tensor degree under sequence
    parallelism, else 1) divides the residual stream's terms: the two residuals, the
    attention and MLP outputs (reduce-scattered), the remat block input; the norm outputs
    are gathered whole for the column-parallel matmuls, which save them.
    """
    D, N, K, H = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    nh = tensor_local("act_heads", N, tensor) * H
    kh = tensor_local("act_kv_heads", K, tensor) * H
    if attention is None:
        attention = attention_memory("reference", queries=seq, keys=seq,
                                     heads=tensor_local("act_heads", N, tensor),
                                     kv_heads=tensor_local("act_kv_heads", K, tensor),
                                     head_dim=H, remat=remat).saved / seq
    r = residual_split
    if remat == "full":
        return D / r * tokens
    if cfg.moe is None:
        f = cfg.mlp_dim / tensor
        ffn, ffn_dots = 5 * f, 3 * f
    else:   # what models.moe keeps, traced: its capacity buffers, routing and combine
        ffn = moe_residual_elements(cfg, seq, tensor, "none")
        ffn_dots = moe_residual_elements(cfg, seq, tensor, remat) if remat != "none" else ffn
    if remat in ("dots", "dots_no_batch"):
        per_token = 2 * D / r + 2 * nh + 2 * kh + attention + ffn_dots
    else:   # the two norm outputs are gathered for the column-parallel matmuls: whole
        per_token = 2 * D + 4 * D / r + 5 * nh + 3 * kh + attention + ffn
    return per_token * tokens


@functools.lru_cache(maxsize=64)
def moe_residual_elements(cfg: ModelConfig, seq: int, tensor: int, remat: str) -> float:
    """Elements per token one MoE layer keeps for its backward on a device: the residuals of
    ``models.moe.MoE``'s ``jax.vjp`` that its pullback reads (XLA drops the rest), less the
    layer's input and weights; traced on abstract shapes (``jax.eval_shape``, nothing is
    allocated), one sequence of ``seq`` tokens, under ``remat``'s checkpoint policy.

    Per capacity slot (E·C/T per token) that is the expert input (D) and SwiGLU's six
    F_e-wide intermediates; per token the top_k routed outputs for the combine (top_k·D), the
    router logits and probabilities (2·E) and the routing indices. The expert FFN's width is
    split over ``tensor`` (the rules' ``expert_mlp``); the token buffers are whole on each
    tensor rank. Under expert parallelism a device's buffers hold its own sequences' slots,
    so the local trace is the device's (the all-to-all moves them, not their size)."""
    moe = cfg.moe
    fe = moe.mlp_dim or cfg.mlp_dim
    local = cfg.replace(moe=dataclasses.replace(moe, mlp_dim=tensor_local("expert_mlp", fe, tensor)))
    gd, state = nnx.split(nnx.eval_shape(lambda: MoE(local, nnx.Rngs(0))))
    x = jax.ShapeDtypeStruct((1, seq, cfg.embed_dim), jnp.float32)
    layer = lambda st, x: nnx.merge(gd, st)(x, jnp.float32)  # noqa: E731
    if REMAT_POLICIES[remat] is not None:
        layer = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
    info = {}

    def residuals(st, x):
        out, pullback = jax.vjp(layer, st, x)
        leaves, info["tree"] = jax.tree.flatten(pullback)
        inputs = {id(a) for a in jax.tree.leaves((st, x))}
        info["stored"] = [id(a) not in inputs for a in leaves]
        info["cts"] = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), out)
        return leaves
    leaves = jax.eval_shape(residuals, state, x)
    read = reads(lambda ls, ct: jax.tree.unflatten(info["tree"], ls)(ct), leaves, info["cts"])
    return sum(math.prod(a.shape) for a, kept, r in zip(leaves, info["stored"], read)
               if kept and r) / seq


def _expert_weight_copies(w: Workload, lay: Layout) -> float:
    """Elements per layer of the expert weights the MoE runner marks per-shard over the
    batch axes besides ``expert`` (``sharding.experts.varying_weight_axes``): a new value per
    layer, which the layer scan keeps for the backward, so each layer's device-local expert
    weights are stored once more. Not under a pipeline (its ``shard_map`` owns those axes)
    nor under remat (the checkpointed layer recomputes them)."""
    rules = get_strategy(lay.strategy).rules
    if w.cfg.moe is None or lay.pipe > 1 or w.remat != "none" \
            or not varying_weight_axes(rules, lay.sizes):
        return 0.0
    whole = layout_rules(w, lay.unsharded_over_data())   # as gathered, under FSDP
    return sum(local_elements(s[1:], l[1:], whole, lay.sizes)
               for p, s, l in param_leaves(w.cfg) if p.startswith("blocks/") and "experts" in l)


def residual_split(rules: Rules, sizes: dict[str, int]) -> int:
    """Pieces one residual-stream activation (``res_seq``) is cut into along the sequence
    beyond the sequence's own split (``seq``, over ``context``): the tensor degree under
    sequence parallelism, else 1."""
    return rules.split_size("res_seq", sizes) // rules.split_size("seq", sizes)


def attention_kernel(w: Workload, lay: Layout) -> str:
    """The attention kernel the step runs (``models.attention_memory.kernel_for``): the
    workload's implementation on its backend; a context-parallel step's local blocks are not
    plain causal, so ``dot_product`` takes XLA's path there, never cuDNN's."""
    context = get_strategy(lay.strategy).rules.split_size("seq", lay.sizes)
    return kernel_for(w.attention, w.backend, PRECISIONS[w.dtype], w.cfg.head_dim,
                      plain_causal=context == 1)


def attention_per_token(w: Workload, lay: Layout, remat: str) -> AttentionMemory:
    """What one layer's attention keeps per local token: the kernel on the whole sequence,
    or under context parallelism the scheme's figures (``sharding.context_costs``)."""
    cfg = w.cfg
    context = get_strategy(lay.strategy).rules.split_size("seq", lay.sizes)
    m = scheme_memory(lay.context_attention, attention_kernel(w, lay), seq=w.seq,
                      context=context, heads=tensor_local("act_heads", cfg.num_heads, lay.tensor),
                      kv_heads=tensor_local("act_kv_heads", cfg.num_kv_heads, lay.tensor),
                      head_dim=cfg.head_dim,
                      remat=remat)
    queries = w.seq / context
    return AttentionMemory(m.saved / queries, m.transient / queries)


def activation_bytes(w: Workload, lay: Layout) -> float:
    """Saved activations on the busiest device: its layers × micro-batches in flight, plus
    one block's backward working set (its recomputed or saved internals and their
    gradients, and what its attention holds only while it runs), plus the fp32 logits,
    log-probabilities and their gradient. Under context parallelism every token-wise term
    is the device's T/C tokens of each sequence (the rules split ``seq`` over ``context``).
    """
    cfg = w.cfg
    if cfg is None or not w.train:
        return 0.0 if cfg is None else _inference_activations(w, lay)
    rules = get_strategy(lay.strategy).rules
    local_batch = w.batch / lay.batch_shards
    mb_tokens = local_batch / max(lay.microbatches, 1) * w.seq / rules.split_size("seq",
                                                                                  lay.sizes)
    split = residual_split(rules, lay.sizes)
    attn = attention_per_token(w, lay, "none")
    working = layer_activation_elements(cfg, mb_tokens, w.seq, lay.tensor, "none", split,
                                        attn.saved) + attn.transient * mb_tokens
    logits = logits_bytes(w, lay) / w.dtype_bytes
    if lay.pipe > 1:
        return pipeline_buffer_bytes(w, lay) + (working + logits) * w.dtype_bytes
    in_flight = peak_in_flight(lay.schedule, lay.pipe, lay.microbatches, lay.virtual)
    per_layer = layer_activation_elements(cfg, mb_tokens, w.seq, lay.tensor, w.remat, split,
                                          attention_per_token(w, lay, w.remat).saved)
    saved = cfg.num_layers * (per_layer * in_flight + _expert_weight_copies(w, lay)) + working
    return (saved + logits) * w.dtype_bytes


def loss_tokens(w: Workload, lay: Layout, chunks: Optional[int] = None) -> float:
    """Tokens whose logits are alive at once on a device: its micro-batch's share of the
    sequence, over ``chunks`` (default ``w.loss_chunks``) slices of it (models.loss)."""
    rules = get_strategy(lay.strategy).rules
    rows = w.batch / lay.batch_shards / max(lay.microbatches, 1)
    return rows * w.seq / rules.split_size("seq", lay.sizes) / (chunks or w.loss_chunks)


def logits_bytes(w: Workload, lay: Layout, chunks: Optional[int] = None) -> float:
    """The fp32 logits, log-probabilities and their gradient of ``loss_tokens``, the vocab
    split over ``tensor``. A chunked loss adds the head's weight gradient: the loop carries
    it in fp32 beside each slice's own product, where the whole sequence's loss writes it
    once."""
    chunks = chunks or w.loss_chunks
    head = 0.0 if chunks == 1 else FP32 * w.cfg.embed_dim * w.cfg.vocab_size / lay.tensor
    return 3 * loss_tokens(w, lay, chunks) * w.cfg.vocab_size / lay.tensor * FP32 + head


def pipeline_buffer_bytes(w: Workload, lay: Layout) -> float:
    """The pipeline executor's activation buffers on one stage, asked of the executor
    (``pipeline.buffer_sizes.activation_buffer_bytes``: the schedule's slot counts × the traced
    residual shapes, nothing allocated), and the residual set an op's layer loop
    materialises beside them when a chunk holds several layers (``loop``). The residuals are
    traced whole over ``tensor``; XLA splits them over it as it splits the layer's weights,
    so they are divided by ``tensor`` (the activations passed between stages are not
    split)."""
    sched = lay.schedule or ScheduleKind.ONE_F_ONE_B
    config = PipelineConfig(sched.value, lay.microbatches, lay.virtual)
    rows = ceil_div(w.batch // lay.batch_shards, config.num_microbatches(lay.pipe))
    exe = ExecConfig(PRECISIONS[w.dtype], w.remat)
    buf = activation_buffer_bytes(w.cfg, lay.pipe, config, exe, rows, w.seq)   # cached there
    return (buf["stash"] + buf["loop"]) / lay.tensor + buf["inbox"]


def _inference_activations(w: Workload, lay: Layout) -> float:
    """Forward only: one block's working set and the last position's logits."""
    cfg = w.cfg
    tokens = w.batch / lay.batch_shards * w.seq / max(lay.microbatches, 1)
    one = layer_activation_elements(cfg, tokens, w.seq, lay.tensor, "none")
    return (one + w.batch / lay.batch_shards * cfg.vocab_size / lay.tensor) * w.dtype_bytes


def kv_cache_bytes(w: Workload, lay: Layout) -> float:
    """Layers × 2 (K and V) × kv_heads × head_dim × sequence × batch × bytes, per device."""
    cfg = w.cfg
    if cfg is None or w.train:
        return 0.0
    layers = ceil_div(cfg.num_layers, lay.pipe)
    kv = tensor_local("act_kv_heads", cfg.num_kv_heads, lay.tensor) * cfg.head_dim
    return layers * 2 * kv * w.seq * (w.batch / lay.batch_shards) * w.dtype_bytes


# ---- the whole picture ---------------------------------------------------------------------
def estimate(w: Workload, lay: Layout, assume: Optional[Assumptions] = None) -> Memory:
    """Per-device memory for the workload on the layout (raises ShardingError if the
    strategy's rules cannot split the model over the mesh)."""
    assume = assume or Assumptions()
    p_local = local_param_elements(w, lay)
    if w.train:
        o_local = local_param_elements(w, lay, optimizer=True)
        # triax trains fp32 parameters; under mixed precision they *are* the fp32 master
        # weights and each block is cast to bf16/fp16 as it runs (block_weights below).
        # Gradients are fp32 and follow the optimizer's sharding (ZeRO-1 shards them), plus
        # one block's gradient before its reduction (a pipeline's B: its chunk's). AdamW: mu
        # and nu in fp32.
        params = p_local * FP32
        # Pipelined FSDP accumulates the stage's gradients whole over ``data`` in the tick
        # loop and reduce-scatters them once per step (``pipeline.fsdp.FSDP.reduce``).
        acc = local_param_elements(w, lay.unsharded_over_data()) if pipelined_fsdp(w, lay) \
            else o_local
        grads = acc * FP32 + _fresh_grad_elements(w, lay) * FP32
        optimizer = o_local * FP32 * ADAM_MOMENTS + 16     # + step counters
    else:
        params, grads, optimizer = p_local * w.dtype_bytes, 0.0, 0.0
    acts = activation_bytes(w, lay)
    kv = kv_cache_bytes(w, lay)
    block = _block_weights(w, lay, p_local)
    modelled = params + grads + optimizer + acts + kv + block
    overhead = assume.overhead_bytes + assume.overhead_frac * modelled
    return Memory(params, grads, optimizer, acts, kv, overhead, block)


def _block_weights(w: Workload, lay: Layout, p_local: int) -> float:
    """FSDP: one block's weights gathered over ``data`` (a pipelined stage: all its weights);
    mixed precision: one block's compute-dtype copy of the local fp32 weights."""
    if not w.train or w.cfg is None:
        return 0.0
    if pipelined_fsdp(w, lay):   # the stage's weights, gathered once per step (pipeline.fsdp)
        return local_param_elements(w, lay.unsharded_over_data()) * FP32
    if get_strategy(lay.strategy).fsdp and lay.data > 1:
        return _block_grad_elements(w, lay) * w.dtype_bytes
    if w.mixed:
        return p_local / w.cfg.num_layers * w.dtype_bytes
    return 0.0


def pipelined_fsdp(w: Workload, lay: Layout) -> bool:
    """A pipelined step under FSDP: the executor gathers the whole stage over ``data`` once
    per step, outside the tick loop, rather than one block at a time."""
    return lay.pipe > 1 and w.cfg is not None and get_strategy(lay.strategy).fsdp \
        and lay.data > 1


def _block_grad_elements(w: Workload, lay: Layout) -> int:
    """One block's parameters, whole over ``data``: its gradient before the reduction (the
    backward's working set) and, under FSDP, its gathered weights."""
    if w.cfg is None:
        return 0
    rules = layout_rules(w, lay.unsharded_over_data())
    return sum(local_elements(s[1:], l[1:], rules, lay.sizes)   # one layer of the stack
               for p, s, l in param_leaves(w.cfg) if p.startswith("blocks/"))


def _fresh_grad_elements(w: Workload, lay: Layout) -> int:
    """The gradient a backward produces before adding it up: one block's (the layer scan's
    iteration), or with a pipeline B's whole chunk's (its layer loop emits the chunk's
    stacked gradients, which the executor then adds into the stage's accumulator)."""
    blocks = 1
    if lay.pipe > 1 and w.cfg is not None:
        blocks = StageLayers(w.cfg.num_layers, lay.pipe, lay.virtual).per_chunk
    return blocks * _block_grad_elements(w, lay)


def min_devices_for_weights(w: Workload, device_memory: float) -> int:
    """Devices of this kind needed just to hold the weights (in the workload's dtype)."""
    return max(1, ceil_div(int(w.weight_bytes), int(device_memory)))
