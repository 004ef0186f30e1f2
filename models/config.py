"""Model configuration: frozen, hashable dataclasses and named presets.

Shape letters used throughout triax (written once, here):
    B batch   T sequence (query)   S sequence (key/value)   D embed (model width)
    N query heads   K kv heads   G query heads per kv head (N // K)   H head_dim
    F mlp hidden   U fused gate|up pair (2)   V vocab   L layers   E experts   C expert capacity

Variants come from ``dataclasses.replace``::

    >>> from triax.models import config
    >>> cfg = config.get("tiny").replace(num_layers=2)
    >>> cfg.num_layers
    2
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from triax.choices import BASE_DTYPES, MLP_TARGETS, PEFT_TARGETS, QUANTIZE
from triax.text.byte_tokenizer import BYTE_VOCAB


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward settings (None on a dense model)."""

    num_experts: int = 8
    top_k: int = 2
    mlp_dim: int = 0  # per-expert hidden size; 0 means "use ModelConfig.mlp_dim"
    capacity_factor: Optional[float] = None  # None: dropless
    aux_loss_weight: float = 0.01
    z_loss_weight: float = 0.0

    def __post_init__(self):
        if self.num_experts < 1 or self.top_k < 1:
            raise ValueError(f"MoEConfig: num_experts={self.num_experts} and top_k={self.top_k} "
                             f"must both be at least 1")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig: top_k={self.top_k} exceeds num_experts="
                             f"{self.num_experts}; choose top_k <= num_experts")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ValueError(f"MoEConfig: capacity_factor={self.capacity_factor} must be > 0 "
                             f"(or None for dropless routing)")
        if self.mlp_dim < 0:
            raise ValueError(f"MoEConfig: mlp_dim={self.mlp_dim} must be >= 0 (0: the model's)")

    def replace(self, **kw) -> "MoEConfig":
        return dataclasses.replace(self, **kw)


