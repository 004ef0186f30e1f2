"""The flags ``generate`` and ``serve`` share, generated from ``ServeConfig``'s fields (the
model's source, its layout, the engine and its KV pool), and the one function both build
their ``Server`` and tokenizer with, so a layout choice (``--mesh``, ``--replicas``, or
``--plan auto``'s search over them) is made in one place.

``--mesh`` is one replica's layout (all replicas alike), or one layout per replica separated
by ``;`` (``pipe=2;context=2;tensor=2;tensor=2``), which take consecutive devices.
"""
from __future__ import annotations

from triax.cli.flags import add_flags, given
from triax.config_fields import KVPool
from triax.configs import leaves, warn_inert
from triax.serve_config import Engine, Layout, Sampling, ServeConfig, Source

NOTES = {
    "model": "for a seeded random init",
    "seed": "here the init's (with --model) and the sampling's (default: 0)",
    "mesh": "here one replica's, e.g. tensor=2, pipe=2,tensor=2 or context=2,tensor=4; axes "
            "left out are 1 (default: tensor over all of a replica's devices); or one per "
            "replica separated by ';'",
    "plan": "here auto chooses --replicas and --mesh (those given stay)",
    "context_attention": "the prefill's, on a mesh with a context axis",
}
# Fields no serving flag sets: the strategy (serving runs tensor parallel; the Python API
# may pick another) and the engine fields only ``serve`` has (``serve_cmd``).
NOT_FLAGS = {"strategy", "max_len", "max_queue", "max_adapters", "max_adapter_rank",
             "adapter_targets"}
WEIGHTS = ("checkpoint", "model", "model_dir")   # one of them names the weights


def _names(section) -> list[str]:
    return [n for n in leaves(section) if n not in NOT_FLAGS]


def add_model_flags(p) -> None:
    """The model source (exactly one), the seed, the layout, the engine and its pool."""
    add_flags(p.add_mutually_exclusive_group(required=True), Source, WEIGHTS, notes=NOTES)
    add_flags(p, Source, [n for n in _names(Source) if n not in WEIGHTS], notes=NOTES)
    add_flags(p, Layout, _names(Layout), notes=NOTES)
    add_flags(p, Engine, _names(Engine), notes=NOTES)


def add_sampling_flags(p, required=("max_new_tokens",)) -> None:
    """``generate``'s sampling settings (``serve``'s requests each give their own)."""
    add_flags(p, Sampling)
    for a in p._actions:
        if a.dest in required:
            a.required = True


def serve_config(args, **defaults) -> ServeConfig:
    """The ``ServeConfig`` the flags describe; ``defaults``: the command's own, under the
    flags given."""
    values = given(args, ServeConfig)
    config = ServeConfig.of(**{**defaults, **values})
    warn_inert(config.inert_flags(values))
    return config


def choose_layout(config: ServeConfig, longest: int, max_new_tokens: int):
    """``(config, choice)``: ``config`` as given, or with ``--plan auto`` its mesh and replicas
    the planner's (``planner.auto_serve``; those given stay fixed) and the choice's report."""
    lay = config.layout
    if lay.plan != "auto":
        return config, None
    from triax.inference.generate import source_config
    from triax.planner.auto_serve import choose_serving
    choice = choose_serving(source_config(config.source), longest=longest,
                            max_new_tokens=max_new_tokens, slots=config.engine.slots,
                            objective=lay.objective, device_memory=lay.device_memory,
                            mesh_sizes=lay.mesh_sizes() if lay.mesh else None,
                            replicas=lay.replicas, context_attention=lay.context_attention,
                            pool={**config.engine.pool.engine_kw(),
                                  "dtype": config.engine.dtype,
                                  "quantize": config.engine.quantize})
    return config.replace(mesh=choice.mesh, replicas=choice.replicas), choice


def load_tokenizer_for(src: Source):
    """``--tokenizer``, else a ``--model-dir``'s own, else the byte tokenizer."""
    from triax.text.tokenizer import get_tokenizer
    if src.model_dir and not src.tokenizer:   # an HF directory brings its own tokenizer
        from triax.hf.load import read_model_config
        from triax.hf.tokenizer import load_tokenizer
        return load_tokenizer(src.model_dir, read_model_config(src.model_dir))
    return get_tokenizer(src.tokenizer)

