"""One choice of one request as the server generates it (``Run``): submitted to the
``Server`` with its own sampling and seed, its tokens fed through an asyncio queue to its
detokenizer, so streamed and non-streamed answers come from the same tokens. Stop strings,
timeouts and client disconnects end it through ``Server.cancel``, which frees its slot.
``merged`` interleaves several runs' deltas (``n``, batched prompts) into one stream."""
from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Optional

from triax.inference.adapter_table import AdapterNotFound
from triax.inference.errors import ContextLengthError, InferenceError
from triax.inference.request import QueueFullError
from triax.inference.sampling import SamplingConfig, SamplingError
from triax.serving.detokenize import Detokenizer
from triax.serving.errors import APIError

TIMEOUT_HEADER = "x-request-timeout"  # seconds; may only lower the server's --request-timeout


class Run:
    """One submitted choice: its queue of tokens (and their log-probabilities), its
    detokenizer, its finish reason. ``keep=False``: the tokens are not part of the answer
    (``echo`` with ``max_tokens: 0`` generates one token for the prompt's logprobs);
    ``adapter``: the LoRA adapter it runs with (None: the base)."""

    def __init__(self, st, prompt: list[int], sampling: SamplingConfig, max_new: int,
                 seed: Optional[int], stop: list[str], endpoint: str, timeout: float,
                 index: int = 0, keep: bool = True, priority: int = 0,
                 adapter: Optional[str] = None):
        self.st, self.prompt, self.endpoint, self.index, self.keep = (st, prompt, endpoint,
                                                                        index, keep)
        self.detok = Detokenizer(st.tokenizer, stop)
        self.queue: asyncio.Queue = asyncio.Queue()
        self.timeout, self.done, self.finish = timeout, False, ""
        self.submitted = time.perf_counter()
        self.entries: list = []          # (token, logprob entry) of every kept token
        self.prompt_logprobs: Optional[list] = None
        # tokens reach the loop a phase at a time, the end at once (serving.delivery)
        loop, box, put = asyncio.get_running_loop(), st.mailbox, self.queue.put_nowait
        try:
            self.rid = st.server.submit(prompt, max_new, seed=seed, sampling=sampling,
                                        on_token=lambda t, s, e=None: box.post(loop, put,
                                                                               (t, s, e)),
                                        priority=priority, adapter=adapter)
        except QueueFullError as e:
            st.metrics.rejected.labels("429").inc()
            raise APIError(429, str(e), code="queue_full", headers={"Retry-After": "1"})
        except ContextLengthError as e:   # the engine's one context check, in the
            # HTTP field's name
            raise APIError(400, str(e).replace("max_new_tokens", "max_tokens"),
                           param="max_tokens" if e.fits else "prompt",
                           code="context_length_exceeded") from None
        except AdapterNotFound as e:   # unloaded since the request was checked
            raise APIError(404, str(e), param="model", code="model_not_found") from None
        except (InferenceError, SamplingError) as e:
            raise APIError(400, str(e), param="prompt", code="invalid_prompt") from None
        st.server.future(self.rid).add_done_callback(lambda f: box.post_now(loop, put, None))
        # one timer for the request, not one armed per token
        self.timed_out = False
        self._timer = loop.call_later(timeout, self._time_out)

    def _time_out(self) -> None:
        self.timed_out = True
        self.queue.put_nowait(None)   # wakes a waiting _next

    def cached_tokens(self) -> int:
        """Its prompt's positions read from cached prefix blocks (``Result.cached_tokens``)."""
        res = self.st.server.results.get(self.rid)
        return res.cached_tokens if res else 0

    @property
    def logprob(self) -> float:
        """The cumulative log-probability of the kept tokens (``best_of`` ranks by it)."""
        return sum(e["logprob"] for _, e in self.entries if e is not None)

    async def _next(self):
        item = None if self.timed_out else await self.queue.get()
        if self.timed_out:
            raise APIError(408, f"the request ran past its timeout of {self.timeout:g} s; "
                                f"raise it with the {TIMEOUT_HEADER} header or the server's "
                                f"--request-timeout, or lower max_tokens",
                           code="timeout") from None
        return item

    async def deltas(self) -> AsyncIterator[tuple[str, list]]:
        """``(text, [(token, entry), ...])`` as text becomes final, with the tokens since the
        last; sets ``finish``. Raises ``APIError`` on a timeout or an engine failure;
        cancels the request if the caller stops listening."""
        m, last, pending = self.st.metrics, None, []
        try:
            while True:
                item = await self._next()
                if item is None:
                    break
                tok, t, entry = item
                (m.ttft.observe(t - self.submitted) if last is None else m.itl.observe(t - last))
                last = t
                if entry is not None and "prompt" in entry:
                    self.prompt_logprobs = entry["prompt"]
                if not self.keep:
                    continue
                pending.append((tok, entry))
                self.entries.append((tok, entry))
                delta = self.detok.push(tok)
                if delta:
                    yield delta, pending
                    pending = []
                if self.detok.stopped:
                    self.st.server.cancel(self.rid)
                    self.finish = "stop"
                    break
            if not self.finish:
                try:
                    res = self.st.server.future(self.rid).result(0)
                except Exception as e:  # the engine failed on this request
                    raise APIError(500, f"generation failed: {e}", code="engine_error") \
                        from None
                if self.prompt_logprobs is None:
                    self.prompt_logprobs = res.prompt_logprobs
                self.finish = "stop" if res.finish_reason == "stop" and self.keep else "length"
                m.requests.labels(self.endpoint, self.finish, str(res.replica)).inc()
                tail = self.detok.flush()
                if tail or pending:
                    yield tail, pending
            else:
                m.requests.labels(self.endpoint, self.finish, "").inc()
            m.latency.observe(time.perf_counter() - self.submitted)
            self.done = True
        finally:
            self._timer.cancel()
            if not self.done:  # timeout, failure or a client that left
                self.st.server.cancel(self.rid)

    async def collect(self) -> str:
        """The whole text (non-streamed)."""
        return "".join([d async for d, _ in self.deltas()])

    def cancel(self) -> None:
        self._timer.cancel()
        if not self.done:
            self.st.server.cancel(self.rid)


async def merged(runs: list[Run]) -> AsyncIterator[tuple[Run, Optional[str], list]]:
    """Every run's deltas as they come, ``(run, text, tokens)``, then ``(run, None, [])``
    once per run when it ends; a failure in one cancels the rest and is raised."""
    if len(runs) == 1:   # one run (most requests): its deltas as they come, no task between
        try:
            async for d, toks in runs[0].deltas():
                yield runs[0], d, toks
            yield runs[0], None, []
        finally:
            runs[0].cancel()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(run: Run):
        try:
            async for d, toks in run.deltas():
                await queue.put((run, d, toks))
            await queue.put((run, None, []))
        except Exception as e:   # (APIError: a timeout, an engine failure)
            await queue.put((run, e, []))

    tasks = [asyncio.create_task(pump(r)) for r in runs]
    try:
        for _ in range(len(runs)):
            while True:
                run, d, toks = await queue.get()
                if isinstance(d, BaseException):
                    raise d
                yield run, d, toks
                if d is None:
                    break
    finally:
        for t in tasks:
            t.cancel()
        for r in runs:
            r.cancel()
