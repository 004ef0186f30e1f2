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
import socket
import sys
import time

from triax.cli.common import start_devices
from triax.cli.flags import add_flags
from triax.cli.progress import Progress
from triax.cli.serving_flags import (add_model_flags, choose_layout, load_tokenizer_for,
                                     serve_config)
from triax.serve_config import HTTP, ServeConfig

# serve's own defaults: a bounded queue (an HTTP client gets 429, not an unbounded wait).
DEFAULTS = {"max_queue": 64}


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over OpenAI's HTTP API",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(p)
    add_flags(p, HTTP, ["host", "port"])
    add_flags(p, ServeConfig, ["max_len", "max_queue", "max_adapters", "max_adapter_rank",
                               "adapter_targets"], DEFAULTS)
    add_flags(p, HTTP, ["request_timeout", "served_model_name", "max_request_bytes",
                        "compile_cache", "warmup", "allow_adapter_updates"])
    p.set_defaults(func=run)


def _model_name(config: ServeConfig) -> str:
    src = config.source
    if config.http.served_model_name:
        return config.http.served_model_name
    if src.model:
        return src.model
    return os.path.basename(os.path.normpath(src.model_dir or src.checkpoint))


def listen_socket(host: str, port: int) -> socket.socket:
    """``host:port`` bound and listening now, before any engine is built, so a busy port or
    a bad address fails in a second with the flag named (``--port 0``: any free port)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise ValueError(f"--host {host!r}: not an address this machine can listen on ({e}); "
                         f"e.g. --host 127.0.0.1 or --host 0.0.0.0") from None
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); "
                         f"choose a free --port (0: any free port)") from None
    return sock


def use_compile_cache(directory) -> None:
    """Keep every compiled program in ``directory`` (None: leave JAX's setting alone)."""
    if directory is not None:
        import jax
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def run(args) -> int:
    started = time.perf_counter()
    config = serve_config(args, **DEFAULTS)
    sock = listen_socket(config.http.host, config.http.port)
    say = Progress("serve")
    start_devices()
    use_compile_cache(config.http.compile_cache_dir())
    import uvicorn  # after the device count is set: the app's modules start JAX

    from triax.inference.generate import build_server
    from triax.inference.warm_start import warm_replicas
    from triax.serving.app import create_app
    from triax.serving.chat_template import load_chat_template
    tokenizer = load_tokenizer_for(config.source)
    # longest: the cache length; build_server caps it at the model's context.
    longest = config.engine.max_len or 1 << 30
    config, choice = choose_layout(config, longest, max_new_tokens=0)
    if choice is not None:   # --plan auto's choice
        dry = config.layout.dry_run
        print(choice.describe(), file=sys.stdout if dry else sys.stderr, flush=True)
        if dry:
            return 0
    with say(f"loading {_model_name(config)}"):
        server = build_server(config, longest=longest, max_new_tokens=0)
    # The shortest prompt bucket and decode; longer buckets compile on use, and so may
    # replicas after the first (--warmup, inference.warm_start).
    with say("compiling the first prompt bucket and decode"):
        warm_replicas(server, [1], config.http.warmup, say.line)
    src = config.source
    layout = server.describe() + (f" from {src.unnamed_adapter}" if src.unnamed_adapter else
                                  "".join(f"; {n}={d}" for n, d in src.named_adapters()))
    app = create_app(server, tokenizer, _model_name(config),
                     load_chat_template(config.source.model_dir), config.http.request_timeout,
                     layout, config.http.max_request_bytes,
                     adapter_updates=config.http.allow_adapter_updates)

    class Uvicorn(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                host, port = self.servers[0].sockets[0].getsockname()[:2]
                print(f"triax serve: ready at http://{host}:{port} ({_model_name(config)}; "
                      f"{layout}; ready in {time.perf_counter() - started:.1f} s)", flush=True)

    # uvicorn re-raises the signal it drained on; after a drained SIGTERM, exit 0.
    signal.signal(signal.SIGTERM, lambda *_: None)
    # httptools and uvloop (pinned dependencies): h11 and asyncio's loop cost the event loop
    # more CPU per request (docs/benchmarks.md, "HTTP serving: where the time goes")
    Uvicorn(uvicorn.Config(app, host=config.http.host, port=config.http.port,
                           log_level="warning", lifespan="on", http="httptools",
                           loop="uvloop")).run(sockets=[sock])
    sys.stdout.flush()
    return 0
