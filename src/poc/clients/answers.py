"""The answers of the servers we call, read with a cap sized for what the caller needs.

Whoever calls /warmup, /pooled or a pow init chooses the URL we call, so its answer is an attacker's: read whole and
parsed on the event loop, a 256 MB answer to a /warmup poll stalled /health for 12.9 s and added 1.5 GB of RSS, again
at every poll. `read_capped` stops at the cap (the Content-Length is checked first; a chunked or lying answer is cut
while it arrives, and the connection is dropped, not drained), so a longer answer is a failed call (AnswerTooLarge, a
ClientError: every caller already treats those as an unreachable destination and logs the reason), and what is parsed
is never over the cap: a JSON document of 64 KiB parses on the loop in well under 10 ms.
"""

from __future__ import annotations

import json

import aiohttp

ACK_CAP = 4 << 10  # an acknowledgement ({"status": "ok"}) or a short status: what callbacks and heartbeats get back
PARAMS_CAP = 64 << 10  # an answer that carries a params object: /warmup/params, an orchestrator's connect/config/ready


class AnswerTooLarge(aiohttp.ClientPayloadError):
    """An answer over its cap: the call failed (its caller retries or reports it as any other failure)."""


async def read_capped(resp: aiohttp.ClientResponse, cap: int) -> bytes:
    """The body of `resp`, at most `cap` bytes (decompressed); AnswerTooLarge, with the connection closed, past it."""
    n = resp.content_length
    if n is not None and n > cap:
        resp.close()
        raise AnswerTooLarge(f"{resp.method} {resp.url}: an answer of {n} bytes is over the {cap}-byte limit")
    buf = bytearray()
    while chunk := await resp.content.read(cap + 1 - len(buf)):
        buf += chunk
        if len(buf) > cap:
            resp.close()
            raise AnswerTooLarge(f"{resp.method} {resp.url}: the answer is over the {cap}-byte limit")
    return bytes(buf)


def parse(raw: bytes):
    """The JSON document `raw` holds (any type), None for an empty answer; ValueError when it is not JSON."""
    return json.loads(raw) if raw.strip() else None
