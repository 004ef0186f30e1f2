"""Hugging Face ``config.json`` <-> triax ``ModelConfig``.

Supported: ``LlamaForCausalLM`` (Llama 3.1/3.2 ``rope_scaling`` of type ``llama3`` and tied
embeddings included), ``MistralForCausalLM`` without a sliding window, ``MixtralForCausalLM``.
A field that would change the math and that triax does not implement (attention or MLP
biases, a sliding window, another RoPE scaling, another activation) is an error, never
silently dropped.

    >>> cfg = model_config({"architectures": ["LlamaForCausalLM"], "vocab_size": 320,
    ...     "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    ...     "num_attention_heads": 4, "num_key_value_heads": 2}, name="demo")
    >>> cfg.head_dim, cfg.rope_theta, cfg.tie_embeddings
    (16, 10000.0, False)
    >>> hf_config(cfg)["architectures"]
    ['LlamaForCausalLM']
"""
from __future__ import annotations

import json
import os
from typing import Any, Optional

from triax.hf.files import HFError
from triax.models.config import ModelConfig, MoEConfig, RopeScaling

CONFIG = "config.json"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")


def read_config(directory: str) -> dict:
    path = os.path.join(directory, CONFIG)
    try:
        with open(path) as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise HFError(f"{directory} has no {CONFIG}; give a Hugging Face model directory "
                      f"(config.json + safetensors weights)") from None
    except ValueError as e:
        raise HFError(f"{path} is not valid JSON ({e})") from None


def _rope(hf: dict) -> tuple[float, Optional[RopeScaling]]:
    # transformers >= 5 writes `rope_parameters` (theta inside); older files `rope_scaling`.
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise HFError(f"rope scaling of type {kind!r} is not supported (triax implements "
                      f"'llama3' and plain RoPE); other types would change positions silently")
    try:
        return theta, RopeScaling(factor=float(params["factor"]),
                                  low_freq_factor=float(params["low_freq_factor"]),
                                  high_freq_factor=float(params["high_freq_factor"]),
                                  original_max_seq_len=int(
                                      params["original_max_position_embeddings"]))
    except KeyError as e:
        raise HFError(f"llama3 rope scaling lacks {e}; config.json is incomplete") from None


def _reject_unsupported(hf: dict, arch: str) -> None:
    bad = []
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            bad.append(f"{key}=true (triax's projections have no bias)")
    if hf.get("sliding_window") is not None and hf.get("use_sliding_window", True):
        bad.append(f"sliding_window={hf['sliding_window']} (triax attends to the whole "
                   f"context; only checkpoints without a sliding window are supported)")
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        bad.append(f"hidden_act={act!r} (triax's MLP is SwiGLU with silu)")
    for key in ("attention_dropout", "router_jitter_noise"):
        if hf.get(key):
            bad.append(f"{key}={hf[key]} (triax has no dropout or router noise)")
    if hf.get("quantization_config"):
        bad.append("quantization_config (dequantize the weights first)")
    if bad:
        raise HFError(f"{arch} config has field(s) triax would otherwise ignore: "
                      f"{'; '.join(bad)}")


def model_config(hf: dict, name: str = "hf") -> ModelConfig:
    """The ``ModelConfig`` of a Hugging Face config dict (errors name the offending field)."""
    archs = hf.get("architectures") or []
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise HFError(f"architecture {archs or hf.get('model_type')!r} is not supported; "
                      f"triax imports {', '.join(ARCHITECTURES)}")
    arch = archs[0]
    _reject_unsupported(hf, arch)
    try:
        D, N = int(hf["hidden_size"]), int(hf["num_attention_heads"])
        theta, scaling = _rope(hf)
        moe = None
        if arch == "MixtralForCausalLM":
            moe = MoEConfig(num_experts=int(hf["num_local_experts"]),
                            top_k=int(hf["num_experts_per_tok"]), capacity_factor=None,
                            aux_loss_weight=float(hf.get("router_aux_loss_coef", 0.01)))
        return ModelConfig(
            name=name, vocab_size=int(hf["vocab_size"]), embed_dim=D,
            num_layers=int(hf["num_hidden_layers"]), num_heads=N,
            num_kv_heads=int(hf.get("num_key_value_heads") or N),
            head_dim=int(hf.get("head_dim") or D // N), mlp_dim=int(hf["intermediate_size"]),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)), rope_theta=theta,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            init_std=float(hf.get("initializer_range", 0.02)), moe=moe, rope_scaling=scaling)
    except KeyError as e:
        raise HFError(f"{arch} config.json lacks required field {e}") from None


def hf_config(cfg: ModelConfig, dtype: str = "float32") -> dict[str, Any]:
    """The ``config.json`` ``transformers`` loads for ``cfg`` (Llama, or Mixtral for MoE)."""
    out: dict[str, Any] = {
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.embed_dim,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "max_position_embeddings": cfg.max_seq_len,
        "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "initializer_range": cfg.init_std,
        "hidden_act": "silu", "torch_dtype": dtype, "attention_bias": False,
        "rope_scaling": None,
    }
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor,
                               "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_seq_len}
    if cfg.moe is None:
        out.update(architectures=["LlamaForCausalLM"], model_type="llama", mlp_bias=False)
    else:
        out.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
                   intermediate_size=cfg.moe.mlp_dim or cfg.mlp_dim,
                   num_local_experts=cfg.moe.num_experts,
                   num_experts_per_tok=cfg.moe.top_k, sliding_window=None,
                   router_aux_loss_coef=cfg.moe.aux_loss_weight)
    return out
