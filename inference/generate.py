"""One call from "weights + mesh + prompts" to generated text (used by the CLI and notebook).

    >>> server = build_server(model="tiny", num_layers=1, seed=0, mesh_sizes={"tensor": 2},
    ...                       replicas=4, max_new_tokens=4)
    >>> out = generate(server, ["Hello", "The mesh"], max_new_tokens=4)
    >>> [len(r["tokens"]) for r in out["results"]], out["decode_tokens_per_s"] > 0
    ([4, 4], True)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Optional, Sequence

from triax.hf.load import load as hf_load
from triax.hf.load import read_model_config
from triax.hf.peft import adapted_config, load_adapted
from triax.inference.checkpoint import load_params, read_checkpoint_config
from triax.inference.engine import EngineConfig, InferenceError, held_bytes_per_device
from triax.inference.kv_pool import kv_pool
from triax.inference.sampling import SamplingConfig
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.text.byte_tokenizer import ByteTokenizer
from triax.mesh import describe
from triax.mesh import mesh_sizes as sizes_of
from triax.choices import KV_BLOCK_SIZE
from triax.costs.fits import Replan, check_fits
from triax.costs.workload import Workload
from triax.models import config as model_config
from triax.sharding.context import check_scheme
from triax.sharding.rules import get_strategy
from triax.text.tokenizer import Tokenizer

TOKENIZER = ByteTokenizer()  # the byte presets' vocabulary (text.byte_tokenizer.BYTE_VOCAB)


def engine_config_for(cfg, mesh_sizes: Mapping[str, int] | Sequence[Mapping[str, int]],
                      longest: int, max_new_tokens: int, slots: int = 8, kv_blocks: int = 0,
                      kv_memory: int = 0, block_size: int = KV_BLOCK_SIZE) -> EngineConfig:
    """Sequences just long enough for the longest request (rounded to 16, capped at the
    context); slots rounded up so they split over ``data`` (and pipeline micro-batches), on
    every replica when ``mesh_sizes`` lists one layout per replica; the KV pool's size
    (``inference.kv_pool``: blocks, or bytes per device; neither: slots × max_len's)."""
    need = longest + max_new_tokens
    max_len = min(cfg.max_seq_len, 16 * math.ceil(need / 16))
    layouts = [mesh_sizes] if isinstance(mesh_sizes, Mapping) else list(mesh_sizes)
    unit = math.lcm(*(m.get("data", 1) * m.get("pipe", 1) for m in layouts))
    return EngineConfig(max_batch=unit * math.ceil(slots / unit), max_len=max_len,
                        min_bucket=min(16, max_len), kv_blocks=kv_blocks, kv_memory=kv_memory,
                        block_size=block_size)


def build_server(checkpoint: Optional[str] = None, model: Optional[str] = None, seed: int = 0,
                 mesh_sizes: Mapping[str, int] | Sequence[Mapping[str, int]] | None = None,
                 replicas: int = 1,
                 sampling: SamplingConfig = SamplingConfig(), longest: int = 64,
                 max_new_tokens: int = 32, slots: int = 8, strategy: str = "tp",
                 num_layers: Optional[int] = None, devices=None,
                 model_dir: Optional[str] = None, check_memory: bool = True,
                 context_attention: str = "all-gather", max_queue: Optional[int] = None,
                 adapter: Optional[str] = None, kv_blocks: int = 0, kv_memory: int = 0,
                 block_size: int = KV_BLOCK_SIZE) -> Server:
    """Load weights once (onto the first replica) and start ``replicas`` engines; the weights
    come from a training ``checkpoint``, a Hugging Face ``model_dir`` (``triax.hf``), or a
    preset ``model`` initialised from ``seed``. Unless ``check_memory`` is off, a replica's
    weights and KV cache are checked against a device's memory before anything loads.
    ``context_attention``: the prefill's attention across a ``context`` axis (all-gather or
    ring; docs/long_context.md). ``mesh_sizes``: one replica's layout, or a list with one
    per replica (``replica_meshes``). ``max_queue``: waiting requests at most (``Server``).
    ``adapter``: a PEFT LoRA directory over ``model_dir``'s base, used unmerged.
    ``kv_blocks`` / ``kv_memory`` (bytes per device) / ``block_size``: each replica's KV
    pool (``engine_config_for``)."""
    mesh_sizes = dict(mesh_sizes or {}) if isinstance(mesh_sizes, (Mapping, type(None))) \
        else [dict(m) for m in mesh_sizes]
    strategy = dataclasses.replace(get_strategy(strategy),
                                   context_attention=check_scheme(context_attention))
    meshes = replica_meshes(mesh_sizes, replicas, devices)
    if model_dir is not None and (checkpoint or model):
        raise InferenceError("give one of --model-dir, --checkpoint, --model")
    if adapter is not None and model_dir is None:
        raise InferenceError(f"--adapter {adapter!r} adapts a Hugging Face base: give "
                             f"--model-dir BASE_DIR")
    pool = {"kv_blocks": kv_blocks, "kv_memory": kv_memory, "block_size": block_size}
    if check_memory:
        cfg = source_config(checkpoint, model, num_layers, model_dir, adapter)
        ecfg = engine_config_for(cfg, mesh_sizes, longest, max_new_tokens, slots, **pool)
        for mesh in {describe(m): m for m in meshes}.values():  # each distinct layout
            check_serving_memory(cfg, mesh, strategy, ecfg)
    if adapter is not None:
        cfg, params = load_adapted(model_dir, adapter, meshes[0], strategy)
    elif model_dir is not None:
        cfg, params, _ = hf_load(model_dir, meshes[0], strategy)
    else:
        cfg, params = load_params(meshes[0], checkpoint, model, seed, strategy,
                                  num_layers=num_layers)
    ecfg = engine_config_for(cfg, mesh_sizes, longest, max_new_tokens, slots, **pool)
    server = Server.from_params(cfg, params, meshes, strategy, ecfg, sampling)
    server.max_queue = max_queue
    return server


def source_config(checkpoint, model, num_layers, model_dir, adapter=None):
    """The model's config from the source ``build_server`` names, read without its weights
    (what ``--plan auto`` plans for)."""
    if model_dir is not None:
        cfg = read_model_config(model_dir)
        return cfg if adapter is None else adapted_config(cfg, adapter)
    if checkpoint is not None:
        return read_checkpoint_config(checkpoint)[0]
    if model is None:
        raise InferenceError("give --checkpoint DIR, --model-dir DIR or --model NAME")
    return model_config.get(model, num_layers)


def check_serving_memory(cfg, mesh, strategy, ecfg: EngineConfig, capacity=None) -> None:
    """One replica's weights and KV cache per device against a device's memory
    (``costs.fits``); the error carries the serving workload, for the planner above to
    suggest a layout that fits."""
    pool = kv_pool(cfg, mesh, get_strategy(strategy), ecfg)
    replan = Replan(Workload.of_engine(cfg, ecfg), sizes_of(mesh), get_strategy(strategy).name,
                    devices=mesh.devices.size)
    check_fits(f"serving {cfg.name} ({ecfg.max_batch} slots, a KV pool of {pool.total_blocks} "
               f"blocks × {pool.block_size} positions)",
               held_bytes_per_device(cfg, mesh, strategy, ecfg), capacity, replan)


def generate(server: Server, prompts: Sequence[str], max_new_tokens: int,
             tokenizer: Optional[Tokenizer] = None) -> dict:
    """Generate for every prompt; the CLI's ``--json`` shape plus per-request stats.
    ``tokenizer``: the byte tokenizer when None (``triax.text.get_tokenizer``)."""
    if not prompts:
        raise InferenceError("no prompts: give --prompt TEXT or --prompts-file F")
    tok = tokenizer or TOKENIZER
    vocab = server.engines[0].cfg.vocab_size
    if tok.vocab_size > vocab:
        raise InferenceError(f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary "
                             f"is {vocab}; pass the model's own --tokenizer")
    encoded = [tok.encode(p) for p in prompts]
    for e in encoded:  # reject bad requests before compiling anything
        server.engines[0].check_prompt(len(e), max_new_tokens)
    server.warmup([len(e) for e in encoded])  # so the reported rates exclude compilation
    ids = [server.submit(e, max_new_tokens) for e in encoded]
    results = server.run()
    out = []
    for p, rid in zip(prompts, ids):
        r = results[rid]
        out.append({"prompt": p, "text": tok.decode(r.tokens), "tokens": r.tokens,
                    "finish_reason": r.finish_reason, "ttft_s": r.ttft_s,
                    "tokens_per_s": r.tokens_per_s})
    return {"results": out, "prefill_tokens_per_s": server.prefill_tokens_per_s,
            "decode_tokens_per_s": server.decode_tokens_per_s}
