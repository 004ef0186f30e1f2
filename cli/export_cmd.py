"""``triax export``: a training checkpoint as a Hugging Face model directory.

    triax export --checkpoint runs/ft --out hf-model [--step N] [--max-shard-size 5GB]
    triax export --checkpoint runs/lora --out adapter --adapter-only

Writes ``config.json``, safetensors shards with ``model.safetensors.index.json``, and the
run's tokenizer files (from ``--tokenizer``, else the run's ``--tokenizer`` or ``--init-from``
directory). A non-empty ``--out`` is refused unless ``--overwrite``. A LoRA run exports
the merged model (``W + A·B·alpha/r``: plain HF weights, no ``peft`` needed), or with
``--adapter-only`` PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

from triax.cli.flags import add_json
from triax.cli.common import start_devices
from triax.training.config import saved_values   # JAX-free


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="export a checkpoint as a Hugging Face model directory",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", metavar="DIR", required=True, help="training checkpoint")
    p.add_argument("--out", metavar="DIR", required=True, help="model directory to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file "
                   "(default: 5GB; units B, KB, MB, GB or KiB, MiB, GiB)")
    p.add_argument("--tokenizer", metavar="PATH", default=None,
                   help="tokenizer.json or its directory (default: the run's own)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--adapter-only", action="store_true", help="a LoRA run: write its "
                   "adapters in PEFT's format instead of the merged model")
    add_json(p, "print one JSON object")
    p.set_defaults(func=run)


def run_tokenizer(meta: dict) -> str | None:
    """Where the run's tokenizer lives: its ``tokenizer`` or ``init_from`` setting."""
    run = saved_values(meta.get("run") or {})   # in sections, or flat (older)
    for key in ("tokenizer", "init_from"):
        if run.get(key):
            return run[key]
    return None


def export_adapter(params, cfg, out: str, meta: dict, overwrite: bool) -> list[str]:
    """``--adapter-only``: the run's adapters as a PEFT directory."""
    from triax.hf.export import check_target
    from triax.hf.files import HFError
    from triax.hf.peft import write_adapters
    if cfg.lora is None:
        raise HFError("--adapter-only: this checkpoint is not a LoRA run (trained without "
                      "--lora-rank); export the model without --adapter-only")
    check_target(out, overwrite)
    if os.path.isdir(out):   # --overwrite: replaced whole, as the merged export does
        shutil.rmtree(out)
    run = saved_values(meta.get("run") or {})   # in sections, or flat (older)
    return write_adapters(params, cfg, out, base_model=run.get("init_from") or cfg.name,
                          dropout=run.get("lora_dropout", 0.0))


def run(args) -> int:
    start_devices()
    # Loaded only now: these modules start JAX.
    import jax

    from triax.checkpoint import Checkpointer
    from triax.hf.export import check_target, export, tokenizer_files_in
    from triax.inference.checkpoint import load_params, read_checkpoint_config
    from triax.mesh import make_mesh
    from triax.models.lora import merged
    check_target(args.out, args.overwrite)  # before the (slow) restore
    _, step = read_checkpoint_config(args.checkpoint, args.step)
    meta = Checkpointer.existing(args.checkpoint).read_meta(step)
    tok = args.tokenizer or run_tokenizer(meta)
    files = tokenizer_files_in(tok) if tok else []
    if args.tokenizer and not files:
        raise ValueError(f"--tokenizer {args.tokenizer!r} holds no tokenizer.json")
    mesh = make_mesh(devices=jax.local_devices()[:1])
    cfg, params = load_params(mesh, checkpoint=args.checkpoint, step=step)
    if args.adapter_only:
        written = export_adapter(params, cfg, args.out, meta, args.overwrite)
    else:
        if cfg.lora is not None:   # the merged model: plain weights
            params, cfg = jax.jit(merged, static_argnums=1)(params, cfg.lora), cfg.replace(lora=None)
        written = export(params, cfg, args.out, args.max_shard_size, files, args.overwrite)
    if args.json:
        print(json.dumps({"out": os.path.abspath(args.out), "step": step, "files": written}))
    else:
        print(f"exported step {step} of {args.checkpoint} to {args.out}: {', '.join(written)}")
    return 0
