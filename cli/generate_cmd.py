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

from triax.cli.flags import add_json
from triax.cli.common import start_devices
from triax.cli.serving_flags import (add_model_flags, build_from_args, choose_layout,
                                     load_tokenizer_for)


def add_parser(sub) -> None:
    p = sub.add_parser("generate",
                       help="generate text with a KV cache (TP, replicas, pipeline, context)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    prm = p.add_mutually_exclusive_group(required=True)
    prm.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    prm.add_argument("--prompts-file", metavar="F", help="one prompt per line")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--greedy", action="store_true", help="argmax decoding (the default)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    add_json(p, "print one JSON object")
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
    from triax.inference.generate import generate
    from triax.inference.sampling import SamplingConfig
    tokenizer = load_tokenizer_for(args)
    prompts = _prompts(args)
    if not prompts or any(not p for p in prompts):
        raise ValueError("empty prompt: every --prompt (or prompts-file line) needs text")
    sampling = SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed, stop_tokens=tuple(args.stop_token))
    longest = max((len(tokenizer.encode(p)) for p in prompts), default=1)
    layout = choose_layout(args, longest, args.max_new_tokens)
    if layout[2] is not None:   # --plan auto's choice
        if args.dry_run:
            print(json.dumps(layout[2].to_json()) if args.json else layout[2].describe())
            return 0
        print(layout[2].describe(), file=sys.stderr)
    server = build_from_args(args, sampling, longest, args.max_new_tokens, layout=layout)
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
