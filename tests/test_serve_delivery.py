"""Streamed tokens reach the event loop a phase at a time: with four rows decoding together,
the loop is woken (``call_soon_threadsafe``) at most once per server phase that generated
tokens plus once per request end, not once per token, and every run still gets all its
tokens, in order, before its end (fake engines: no JAX compile)."""
import asyncio

from test_serve_core import FakeEngine

from triax.inference.sampling import SamplingConfig
from triax.inference.server import Server
from triax.serving.app import Serving
from triax.serving.runs import Run
from triax.text.byte_tokenizer import ByteTokenizer

ROWS, NEW = 4, 12


def test_one_loop_wakeup_per_phase_not_per_token():
    server = Server([FakeEngine(slots=ROWS)])
    st = Serving(server, ByteTokenizer(), "fake")
    generated = []   # tokens generated so far, at each phase's end
    server.phase_listeners.append(lambda: generated.append(server.stats["generated_tokens"]))

    async def main():
        loop, wakeups = asyncio.get_running_loop(), [0]
        schedule = loop.call_soon_threadsafe

        def counted(*args, **kw):
            wakeups[0] += 1
            return schedule(*args, **kw)

        loop.call_soon_threadsafe = counted
        runs = [Run(st, [40 + 10 * i], SamplingConfig(), NEW, 0, [], "completions", 60)
                for i in range(ROWS)]
        texts = await asyncio.gather(*(r.collect() for r in runs))
        return texts, wakeups[0], [r.finish for r in runs]

    with server:
        texts, wakeups, finish = asyncio.run(main())
    # the fake engine's next token is the last + 1: each run's whole text, in order
    assert texts == [bytes(range(41 + 10 * i, 41 + 10 * i + NEW)).decode()
                     for i in range(ROWS)]
    assert finish == ["length"] * ROWS
    phases = sum(b > a for a, b in zip([0] + generated, generated))  # phases with tokens
    assert phases < ROWS * NEW                         # rows shared phases ...
    assert wakeups <= phases + ROWS, (wakeups, phases)  # ... and so did their wakeups
