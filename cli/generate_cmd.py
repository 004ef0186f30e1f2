"""``triax generate``: text from a checkpoint, a Hugging Face model directory or a seeded
init, on any serving layout.

    triax generate --model tiny --seed 0 --prompt "Hello" --max-new-tokens 16 \\
        --mesh tensor=2 --replicas 4 --greedy --json
    triax generate --model-dir Llama-3.2-1B --prompt "Hello" --max-new-tokens 16 --mesh tensor=2
    triax generate --model tiny --prompt "Hello" --max-new-tokens 16 --plan auto \\
        --device-memory 1GiB --objective latency   # replicas and mesh chosen, compiled
    triax generate --model tiny --prompts-file long.txt --max-new-tokens 16 \\
        --mesh context=2,tensor=4 --context-attention ring    # KV cache split over context

With ``--model-dir`` the prompts go through the directory's ``tokenizer.json``.
"""
from __future__ import annotations

import argparse
import json
import sys

from triax.cli.common import start_devices
from triax.cli.run_flags import add_run_flags


def add_parser(sub) -> None:
    p = sub.add_parser("generate",
                       help="generate text with a KV cache (TP, replicas, pipeline, context)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", metavar="DIR", help="training checkpoint directory")
    add_run_flags(src, ["model"], {"model": None}, notes={"model": "for a seeded random init"},
                  fill=True)
    src.add_argument("--model-dir", metavar="DIR", help="Hugging Face model directory "
                     "(config.json, safetensors, tokenizer.json)")
    # The flags a run shares, from RunConfig's fields; generate reads ``args`` directly.
    add_run_flags(p, ["seed", "num_layers", "adapter"], fill=True,
                  notes={"seed": "here the init's (with --model) and the sampling's (default: 0)"})
    prm = p.add_mutually_exclusive_group(required=True)
    prm.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    prm.add_argument("--prompts-file", metavar="F", help="one prompt per line")
    add_run_flags(p, ["tokenizer"], fill=True)
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--stop-token", type=int, action="append", default=[],
                   help="token id that ends a sequence (repeatable; 257 is EOS)")
    # --context-attention is the prefill's, on a mesh with a context axis.
    add_run_flags(p, ["mesh", "context_attention"], fill=True,
                  notes={"mesh": "here one replica's, e.g. tensor=2, pipe=2,tensor=2 or "
                                 "context=2,tensor=4; axes left out are 1 (default: tensor "
                                 "over all of a replica's devices)"})
    p.add_argument("--replicas", type=int, help="split the devices into R replicas (default: 1, "
                   "or with --plan auto searched)")
    p.add_argument("--slots", type=int, default=8, help="decode slots per replica")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="load even when a replica's weights and KV cache per device exceed a "
                        "device's memory ($TRIAX_DEVICE_MEMORY sets a device's bytes)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_run_flags(p, ["plan", "objective", "device_memory"], fill=True,
                  notes={"plan": "here auto chooses --replicas and --mesh (those given stay)"})
    p.add_argument("--dry-run", action="store_true",
                   help="with --plan auto: print the choice and stop (nothing is loaded)")
    p.set_defaults(func=run)


def _prompts(args) -> list[str]:
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    return list(args.prompt)


def run(args) -> int:
    if args.greedy and args.temperature:
        raise ValueError("--greedy and --temperature contradict; give one of them")
    start_devices()
    # Loaded only now: these modules start JAX, which must see the simulated device count.
    from triax.inference.generate import build_server, generate
    from triax.inference.sampling import SamplingConfig
    from triax.mesh import parse_mesh
    from triax.text.tokenizer import get_tokenizer
    tokenizer = get_tokenizer(args.tokenizer)
    prompts = _prompts(args)
    if not prompts or any(not p for p in prompts):
        raise ValueError("empty prompt: every --prompt (or prompts-file line) needs text")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, stop_tokens=tuple(args.stop_token))
    if args.model_dir and not args.tokenizer:   # an HF directory brings its own tokenizer
        from triax.hf.load import read_model_config
        from triax.hf.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(args.model_dir, read_model_config(args.model_dir))
    longest = max((len(tokenizer.encode(p)) for p in prompts), default=1)
    mesh, replicas = parse_mesh(args.mesh) or None, args.replicas
    if args.plan == "auto":
        from triax.inference.generate import _model_config
        from triax.planner.auto_serve import choose_serving
        choice = choose_serving(_model_config(args.checkpoint, args.model, args.num_layers,
                                              args.model_dir),
                                longest=longest, max_new_tokens=args.max_new_tokens,
                                slots=args.slots, objective=args.objective,
                                device_memory=args.device_memory, mesh_sizes=mesh,
                                replicas=replicas, context_attention=args.context_attention)
        if args.dry_run:
            print(json.dumps(choice.to_json()) if args.json else choice.describe())
            return 0
        print(choice.describe(), file=sys.stderr)
        mesh, replicas = choice.mesh_sizes, choice.replicas
    elif args.dry_run:
        raise ValueError("--dry-run reports --plan auto's choice; add --plan auto")
    server = build_server(args.checkpoint, args.model, args.seed, mesh or {"tensor": -1},
                          replicas or 1, sampling, longest, args.max_new_tokens, args.slots,
                          num_layers=args.num_layers, model_dir=args.model_dir,
                          check_memory=not args.skip_memory_check,
                          context_attention=args.context_attention, adapter=args.adapter)
    out = generate(server, prompts, args.max_new_tokens, tokenizer)
    if args.json:
        keep = ("prompt", "text", "tokens")
        print(json.dumps({"results": [{k: r[k] for k in keep} for r in out["results"]],
                          "prefill_tokens_per_s": out["prefill_tokens_per_s"],
                          "decode_tokens_per_s": out["decode_tokens_per_s"]}))
        return 0
    for r in out["results"]:
        print(f"--- {r['prompt']!r} ({len(r['tokens'])} tokens, {r['finish_reason']}, "
              f"ttft {r['ttft_s'] * 1e3:.0f} ms)\n{r['prompt']}{r['text']}")
    print(f"prefill {out['prefill_tokens_per_s']:.1f} tokens/s, "
          f"decode {out['decode_tokens_per_s']:.1f} tokens/s")
    return 0
