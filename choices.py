"""The named choices of a run, in one JAX-free home: rules, models, ``RunConfig``, the CLI and
the planner import them (the CLI builds its parser before JAX may start, so nothing here
imports JAX).

    >>> from triax import choices
    >>> choices.check("strategy", "fsdp_tp", choices.STRATEGIES)
    'fsdp_tp'
    >>> choices.check("remat", "dots_all", choices.REMAT_POLICIES)
    Traceback (most recent call last):
    ...
    ValueError: --remat 'dots_all': choose one of none, full, dots, dots_no_batch
    >>> choices.PRECISION_BYTES["bf16"]
    2
"""
from __future__ import annotations

import functools
from typing import Iterable

# Parallelism strategies (``triax.sharding.rules.StrategyKind`` names their rules tables).
STRATEGIES = ("dp", "fsdp", "zero1", "tp", "fsdp_tp", "tp_sp", "fsdp_tp_sp")
# The strategy each FSDP flavour becomes when its ``data`` split is taken away (the
# unsharded-weights twin, e.g. inside a pipeline stage or for the planner's base terms).
FSDP_BASE = {"fsdp": "dp", "fsdp_tp": "tp", "fsdp_tp_sp": "tp_sp"}

# FSDP inside a pipeline stage (``triax.pipeline.fsdp``): ``stage`` gathers the stage's
# weights over ``data`` once per step and accumulates their gradients whole; ``layer`` gathers
# each layer when an op runs it and reduce-scatters its gradient as it is made; ``auto`` is
# resolved by the memory check (``training.setup.pipeline_fsdp_for``).
PIPELINE_FSDP_MODES = ("stage", "layer")
PIPELINE_FSDP_CHOICES = ("auto", *PIPELINE_FSDP_MODES)

# Activation checkpointing policies (``triax.models.transformer.REMAT_POLICIES`` maps them
# onto ``jax.checkpoint_policies``).
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")

# Local attention kernels; ``auto`` is resolved per backend (``models.attention.resolve``).
ATTENTION_KERNELS = ("reference", "blockwise", "dot_product")
ATTENTION_CHOICES = ("auto", *ATTENTION_KERNELS)

# Attention across the ``context`` mesh axis (``triax.sharding.context``).
CONTEXT_SCHEMES = ("all-gather", "ring")

# Precision names -> compute dtype (parameters stay fp32: bf16/fp16 are mixed precision),
# and the bytes of one element of each. ``fp8`` computes in bf16 around the block's
# projections, which run in float8 (``models.fp8``: e4m3 forward, e5m2 gradients), so its
# activations are bf16's bytes.
FP8 = "fp8"
PRECISIONS = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", FP8: "bfloat16"}
PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, FP8: 2}

# Host offload (``training.offload``): the train state's parts that may live in the host's
# pinned memory between steps, and where the optimizer update then runs (``stream``: the
# state is copied to the device and back each step; ``host``: the update runs on the host
# with ``compute_on``, only gradients and new parameters cross the link).
OFFLOAD_TARGETS = ("optimizer", "params")
OFFLOAD_UPDATES = ("stream", "host")


@functools.lru_cache(maxsize=64)   # every Layout the planner builds parses its offload
def parse_offload(text: str) -> tuple[str, ...]:
    """``--offload`` as the state parts it names, in ``OFFLOAD_TARGETS`` order ("" -> ())."""
    parts = {p.strip() for p in (text or "").split(",") if p.strip()}
    bad = sorted(parts - set(OFFLOAD_TARGETS))
    if bad:
        raise ValueError(f"--offload {text!r}: {bad[0]!r} is not a state part; give a comma-"
                         f"separated subset of {', '.join(OFFLOAD_TARGETS)}, e.g. --offload "
                         f"optimizer")
    return tuple(t for t in OFFLOAD_TARGETS if t in parts)

# How a run's layout is chosen: as the flags say, or searched, compiled and checked against
# the devices' memory (``triax.planner.auto``); and what the search ranks by.
PLAN_MODES = ("flags", "auto")
OBJECTIVES = ("throughput", "latency")

# Positions per block of the serving engine's paged KV pool (``inference.kv_pool``): small
# enough that a short sequence wastes little of its last block, large enough that the block
# table and its gather stay small.
KV_BLOCK_SIZE = 16
# Serving's defaults: tensor parallel (a decode step's weights split, not gathered) and
# the decode slots per replica.
SERVE_STRATEGY = "tp"
SLOTS = 8
# The served weights' dtype (bf16: half the bytes every decode step reads; fp32 is the
# exact reference), and the KV pool's (``auto``: the weights'; int8 keeps a float32 scale
# per block and KV head, ``inference.kv_pool``). Precision names (``PRECISIONS``'s keys,
# and int8) are what the planner counts (``KV_PRECISION``).
# A waiting request that does not fit lets this many later (smaller) ones be admitted
# first; then nothing behind it is (``inference.batching``: the age bound).
MAX_BYPASS = 8
SERVE_DTYPES = ("bfloat16", "float32")
SPECULATIVE = ("off", "ngram", "draft")   # speculative decoding (inference.speculative)
# Which replicas ``triax serve`` compiles before it is ready (``inference.warm_start``).
WARMUP = ("auto", "all", "first")
SERVE_DTYPE = "bfloat16"
KV_DTYPES = ("auto", "bfloat16", "float32", "int8")
KV_PRECISION = {"float32": "fp32", "bfloat16": "bf16", "int8": "int8"}

# What a NaN/inf loss does (``triax.training.faults``).
NONFINITE_MODES = ("stop", "skip", "rollback")


def check(flag: str, value, accepted: Iterable):
    """``value`` if it is one of ``accepted``, else a ValueError naming ``--flag`` and the
    accepted values (the one wording every validation uses)."""
    accepted = tuple(accepted)
    if value not in accepted:
        raise ValueError(f"--{flag.replace('_', '-')} {value!r}: choose one of "
                         f"{', '.join(map(str, accepted))}")
    return value

# LoRA (``triax.models.lora``): the adaptable projections by PEFT's module names (the MLP's
# three are refused on MoE experts), and how the frozen base is stored.
PEFT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# int8: weight-only per-channel quantization of the block projections (``models.quantize``),
# the rest of the base fp32; 1 byte is its projections' (the planner counts leaf dtypes).
QUANTIZED_BASE = "int8"
BASE_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, QUANTIZED_BASE: 1}
BASE_DTYPES = tuple(BASE_DTYPE_BYTES)
# Serving's weight quantization (``--quantize``; ``models.quantize``): none, or the block
# projections int8 with a scale per output channel, as an int8 LoRA base stores them.
QUANTIZE = ("none", QUANTIZED_BASE)
