"""The fields that several commands' configs share (``training.RunConfig`` and
``inference.ServeConfig``), declared once: each config makes its own field from the one
declaration here, so ``--mesh`` has one help and one set of choices in every command; and the
paged KV pool's section, whose checks ``serve``, ``generate`` and ``plan --inference`` share.
JAX-free, below training and inference.

    >>> KVPool(kv_memory="2MiB").memory_bytes()
    2097152
    >>> KVPool(kv_blocks=4, kv_memory="1MiB")
    Traceback (most recent call last):
    ...
    ValueError: give one of --kv-blocks and --kv-memory (both size the pool)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from triax import choices
from triax.configs import GE1, check_fields
from triax.units import parse_bytes


def spec(default, help: str, **meta):
    """A config field with its CLI help (and optional ``choices``, ``default_help``)."""
    return field(default=default, metadata={"help": help, **meta})


SHARED = {
    "model": ("model preset (tiny, small, llama3-1b, …)", {}),
    "num_layers": ("override the preset's layer count", {}),
    "mesh": ("axis=size pairs, e.g. data=2,tensor=2,pipe=2; one size may be -1 (the remaining "
             "devices)", {"default_help": "data × tensor × pipe picked from the devices"}),
    "strategy": ("parallelism strategy (see triax.sharding.rules)",
                 {"choices": choices.STRATEGIES}),
    "context_attention": ("attention across the context mesh axis: all-gather (K/V gathered) | "
                          "ring (K/V passed around with ppermute)",
                          {"choices": choices.CONTEXT_SCHEMES}),
    "seed": ("seed for parameters and data order", {}),
    "tokenizer": ("Hugging Face tokenizer: a directory holding tokenizer.json, or the file",
                  {"default_help": "bytes, no files needed"}),
    "adapter": ("PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) "
                "over the base model: train continues it (with --init-from BASE), generate "
                "uses it unmerged (with --model-dir BASE); serve too, or, as NAME=DIR "
                "(repeatable), serves each beside the base, picked by a request's model", {}),
    "skip_memory_check": ("start even when the compiled step's per-device peak exceeds a "
                          "device's memory (checked before allocating; $TRIAX_DEVICE_MEMORY "
                          "sets a device's bytes)", {}),
    "plan": ("how the layout is chosen: flags (as given) | auto (search the layouts the flags "
             "leave open, compile the best in turn, run the first that fits a device; see "
             "docs/planner.md)", {"choices": choices.PLAN_MODES}),
    "objective": ("what --plan auto ranks by (training: throughput)",
                  {"choices": choices.OBJECTIVES}),
    "device_memory": ("bytes one device may use, e.g. 40GiB (for --plan auto and the memory "
                      "check; simulated CPU devices: else host memory ÷ devices)",
                      {"default_help": "the device's own, or $TRIAX_DEVICE_MEMORY"}),
}


def shared(name: str, default, **meta):
    """A field declared in ``SHARED`` (``meta`` adds to, or overrides, its metadata)."""
    help_, base = SHARED[name]
    return spec(default, help_, **{**base, **meta})


@dataclass(frozen=True)
class KVPool:
    """The serving engine's paged KV pool (``inference.kv_pool``): blocks, or bytes per
    device, and the positions per block."""

    kv_blocks: Optional[int] = spec(None, "blocks in each replica's paged KV pool",
                                    default_help="--kv-memory's, else slots × the longest "
                                                 "sequence's blocks")
    kv_memory: Optional[str] = spec(None, "bytes of paged KV pool per device, e.g. 2GiB (as "
                                          "many whole blocks as fit; instead of --kv-blocks)")
    kv_block_size: int = spec(choices.KV_BLOCK_SIZE, "positions per KV pool block (a multiple "
                                                     "of the context axis)")
    kv_dtype: str = spec("auto", "what the KV pool stores: auto (the served weights' --dtype), "
                                 "bfloat16, float32, or int8 (a float32 scale per block and KV "
                                 "head; about half bf16's bytes)", choices=choices.KV_DTYPES)

    def __post_init__(self):
        choices.check("kv_dtype", self.kv_dtype, choices.KV_DTYPES)
        check_fields(self, {
            "kv_blocks": (*GE1, "give the pool's blocks, e.g. --kv-blocks 512, or leave it out"),
            "kv_block_size": (*GE1, "give positions per block, e.g. --kv-block-size 16")})
        if self.kv_memory is not None:
            if self.kv_blocks is not None:
                raise ValueError("give one of --kv-blocks and --kv-memory (both size the pool)")
            self.memory_bytes()

    def memory_bytes(self) -> int:
        """``--kv-memory`` in bytes (0: not given)."""
        if self.kv_memory is None:
            return 0
        try:
            n = parse_bytes(self.kv_memory)
        except ValueError as e:
            raise ValueError(f"--kv-memory: {e}") from None
        if n <= 0:
            raise ValueError(f"--kv-memory {self.kv_memory}: must be > 0, e.g. --kv-memory 2GiB")
        return n

    def engine_kw(self) -> dict:
        """The pool as ``EngineConfig`` takes it."""
        return {"kv_blocks": self.kv_blocks or 0, "kv_memory": self.memory_bytes(),
                "block_size": self.kv_block_size, "kv_dtype": self.kv_dtype}

    def given(self) -> list[str]:
        """The pool's flags set away from their defaults (for "no pool here" warnings)."""
        return [f"--{n.replace('_', '-')}" for n, d in (("kv_blocks", None), ("kv_memory", None),
                                                        ("kv_block_size", choices.KV_BLOCK_SIZE),
                                                        ("kv_dtype", "auto"))
                if getattr(self, n) != d]