@dataclass(frozen=True)
class LoraConfig:
    """Adapters of rank ``rank`` on the ``targets`` (PEFT module names), scaled
    ``alpha / rank``; the frozen base stored in ``base_dtype`` (``choices.BASE_DTYPES``);
    ``dropout``: PEFT's ``lora_dropout`` on the adapters' input, in training steps only.
    ``slots``: 0, one adapter (trained, or served with ``--adapter DIR``); N > 0, a serving
    table of N adapters picked per row (``models.lora_table``), each of rank ``rank`` at
    most (padded with zeros), its ``alpha / r`` folded into its B."""

    rank: int
    alpha: float = 16.0
    targets: tuple[str, ...] = PEFT_TARGETS
    base_dtype: str = "float32"
    dropout: float = 0.0
    slots: int = 0

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoraConfig: rank={self.rank} must be >= 1 (0 turns LoRA off)")
        if not self.alpha > 0:
            raise ValueError(f"LoraConfig: alpha={self.alpha} must be > 0")
        bad = [t for t in self.targets if t not in PEFT_TARGETS]
        if bad or not self.targets:
            raise ValueError(f"--lora-targets {','.join(self.targets) or '(empty)'}: unknown "
                             f"module(s) {bad}; choose from {','.join(PEFT_TARGETS)}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"--lora-dropout {self.dropout:g}: must be in [0, 1) (the "
                             f"probability of zeroing an adapter input), e.g. 0.05")
        if self.slots < 0:
            raise ValueError(f"--max-adapters {self.slots}: must be >= 0")
        if self.base_dtype not in BASE_DTYPES:
            raise ValueError(f"--base-dtype {self.base_dtype!r}: choose one of "
                             f"{', '.join(BASE_DTYPES)}")
        object.__setattr__(self, "targets", tuple(t for t in PEFT_TARGETS if t in self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def describe(self) -> str:
        """One phrase for start-up lines and listings, e.g. ``LoRA rank 8 (alpha 16) on
        q_proj,v_proj, base float32``.

        >>> LoraConfig(8, targets=("v_proj", "q_proj")).describe()
        'LoRA rank 8 (alpha 16) on q_proj,v_proj, base float32'
        """
        if self.slots:
            return (f"LoRA table of {self.slots} adapter slot(s), rank <= {self.rank} on "
                    f"{','.join(self.targets)}")
        return (f"LoRA rank {self.rank} (alpha {self.alpha:g}) on {','.join(self.targets)}, "
                f"base {self.base_dtype}" + (f", dropout {self.dropout:g}" if self.dropout else ""))


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (Hugging Face ``rope_scaling`` type ``llama3``).

    Wavelengths longer than ``original_max_seq_len / low_freq_factor`` are stretched by
    ``factor``, those shorter than ``original_max_seq_len / high_freq_factor`` are kept, and
    the band between is interpolated (see ``triax.models.layers.rope_frequencies``).
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_seq_len: int = 8192

    def __post_init__(self):
        if not (self.factor > 0 and self.original_max_seq_len > 0
                and 0 < self.low_freq_factor < self.high_freq_factor):
            raise ValueError(f"RopeScaling: need factor > 0, original_max_seq_len > 0 and "
                             f"0 < low_freq_factor < high_freq_factor; got {self}")


# Each LoRA target's base weight as (input, output) shape letters (the letters above), and
# each letter's ModelConfig field and logical axis (``ModelConfig.lora_io``).
_LORA_IO = {"q_proj": ("D", "NH"), "k_proj": ("D", "KH"), "v_proj": ("D", "KH"),
            "o_proj": ("NH", "D"), "gate_proj": ("D", "F"), "up_proj": ("D", "F"),
            "down_proj": ("F", "D")}
_LORA_LETTERS = {"D": ("embed_dim", "embed"), "N": ("num_heads", "heads"),
                 "K": ("num_kv_heads", "kv_heads"), "H": ("head_dim", "head_dim"),
                 "F": ("mlp_dim", "mlp")}


@dataclass(frozen=True)
class ModelConfig:
    """A Llama-style decoder. All sizes are global (unsharded)."""

    name: str
    vocab_size: int
    embed_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    init_std: float = 0.02
    moe: Optional[MoEConfig] = None
    rope_scaling: Optional[RopeScaling] = None  # None: plain RoPE
    lora: Optional[LoraConfig] = None  # None: no adapters, everything trains
    # Served weights (``--quantize``; ``models.quantize.served_config`` sets it): int8 block
    # projections with per-output-channel scales. With LoRA the base says it (base_dtype).
    quantize: str = "none"

    def __post_init__(self):
        for field in ("vocab_size", "embed_dim", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "mlp_dim", "max_seq_len"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ModelConfig {self.name!r}: {field} must be positive, "
                                 f"got {getattr(self, field)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig {self.name!r}: num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads} (grouped-query attention)")
        if self.quantize not in QUANTIZE:
            raise ValueError(f"--quantize {self.quantize!r}: choose one of {', '.join(QUANTIZE)}")
        if self.quantize != "none" and self.lora is not None:
            raise ValueError(f"quantize={self.quantize!r} with LoRA: the base's storage is "
                             f"LoraConfig.base_dtype's; give base_dtype={self.quantize!r}")
        on_experts = [t for t in (self.lora.targets if self.lora else ()) if t in MLP_TARGETS]
        if self.moe is not None and on_experts:
            raise ValueError(f"--lora-targets {','.join(on_experts)}: adapters on MoE expert "
                             f"weights are not supported; on an MoE model adapt the attention "
                             f"only, --lora-targets q_proj,k_proj,v_proj,o_proj")

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def param_counts(self) -> dict[str, int]:
        """Exact parameter counts by group (matches the model's real tree)."""
        D, N, K, H, F, V, L = (self.embed_dim, self.num_heads, self.num_kv_heads,
                               self.head_dim, self.mlp_dim, self.vocab_size, self.num_layers)
        attn = D * N * H + 2 * D * K * H + N * H * D
        if self.moe is None:
            mlp = 3 * D * F
        else:
            Fe = self.moe.mlp_dim or F
            mlp = self.moe.num_experts * 3 * D * Fe + D * self.moe.num_experts
        per_layer = attn + mlp + 2 * D
        embed = V * D
        head = 0 if self.tie_embeddings else D * V
        return {"embed": embed, "layers": L * per_layer, "final_norm": D, "head": head,
                "per_layer": per_layer}

    @property
    def num_params(self) -> int:
        c = self.param_counts()
        return c["embed"] + c["layers"] + c["final_norm"] + c["head"]

    def active_params(self) -> int:
        """Parameters touched per token (differs from num_params only for MoE)."""
        if self.moe is None:
            return self.num_params
        Fe = self.moe.mlp_dim or self.mlp_dim
        unused = (self.moe.num_experts - self.moe.top_k) * 3 * self.embed_dim * Fe
        return self.num_params - self.num_layers * unused

    def lora_io(self, target: str) -> tuple[tuple[int, ...], tuple[str, ...],
                                            tuple[int, ...], tuple[str, ...]]:
        """``(in_shape, in_axes, out_shape, out_axes)`` of LoRA ``target``'s base weight in
        triax's layout (its logical axes too): the one home of every adapter's shape."""
        def side(letters):
            return (tuple(getattr(self, _LORA_LETTERS[c][0]) for c in letters),
                    tuple(_LORA_LETTERS[c][1] for c in letters))
        fan_in, fan_out = _LORA_IO[target]
        return side(fan_in) + side(fan_out)

    @property
    def adapter_params(self) -> int:
        """LoRA adapter parameters (0 without ``lora``): r·(in + out) per adapted projection
        (a serving table: per slot, and its slot 0 of zeros)."""
        if self.lora is None:
            return 0
        per_rank = sum(math.prod(i) + math.prod(o)
                       for i, _, o, _ in map(self.lora_io, self.lora.targets))
        rows = self.lora.slots + 1 if self.lora.slots else 1
        return rows * self.num_layers * self.lora.rank * per_rank

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6·N_active plus causal attention (fwd+bwd). Under LoRA
        the frozen base has no weight-gradient matmuls (4·N) and the adapters train (6·n)."""
        attn = 6 * self.num_layers * self.num_heads * self.head_dim * seq_len  # ~12·L·N·H·T/2 causal
        if self.lora is not None:
            return 4.0 * self.active_params() + 6.0 * self.adapter_params + attn
        return 6.0 * self.active_params() + attn


def _llama(name, V, D, L, N, K, F, theta=500000.0, tie=False, seq=8192, scaling=None):
    return ModelConfig(name=name, vocab_size=V, embed_dim=D, num_layers=L, num_heads=N,
                       num_kv_heads=K, head_dim=D // N, mlp_dim=F, max_seq_len=seq,
                       rope_theta=theta, tie_embeddings=tie, rope_scaling=scaling)



TINY = ModelConfig(name="tiny", vocab_size=BYTE_VOCAB, embed_dim=64, num_layers=4, num_heads=8,
                   num_kv_heads=2, head_dim=8, mlp_dim=128, max_seq_len=256)
# 16 query heads (not GPT-2's 12) so that tensor=8 divides them; 4 KV heads, so tensor=8
# also exercises KV-head replication while tensor=4 shards them.
SMALL = ModelConfig(name="small", vocab_size=BYTE_VOCAB, embed_dim=768, num_layers=12,
                    num_heads=16, num_kv_heads=4, head_dim=48, mlp_dim=3840,
                    max_seq_len=1024)
# Llama 3.2 1B and 3.1 405B ship rope_scaling {type llama3, factor 32 / 8, low 1, high 4,
# original 8192}; 3.0's 8B and 70B have none.
LLAMA3_1B = _llama("llama3-1b", 128256, 2048, 16, 32, 8, 8192, tie=True,
                   scaling=RopeScaling(factor=32.0))
LLAMA3_8B = _llama("llama3-8b", 128256, 4096, 32, 32, 8, 14336)
LLAMA3_70B = _llama("llama3-70b", 128256, 8192, 80, 64, 8, 28672)
LLAMA3_405B = _llama("llama3-405b", 128256, 16384, 126, 128, 8, 53248,
                     scaling=RopeScaling(factor=8.0))

TINY_MOE = TINY.replace(name="tiny-moe", moe=MoEConfig(num_experts=8, top_k=2, mlp_dim=64))
SMALL_MOE = SMALL.replace(name="small-moe", num_layers=6,
                          moe=MoEConfig(num_experts=8, top_k=2, mlp_dim=768))
MIXTRAL_8X7B = ModelConfig(name="mixtral-8x7b", vocab_size=32000, embed_dim=4096, num_layers=32,
                           num_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336,
                           max_seq_len=32768, rope_theta=1e6,
                           moe=MoEConfig(num_experts=8, top_k=2))

PRESETS: dict[str, ModelConfig] = {c.name: c for c in (
    TINY, SMALL, LLAMA3_1B, LLAMA3_8B, LLAMA3_70B, LLAMA3_405B, TINY_MOE, SMALL_MOE, MIXTRAL_8X7B)}


def get(name: str, num_layers: Optional[int] = None) -> ModelConfig:
    """Return the preset ``name``, optionally with ``num_layers`` overridden."""
    try:
        cfg = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(PRESETS)}") from None
    return cfg if num_layers is None else cfg.replace(num_layers=num_layers)
