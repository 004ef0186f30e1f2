"""The flags ``generate`` and ``serve`` share (the model's source, its layout, the slots),
and the one function both build their ``Server`` and tokenizer with, so a layout choice
(``--mesh``, ``--replicas``, or ``--plan auto``'s search over them) is made in one place.

``--mesh`` is one replica's layout (all replicas alike), or one layout per replica separated
by ``;`` (``pipe=2;context=2;tensor=2;tensor=2``), which take consecutive devices.
"""
from __future__ import annotations

from triax.cli.flags import add_flags
from triax.cli.run_flags import add_run_flags
from triax.config_fields import KVPool


def add_model_flags(p, mesh_note: str = "") -> None:
    """The model source (exactly one), the seed, the layout and the decode slots."""
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="training checkpoint directory")
    add_run_flags(src, ["model"], {"model": None}, notes={"model": "for a seeded random init"},
                  fill=True)
    src.add_argument("--model-dir", metavar="DIR", help="Hugging Face model directory "
                     "(config.json, safetensors, tokenizer.json)")
    add_run_flags(p, ["seed", "num_layers", "tokenizer", "adapter"], fill=True,
                  notes={"seed": "here the init's (with --model) and the sampling's (default: 0)"})
    p.add_argument("--stop-token", type=int, action="append", default=[],
                   help="token id that ends a sequence (repeatable; 257 is EOS)")
    # --context-attention is the prefill's, on a mesh with a context axis.
    add_run_flags(p, ["mesh", "context_attention"], fill=True,
                  notes={"mesh": "here one replica's, e.g. tensor=2, pipe=2,tensor=2 or "
                                 "context=2,tensor=4; axes left out are 1 (default: tensor "
                                 "over all of a replica's devices); or one per replica "
                                 "separated by ';'" + mesh_note})
    p.add_argument("--replicas", type=int, help="split the devices into R replicas (default: 1, "
                   "or with --plan auto searched)")
    p.add_argument("--slots", type=int, default=8, help="decode slots per replica (each "
                   "takes KV blocks as its sequence grows: with a pool smaller than slots × "
                   "the longest sequence, requests are admitted as blocks are free)")
    add_flags(p, KVPool, fill=True)
    p.add_argument("--skip-memory-check", action="store_true",
                   help="load even when a replica's weights and KV cache per device exceed a "
                        "device's memory ($TRIAX_DEVICE_MEMORY sets a device's bytes)")
    add_run_flags(p, ["plan", "objective", "device_memory"], fill=True,
                  notes={"plan": "here auto chooses --replicas and --mesh (those given stay)"})
    p.add_argument("--dry-run", action="store_true",
                   help="with --plan auto: print the choice and stop (nothing is loaded)")


def layout_of(args):
    """``--mesh`` as ``build_server`` takes it: one replica's sizes, or one per replica."""
    from triax.mesh import parse_mesh
    text = args.mesh or ""
    if ";" in text:
        return [parse_mesh(part) for part in text.split(";") if part.strip()]
    return parse_mesh(text) or None


def choose_layout(args, longest: int, max_new_tokens: int):
    """``(mesh sizes, replicas, choice)`` for ``build_server``: the flags', or with ``--plan
    auto`` the planner's (``planner.auto_serve``; the flags given stay fixed) and its report."""
    mesh, replicas = layout_of(args), args.replicas
    if args.plan != "auto":
        if args.dry_run:
            raise ValueError("--dry-run reports --plan auto's choice; add --plan auto")
        return mesh or {"tensor": -1}, replicas or 1, None
    if isinstance(mesh, list):
        raise ValueError("--plan auto lays every replica out alike: give --mesh as one "
                         "replica's sizes (no ';'), or drop --plan auto")
    from triax.inference.generate import source_config
    from triax.planner.auto_serve import choose_serving
    choice = choose_serving(source_config(args.checkpoint, args.model, args.num_layers,
                                          args.model_dir, args.adapter),
                            longest=longest, max_new_tokens=max_new_tokens, slots=args.slots,
                            objective=args.objective, device_memory=args.device_memory,
                            mesh_sizes=mesh, replicas=replicas,
                            context_attention=args.context_attention, pool=pool_of(args))
    return choice.mesh_sizes, choice.replicas, choice


def load_tokenizer_for(args):
    """``--tokenizer``, else a ``--model-dir``'s own, else the byte tokenizer."""
    from triax.text.tokenizer import get_tokenizer
    if args.model_dir and not args.tokenizer:   # an HF directory brings its own tokenizer
        from triax.hf.load import read_model_config
        from triax.hf.tokenizer import load_tokenizer
        return load_tokenizer(args.model_dir, read_model_config(args.model_dir))
    return get_tokenizer(args.tokenizer)


def pool_of(args) -> dict:
    """``--kv-blocks`` / ``--kv-memory`` / ``--kv-block-size`` as ``build_server`` takes them
    (checked by ``KVPool``)."""
    return KVPool(args.kv_blocks, args.kv_memory, args.kv_block_size).engine_kw()


def build_from_args(args, sampling, longest: int, max_new_tokens: int, layout=None, **kw):
    """The ``Server`` the flags describe (``inference.build_server``); ``layout``: a
    ``choose_layout`` result already made (else it is made here)."""
    from triax.inference.generate import build_server
    mesh, replicas, _ = layout or choose_layout(args, longest, max_new_tokens)
    return build_server(args.checkpoint, args.model, args.seed, mesh, replicas, sampling,
                        longest, max_new_tokens, args.slots,
                        num_layers=args.num_layers, model_dir=args.model_dir,
                        check_memory=not args.skip_memory_check,
                        context_attention=args.context_attention, adapter=args.adapter,
                        **pool_of(args), **kw)
