"""``triax serve``: an OpenAI-compatible HTTP server (``/v1/completions``,
``/v1/chat/completions``, ``/v1/models``, ``/health``, ``/metrics``) over the replica
engines, on any layout ``generate`` accepts (docs/serving.md).

    triax serve --model tiny --seed 0 --mesh tensor=2 --replicas 4 --port 8000
    triax serve --model-dir Llama-3.2-1B --mesh tensor=2 --host 0.0.0.0

It prints the URL and the layout once it is ready; SIGTERM stops admitting, finishes what
is in flight and exits 0.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from triax.cli.common import start_devices
from triax.cli.serving_flags import (add_model_flags, build_from_args, choose_layout,
                                     load_tokenizer_for)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over OpenAI's HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default: 8000; 0: any free "
                   "port, printed when ready)")
    p.add_argument("--max-len", type=int, default=0, help="KV positions one sequence may hold: "
                   "a request's prompt plus max_tokens (default: the model's context)")
    p.add_argument("--max-queue", type=int, default=64, help="requests waiting for a slot at "
                   "most; more get 429 with Retry-After (default: 64)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may "
                   "take before it is cancelled with a 408 (default: 600)")
    p.add_argument("--served-model-name", default=None, help="the model name requests give "
                   "(default: --model's preset, or --model-dir's folder name)")
    p.set_defaults(func=run)


def _model_name(args) -> str:
    if args.served_model_name:
        return args.served_model_name
    if args.model:
        return args.model
    return os.path.basename(os.path.normpath(args.model_dir or args.checkpoint))


def run(args) -> int:
    if args.max_queue < 0 or args.request_timeout <= 0:
        raise ValueError("--max-queue must be >= 0 and --request-timeout > 0")
    start_devices()
    import uvicorn  # after the device count is set: the app's modules start JAX

    from triax.inference.sampling import SamplingConfig
    from triax.mesh import describe
    from triax.serving.app import create_app
    from triax.serving.chat_template import load_chat_template
    tokenizer = load_tokenizer_for(args)
    sampling = SamplingConfig(seed=args.seed, stop_tokens=tuple(args.stop_token))
    # longest: the cache length; build_server caps it at the model's context.
    longest = args.max_len or 1 << 30
    layout = choose_layout(args, longest, max_new_tokens=0)
    if layout[2] is not None:   # --plan auto's choice
        print(layout[2].describe(), file=sys.stdout if args.dry_run else sys.stderr, flush=True)
        if args.dry_run:
            return 0
    server = build_from_args(args, sampling, longest=longest, max_new_tokens=0, layout=layout,
                             max_queue=args.max_queue)
    server.warmup([1])  # the shortest prompt bucket and decode; longer buckets compile on use
    e = server.engines[0].ecfg
    layout = (f"{len(server.engines)} replica(s): "
              + "; ".join(describe(eng.mesh) for eng in server.engines)
              + f"; {e.max_batch} slots each, sequences up to {e.max_len} positions; KV pool "
              + ", ".join(f"{eng.kv.total} blocks × {eng.kv.block_size}"
                          for eng in server.engines))
    app = create_app(server, tokenizer, _model_name(args), load_chat_template(args.model_dir),
                     args.request_timeout, layout)

    class Uvicorn(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"triax serve: ready at http://{host}:{port} ({_model_name(args)}; "
                      f"{layout})", flush=True)

    # uvicorn re-raises the signal it drained on; after a drained SIGTERM, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    Uvicorn(uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                           lifespan="on")).run()
    sys.stdout.flush()
    return 0
