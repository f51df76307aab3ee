"""Outbound result callbacks: POST {url}/generated and {url}/validated, off the event loop's critical path.

`CallbackSender.submit(kind, url, payload, idempotency_id)` queues a payload and returns at once. A few sender
tasks POST it (timeout per attempt) with an `Idempotency-Key` header; a failure is retried with exponential
backoff (1, 2, 4 ... capped) on a timer, never by sleeping in a loop that holds others up. Unlike the
reference (spec-v2 §f 12) nothing is dropped after N attempts and /stop flushes rather than discards; memory
stays bounded by `max_pending`, and a payload refused at that bound is counted and logged, not lost silently.
What is still pending at exit is logged with its count (an on-disk spool replaces this later: keep the
interface).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp

from poc.server.logs import describe

log = logging.getLogger("poc.callbacks")

KINDS = ("generated", "validated")


@dataclass
class _Item:
    kind: str
    url: str
    payload: dict
    idempotency_id: str
    attempts: int = 0
    created: float = field(default_factory=time.monotonic)


class CallbackSender:
    def __init__(self, *, timeout: float = 10.0, max_pending: int = 10_000, backoff_base: float = 1.0,
                 backoff_max: float = 30.0, concurrency: int = 4, metrics=None):
        self.timeout, self.max_pending = timeout, max_pending
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.concurrency, self.metrics = concurrency, metrics
        self.pending = 0  # queued + in flight + waiting for a retry
        self.delivered = 0
        self._queue: asyncio.Queue[_Item] | None = None
        self._workers: list[asyncio.Task] = []
        self._timers: set[asyncio.TimerHandle] = set()
        self._session: aiohttp.ClientSession | None = None
        self._idle: asyncio.Event | None = None

    async def start(self) -> None:
        self._queue = asyncio.Queue()
        self._idle = asyncio.Event()
        self._idle.set()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout))
        self._workers = [asyncio.create_task(self._work(), name=f"callbacks-{i}") for i in range(self.concurrency)]

    def submit(self, kind: str, url: str, payload: dict, idempotency_id: str) -> bool:
        """Queue one POST to {url}/{kind}; False (counted, logged) when `max_pending` payloads already wait."""
        if kind not in KINDS:
            raise ValueError(f"callback kind must be one of {KINDS}, got {kind!r}")
        if self._queue is None:
            log.warning("callback %s to %s refused: the sender is not running", kind, url)
            return False
        if self.pending >= self.max_pending:
            self._count(kind, "dropped")
            log.warning("callback queue full (%d pending): %s payload %s to %s not queued", self.pending, kind,
                        idempotency_id, url)
            return False
        self._add(1)
        self._queue.put_nowait(_Item(kind, url, payload, idempotency_id))
        return True

    async def flush(self, timeout: float) -> int:
        """Wait until everything queued so far is delivered, or `timeout`; the number still pending."""
        if self._idle is not None and self.pending:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.pending

    async def close(self, timeout: float = 5.0) -> None:
        left = await self.flush(timeout)
        if left:
            log.warning("%d callback payload(s) still undelivered at shutdown", left)
        for t in self._timers:
            t.cancel()
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        self._queue = None

    # -------------------------------------------------------------------------------------------

    def _add(self, n: int) -> None:
        self.pending += n
        if self._idle is not None:
            (self._idle.clear if self.pending else self._idle.set)()
        if self.metrics is not None:
            self.metrics.callbacks_pending.set(self.pending)

    def _count(self, kind: str, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.callbacks.labels(kind, outcome).inc()
            if outcome == "dropped":
                self.metrics.error("callback_dropped")

    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            ok, why = await self._post(item)
            if ok:
                self.delivered += 1
                self._count(item.kind, "sent")
                self._add(-1)
                continue
            item.attempts += 1
            delay = min(self.backoff_max, self.backoff_base * 2.0 ** (item.attempts - 1))
            self._count(item.kind, "retried")
            log.warning("callback %s to %s failed (attempt %d: %s); retrying in %.1f s", item.kind, item.url,
                        item.attempts, why, delay)
            h = asyncio.get_running_loop().call_later(delay, self._requeue, item)
            self._timers.add(h)

    def _requeue(self, item: _Item) -> None:
        self._timers = {t for t in self._timers if not t.cancelled() and t.when() > time.monotonic()}
        if self._queue is not None:
            self._queue.put_nowait(item)

    async def _post(self, item: _Item) -> tuple[bool, str]:
        url = f"{item.url.rstrip('/')}/{item.kind}"
        try:
            async with self._session.post(url, json=item.payload,
                                          headers={"Idempotency-Key": item.idempotency_id}) as r:
                await r.read()
                if r.status < 400:
                    return True, ""
                return False, f"HTTP {r.status}"
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return False, describe(e)
