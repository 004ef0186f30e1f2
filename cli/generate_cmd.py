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
from triax.cli.flags import add_json
from triax.cli.progress import Progress
from triax.cli.serving_flags import (add_model_flags, add_sampling_flags, choose_layout,
                                     load_tokenizer_for, serve_config)


def add_parser(sub) -> None:
    p = sub.add_parser("generate",
                       help="generate text with a KV cache (TP, replicas, pipeline, context)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    prm = p.add_mutually_exclusive_group(required=True)
    prm.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    prm.add_argument("--prompts-file", metavar="F", help="one prompt per line")
    add_sampling_flags(p)
    add_json(p)
    p.set_defaults(func=run)


def _prompts(args) -> list[str]:
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            return [line.rstrip("\n") for line in f if line.strip()]
    return list(args.prompt)


def run(args) -> int:
    config = serve_config(args)
    if config.source.uses_table:
        raise ValueError("generate serves one model: give one unnamed --adapter DIR (named "
                         "--adapter NAME=DIR are serve's, each picked by a request's model)")
    start_devices()
    # Loaded only now: these modules start JAX, which must see the simulated device count.
    from triax.inference.generate import build_server, generate
    tokenizer = load_tokenizer_for(config.source)
    prompts = _prompts(args)
    if not prompts or any(not p for p in prompts):
        raise ValueError("empty prompt: every --prompt (or prompts-file line) needs text")
    longest = max((len(tokenizer.encode(p)) for p in prompts), default=1)
    max_new = config.sampling.max_new_tokens
    config, choice = choose_layout(config, longest, max_new)
    if choice is not None:   # --plan auto's choice
        if config.layout.dry_run:
            print(json.dumps(choice.to_json()) if args.json else choice.describe())
            return 0
        print(choice.describe(), file=sys.stderr)
    say = Progress("generate")
    src = config.source
    with say(f"loading {src.model or src.model_dir or src.checkpoint}"):
        server = build_server(config, longest, max_new)
    lora = server.lora
    if lora is not None:
        say.line(f"serving {lora.describe()}"
                 + (f" from {src.unnamed_adapter}" if src.unnamed_adapter else "")
                 + ", unmerged")
    with say("compiling the prompt buckets and decode"):
        out = generate(server, prompts, max_new, tokenizer, progress=say.line)
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
