"""One call from "weights + mesh + prompts" to generated text (used by the CLI and notebook).

    >>> config = ServeConfig.of(model="tiny", num_layers=1, seed=0, mesh="data=2,tensor=4",
    ...                         slots=2)   # one slot per prompt: one prefill, one decode program
    >>> server = build_server(config, max_new_tokens=4)
    >>> out = generate(server, ["Hello", "The mesh"], max_new_tokens=4)
    >>> [len(r["tokens"]) for r in out["results"]], out["decode_tokens_per_s"] > 0
    ([4, 4], True)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Mapping, Optional, Sequence

from triax.hf.load import load as hf_load
from triax.hf.load import read_model_config
from triax.hf.peft import adapted_config, load_adapted
from triax.inference.adapter_table import AdapterTable, planned_table, with_empty_table
from triax.inference.checkpoint import load_params, read_checkpoint_config
from triax.inference.draft_proposer import speculate
from triax.inference.engine import EngineConfig, InferenceError, held_bytes_per_device
from triax.inference.kv_pool import kv_pool
from triax.inference.replicas import replica_meshes
from triax.inference.server import Server
from triax.text.byte_tokenizer import ByteTokenizer
from triax.mesh import describe
from triax.mesh import mesh_sizes as sizes_of
from triax.choices import KV_BLOCK_SIZE
from triax.costs.fits import Replan, check_fits
from triax.costs.workload import Workload
from triax.models import config as model_config
from triax.choices import SLOTS
from triax.serve_config import ServeConfig, Source
from triax.sharding.context import check_scheme
from triax.sharding.rules import get_strategy
from triax.text.tokenizer import Tokenizer

TOKENIZER = ByteTokenizer()  # the byte presets' vocabulary (text.byte_tokenizer.BYTE_VOCAB)


def engine_config_for(cfg, mesh_sizes: Mapping[str, int] | Sequence[Mapping[str, int]],
                      longest: int, max_new_tokens: int, slots: int = SLOTS, kv_blocks: int = 0,
                      kv_memory: int = 0, block_size: int = KV_BLOCK_SIZE,
                      dtype: str = "float32", kv_dtype: str = "auto",
                      prefix_cache: bool = False, quantize: str = "none") -> EngineConfig:
    """Sequences just long enough for the longest request (rounded to 16, capped at the
    context); slots rounded up so they split over ``data`` (and pipeline micro-batches), on
    every replica when ``mesh_sizes`` lists one layout per replica; the KV pool's size
    (``inference.kv_pool``: blocks, or bytes per device; neither: slots × max_len's); the
    served weights' and the pool's dtypes; prefix caching; the weights' quantization."""
    need = longest + max_new_tokens
    max_len = min(cfg.max_seq_len, 16 * math.ceil(need / 16))
    layouts = [mesh_sizes] if isinstance(mesh_sizes, Mapping) else list(mesh_sizes)
    unit = math.lcm(*(m.get("data", 1) * m.get("pipe", 1) for m in layouts))
    return EngineConfig(max_batch=unit * math.ceil(slots / unit), max_len=max_len,
                        min_bucket=min(16, max_len), kv_blocks=kv_blocks, kv_memory=kv_memory,
                        block_size=block_size, dtype=dtype, kv_dtype=kv_dtype,
                        prefix_cache=prefix_cache, quantize=quantize)


def build_server(config: ServeConfig = ServeConfig(), longest: int = 64,
                 max_new_tokens: int = 32, devices=None) -> Server:
    """Load weights once (onto the first replica) and start ``config``'s replica engines on
    ``devices`` (default: all); the weights come from a training checkpoint, a Hugging Face
    model directory (``triax.hf``, with a PEFT adapter used unmerged), or a preset initialised
    from the seed (``config.source``). Unless ``skip_memory_check``, a replica's weights and
    KV cache are checked against a device's memory before anything loads. ``longest`` /
    ``max_new_tokens``: the longest prompt and the tokens after it, which size the sequences
    (``engine_config_for``). ``--plan auto``'s choice comes in as ``config``'s mesh and
    replicas (``planner.auto_serve``)."""
    src, lay, eng = config.source, config.layout, config.engine
    mesh_sizes = lay.mesh_sizes()
    strategy = dataclasses.replace(get_strategy(lay.strategy),
                                   context_attention=check_scheme(lay.context_attention))
    meshes = replica_meshes(mesh_sizes, lay.replicas, devices)
    pool = {**eng.pool.engine_kw(), "dtype": eng.dtype, "prefix_cache": eng.prefix_cache,
            "quantize": eng.quantize}
    if not eng.skip_memory_check:
        cfg = source_config(src)
        ecfg = engine_config_for(cfg, mesh_sizes, longest, max_new_tokens, eng.slots, **pool)
        for mesh in {describe(m): m for m in meshes}.values():  # each distinct layout
            check_serving_memory(cfg, mesh, strategy, ecfg)
    # HF weights are built in the served dtype (never float32 on the devices), except where
    # int8 projections are quantized from them as placed
    load_dtype = eng.dtype if eng.quantize == "none" else "float32"
    if src.uses_table:   # many adapters: the base, and a table of zeros to load them into
        base_cfg, params, _ = hf_load(src.model_dir, meshes[0], strategy, dtype=load_dtype)
        cfg = source_config(src)
        params = with_empty_table(cfg, params)
    elif src.unnamed_adapter is not None:
        cfg, params = load_adapted(src.model_dir, src.unnamed_adapter, meshes[0], strategy)
    elif src.model_dir is not None:
        cfg, params, _ = hf_load(src.model_dir, meshes[0], strategy, dtype=load_dtype)
    else:
        cfg, params = load_params(meshes[0], src.checkpoint, src.model, src.seed, strategy,
                                  num_layers=src.num_layers)
    ecfg = engine_config_for(cfg, mesh_sizes, longest, max_new_tokens, eng.slots, **pool)
    server = Server.from_params(cfg, params, meshes, strategy, ecfg, config.sampling_config())
    server.max_queue = eng.max_queue
    server.max_step_tokens = eng.max_step_tokens   # chunked prefill's budget (0: off)
    if src.uses_table:
        server.adapters = AdapterTable(cfg, base_cfg)
        for name, directory in src.named_adapters():
            server.load_adapter(name, directory)
    speculate(server.engines, eng, src.seed)   # --speculative (inference.speculative)
    return server


def source_config(src: Source):
    """The model's config from the source ``build_server`` names, read without its weights
    (what ``--plan auto`` plans for)."""
    if src.model_dir is not None:
        cfg = read_model_config(src.model_dir)
        if src.uses_table:
            return planned_table(cfg, src.named_adapters(), src.max_adapters,
                                 src.max_adapter_rank, src.adapter_targets)
        return cfg if src.unnamed_adapter is None else adapted_config(cfg, src.unnamed_adapter)
    if src.checkpoint is not None:
        return read_checkpoint_config(src.checkpoint)[0]
    if src.model is None:
        raise InferenceError("give --checkpoint DIR, --model-dir DIR or --model NAME")
    return model_config.get(src.model, src.num_layers)


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
             tokenizer: Optional[Tokenizer] = None,
             progress: Optional[Callable[[str], None]] = None) -> dict:
    """Generate for every prompt; the CLI's ``--json`` shape plus per-request stats.
    ``tokenizer``: the byte tokenizer when None (``triax.text.get_tokenizer``);
    ``progress(line)`` hears each program compiled by the warm-up (``Server.warmup``)."""
    if not prompts:
        raise InferenceError("no prompts: give --prompt TEXT or --prompts-file F")
    tok = tokenizer or TOKENIZER
    vocab = server.vocab_size
    if tok.vocab_size > vocab:
        raise InferenceError(f"the tokenizer has {tok.vocab_size} ids but the model's vocabulary "
                             f"is {vocab}; pass the model's own --tokenizer")
    encoded = [tok.encode(p) for p in prompts]
    for e in encoded:  # reject bad requests before compiling anything
        server.check_request(e, max_new_tokens)
    # So the reported rates exclude compilation (every request samples as the engine does).
    server.warmup([len(e) for e in encoded], progress,
                  sampled=not all(e.sampling.greedy for e in server.engines))
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
