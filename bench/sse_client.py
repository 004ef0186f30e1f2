"""A lean streaming client for the HTTP bench: one HTTP/1.1 keep-alive connection over
asyncio streams per closed-loop client, a JSON POST, the chunked ``text/event-stream``
answer read a chunk at a time and split into its ``data:`` payloads. It does what the bench
needs and no more (no redirects, TLS or compression), so the client's own CPU, which
shares the machine's cores with the server, is small next to httpx's."""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator


class SSEConnection:
    """One keep-alive connection to ``http://host:port``; ``post_events`` streams one
    request's SSE payloads (bytes after ``data: ``), in order, until the body ends."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> "SSEConnection":
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc) -> None:
        self.writer.close()
        await self.writer.wait_closed()

    async def post_events(self, path: str, body: dict) -> AsyncIterator[bytes]:
        data = json.dumps(body).encode()
        self.writer.write(b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json"
                          b"\r\nContent-Length: %d\r\n\r\n%s" % (
                              path.encode(), self.host.encode(), self.port, len(data), data))
        status = await self.reader.readline()
        headers = {}
        while (line := await self.reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            headers[k.strip().lower()] = v.strip()
        if b" 200 " not in status or headers.get("transfer-encoding") != "chunked":
            n = int(headers.get("content-length", 0))
            raise RuntimeError(f"{status!r}: {await self.reader.readexactly(n)!r}")
        buf = b""
        while size := int((await self.reader.readline()).split(b";")[0], 16):
            buf += (await self.reader.readexactly(size + 2))[:-2]
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: "):
                    yield event[6:]
        await self.reader.readline()   # the blank line after the last (empty) chunk
