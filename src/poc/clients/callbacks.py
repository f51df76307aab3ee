"""Outbound deliveries that must arrive: result callbacks ({url}/generated, {url}/validated), the warmup's
{callback_url}/warmup/complete and the orchestrator's {url}/results, off the event loop's critical path.

`submit(kind, url, payload, idempotency_id)` takes a payload and returns at once; `await put(...)` returns once
the record is durable. The records themselves (taken, spooled, held, released, counted, replayed at start; what a
failing disk does) are kept by the sender's `Outbox` (outbox.py); this module delivers them. With `merge=KEY` a
record is spooled at once but held: `release(KEY)` lets everything held under KEY go out, merged into POSTs to
{url}/{kind} (list fields such as artifacts, nonces, dist and dropped_nonces concatenated in order, the rest taken
from the first record, and `record_ids`: the ids of the records it carries). A POST carries one short
Idempotency-Key whatever it holds (a record's id, or "merged-" and a hash of the ids), so no header grows with the
merge, and a merged body stays under `max_post_bytes` (what does not fit goes in the next POST; a 413 halves the
POSTs to that url from then on). /api/v1/pow generation spools each batch as it is computed this way and releases
every callback_interval, so a kill -9 loses no computed batch and the MLNode still gets merged posts; held records
found in the spool at start are replayed, merged, at once. A failed group is retried as a unit. With a spool
directory (`spool_dir`, see spool.py) every record is appended and fsynced before the first send, re-sent until
acknowledged, and replayed by `start()` after a restart; without one (unit tests, `ServerConfig.spool_dir=None`)
records live in memory only. A few sender tasks POST {url}/{kind} (a record is its (url, id) pair: the same id to
two destinations is two records, never merged or deduplicated into one; the orchestrator's results also carry
`idempotency_id` in the body, so it can drop repeats); a failure is retried on a timer with capped, jittered
exponential backoff, never by sleeping in a loop that holds others up. Connection errors, timeouts, 5xx,
408/413/429 and an answer over 4 KiB (answers.ACK_CAP: an acknowledgement is all we read; the connection is
dropped, not drained) are retried. Any other 4xx (400, 401, 403, 404, 409, 410, 422, ...) is a refusal: after
`refusal_limit` (1: not retried) of them in a row the record is moved to dead-letter.jsonl in the spool directory
(one JSON line: id, kind, url, status, reason, dead_at, payload; fsynced, never replayed, kept for an operator,
listed by `python -m poc.clients.spool dead-letter`). So is a record past its `lifetime` (seconds from when it was
made, a wall-clock time kept in the spool, so a restart does not renew it) once a send of it failed. Each move logs
one ERROR line naming kind, id, url and status and counts poc_callbacks_total{outcome="dead_letter"},
poc_errors_total{kind="callback_dead_letter"} and poc_callbacks_dead_letter_records (the file's records); without a
spool directory only the line and the counts remain. Several pending orchestrator results for one worker go out as
one POST {url}/results/batch (one at a time to an orchestrator whose batch route answers 404, 405 or 501).
`max_pending` bounds the pending records per destination url (`max_pending_total` in all), so a dead consumer
cannot starve another: a payload refused at that bound is counted and logged, not lost silently, and a producer
that must not lose anything asks `room(url)` first and waits (`wait_room`). When the spool's disk fails, records
are kept in memory and sent from there (outbox.py); those still memory-only at exit are counted in the shutdown
warning: they are lost.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import deque

import aiohttp

from poc.clients.answers import ACK_CAP, parse, read_capped
from poc.clients.outbox import Outbox, Record
from poc.logs import describe

log = logging.getLogger("poc.callbacks")

# what a 2xx must also say to count as an acknowledgement
KINDS = {"generated": None, "validated": None, "warmup/complete": None, "results": "ok"}
BATCH_KIND = "results"  # several pending of this kind to one url go out as {url}/results/batch
WARN_EVERY = 5.0  # seconds between failure lines per url
RETRYABLE_4XX = {408, 413, 429}  # timeout, too large (split and sent again), too many requests: worth another try
TOO_LARGE = 413
NO_ROUTE = {404, 405, 501}  # what a POST {url}/results/batch gets from an orchestrator that lacks that route


def permanent(status: int | None) -> bool:
    """A 4xx that says the request itself is refused (400, 404, 410, 422, ...): repeating it will not help."""
    return status is not None and 400 <= status < 500 and status not in RETRYABLE_4XX


class CallbackSender:
    """Delivers the records its `outbox` keeps: worker tasks, merged and batched POSTs, caps on their size,
    retries with backoff, the dead-letter file."""

    def __init__(self, *, timeout: float = 10.0, max_pending: int = 10_000, backoff_base: float = 1.0,
                 backoff_max: float = 30.0, concurrency: int = 4, metrics=None, spool_dir: str | None = None,
                 segment_records: int = 1000, batch_max: int = 50, refusal_limit: int = 1, merge_max: int = 10_000,
                 max_pending_total: int | None = None, max_post_bytes: int = 1_000_000,
                 lifetime: float | None = 1800.0):
        self.outbox = Outbox(kinds=KINDS, max_pending=max_pending, max_pending_total=max_pending_total,
                             metrics=metrics, spool_dir=spool_dir, segment_records=segment_records)
        self.timeout = timeout
        self.max_post_bytes = max(1, max_post_bytes)  # a merged POST's body (about), under aiohttp's 1 MiB default
        self.lifetime = lifetime  # seconds from a record's creation; then, once a send failed, the dead-letter file
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.concurrency, self.metrics, self.batch_max = concurrency, metrics, batch_max
        self.merge_max = merge_max  # records in one merged POST: an interval's batches, however small they are
        self.refusal_limit = max(1, refusal_limit)
        self.dead_lettered = 0
        self._post_cap: dict[str, int] = {}  # url -> bytes per merged POST after it answered 413
        self.dead_letter_records = 0  # lines in the dead-letter file (counted at start, then as they are added)
        self.delivered = 0
        self._workers: list[asyncio.Task] = []
        self._timers: set[asyncio.TimerHandle] = set()
        self._session: aiohttp.ClientSession | None = None
        self.policy = None  # a clients.urlpolicy.UrlPolicy: every connection obeys it (create_app sets it)
        self._warned: dict[tuple, float] = {}
        self._failed: dict[tuple, int] = {}
        self._no_batch: set[str] = set()  # urls whose /results/batch is missing: their results go out singly

    # ------------------------------------------------------------------------------------- life cycle

    async def start(self) -> None:
        """Open the spool and queue what an earlier process left unacknowledged, then start sending."""
        await self.outbox.open()
        if self.spool is not None:
            try:
                self.dead_letter_records = await self.outbox.run_io(self.spool.dead_letter_count)
            except OSError:
                pass
            if self.metrics is not None:
                self.metrics.callbacks_dead_letter.set(self.dead_letter_records)
        self._session = (self.policy.session(self.timeout) if self.policy else
                         aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)))
        self._workers = [asyncio.create_task(self._work(), name=f"callbacks-{i}") for i in range(self.concurrency)]
        self.outbox.taking = True

    async def close(self, timeout: float = 5.0) -> None:
        left = await self.flush(timeout)
        self.outbox.taking = False
        if left:
            lost = self.memory_only if self.spool else left
            where = f"they stay in {self.spool.dir} and are re-sent after a restart" if self.spool else "memory only"
            if self.spool and lost:
                where = (f"{left - lost} stay in {self.spool.dir} and are re-sent after a restart; {lost} were kept "
                         f"in memory only (the spool failed: {self.spool_error}) and are lost")
            (log.error if lost else log.warning)("%d callback payload(s) still undelivered at shutdown (%s)", left,
                                                 where)
        for t in self._timers:
            t.cancel()
        for w in self._workers:
            w.cancel()
        await asyncio.gather(*self._workers, *self.outbox.stores, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        await self.outbox.close()

    # -------------------------------------------------------------------------------------- intake

    def submit(self, kind: str, url: str, payload: dict, idempotency_id: str, merge: str | None = None,
               force: bool = False) -> bool:
        """Take one POST to {url}/{kind}; False (counted, logged) when `max_pending` payloads already wait for that
        url (or `max_pending_total` in all), unless `force` (a producer handing over its last few records)."""
        r = self.outbox.reserve(kind, url, idempotency_id, force)
        if r != "new":
            return r is not None
        self.outbox.store_soon(kind, url, payload, idempotency_id, merge)
        return True

    async def put(self, kind: str, url: str, payload: dict, idempotency_id: str, force: bool = False) -> bool:
        """`submit`, returning once the record is on disk (spool mode): a caller that reports the payload
        elsewhere afterwards (an NDJSON line) knows it will be delivered even after a crash."""
        r = self.outbox.reserve(kind, url, idempotency_id, force)
        if r != "new":
            return r is not None
        await self.outbox.store(kind, url, payload, idempotency_id)
        return True

    # the records are the outbox's (outbox.py): what callers ask about them, it answers
    async def stored(self) -> None:
        await self.outbox.stored()

    def release(self, merge: str, final: bool = False) -> None:
        self.outbox.release(merge, final)

    def room(self, url: str) -> bool:
        return self.outbox.room(url)

    async def wait_room(self, url: str, timeout: float | None = None) -> bool:
        return await self.outbox.wait_room(url, timeout)

    # -------------------------------------------------------------------------------------- status

    @property
    def pending(self) -> int:
        return self.outbox.pending

    @property
    def spool(self):
        return self.outbox.spool

    @property
    def spool_error(self) -> str | None:
        return self.outbox.spool_error

    @property
    def memory_only(self) -> int:
        return self.outbox.memory_only

    @property
    def replayed(self) -> int:
        return self.outbox.replayed

    async def flush(self, timeout: float) -> int:
        return await self.outbox.flush(timeout)

    def pending_for(self, url: str) -> int:
        return self.outbox.pending_for(url)

    async def flush_url(self, url: str, timeout: float) -> int:
        return await self.outbox.flush_url(url, timeout)

    async def wait_acked(self, url: str, idempotency_id: str, timeout: float) -> bool:
        return await self.outbox.wait_acked(url, idempotency_id, timeout)

    def last_error(self, url: str, idempotency_id: str) -> str:
        i = self.outbox.items.get((url, idempotency_id))
        return i.last_error if i else ""

    # ------------------------------------------------------------------------------------- sending

    def _take(self) -> list[Record]:
        """The next item, with more ready for the same url: up to batch_max orchestrator results (one
        /results/batch) or up to merge_max records of the same merge key (one merged POST, in the order they were
        taken: the reference posts an interval's batches as one). A group stays under max_post_bytes (or what the
        url's 413 taught us), whatever the merge holds: the rest goes in the next POST."""
        first = self.outbox.ready.popleft()
        group = [first]
        batch = first.kind == BATCH_KIND and first.url not in self._no_batch
        if (batch or first.merge is not None) and self.outbox.ready:
            rest = deque()
            cap = self.batch_max if first.merge is None else self.merge_max
            room = self._post_cap.get(first.url, self.max_post_bytes) - first.size
            while self.outbox.ready and len(group) < cap:
                i = self.outbox.ready.popleft()
                same = i.kind == first.kind and i.url == first.url and i.merge == first.merge
                if same and i.size > room:
                    rest.append(i)
                    break  # keeps the order: what does not fit starts the next POST
                if same:
                    room -= i.size
                (group if same else rest).append(i)
            rest.extend(self.outbox.ready)
            self.outbox.ready = rest
        if first.merge is not None:
            group.sort(key=lambda i: i.created)  # a retried group may be queued behind newer records
        return group

    async def _work(self) -> None:
        while True:
            while not self.outbox.ready:
                self.outbox.wake.clear()
                await self.outbox.wake.wait()
            group, bodies = await self._read(self._take())
            if not group:
                continue
            t_post = time.monotonic()
            ok, why, status = await self._post(group, bodies)
            if self.metrics is not None:  # the POST's time, and (delivered) each record's since it was created
                now = time.monotonic()
                self.metrics.callback_post_seconds.labels(group[0].kind).observe(now - t_post)
                for i in group if ok else ():
                    self.metrics.callback_delivery_seconds.labels(i.kind).observe(now - i.created)
            if ok:
                await self._acknowledge(group)
                continue
            if status in NO_ROUTE and len(group) > 1 and group[0].kind == BATCH_KIND and group[0].merge is None:
                # the reference needs /results/batch only after a failure, so an orchestrator may lack it: one at
                # a time from now on (not a refusal of these results)
                url = group[0].url
                if url not in self._no_batch:
                    self._no_batch.add(url)
                    log.warning("%s/results/batch answered HTTP %d: results to it go out one at a time", url, status)
                self.outbox.ready.extendleft(reversed(group))
                self.outbox.wake.set()
                continue
            if status == TOO_LARGE and len(group) > 1:
                # our POST was too large for this consumer: smaller POSTs from now on (a bug of ours to fix, never
                # a reason to give up on the records), sent again at once
                url = group[0].url
                cap = max(1, sum(i.size for i in group) // 2)
                self._post_cap[url] = min(cap, self._post_cap.get(url, cap))
                log.warning("%s/%s answered HTTP 413 to %d records: POSTs to it now carry at most %d bytes", url,
                            group[0].kind, len(group), self._post_cap[url])
                self.outbox.ready.extendleft(reversed(group))
                self.outbox.wake.set()
                continue
            if permanent(status):
                for item in group:
                    item.refusals += 1
            else:
                for item in group:
                    item.refusals = 0
            now = time.time()
            dead = [(i, b, "refused") for i, b in zip(group, bodies) if i.refusals >= self.refusal_limit]
            dead += [(i, b, "expired") for i, b in zip(group, bodies) if i.refusals < self.refusal_limit
                     and self.lifetime is not None and now - i.born >= self.lifetime]
            if dead and await self._dead_letter(dead, status, why):
                gone = {id(i) for i, _, _ in dead}
                group = [i for i in group if id(i) not in gone]
                if not group:
                    continue
            self._warn(group[0], len(group), why, self._retry_later(group, why))

    def _retry_later(self, group: list[Record], why: str) -> float:
        """Queue the group again, as a unit (a merged POST is retried whole), after a jittered backoff."""
        for item in group:
            item.attempts += 1
            item.last_error = why
        d = min(self.backoff_max, self.backoff_base * 2.0 ** (max(i.attempts for i in group) - 1))
        delay = d / 2 + random.random() * d / 2  # jittered: many records after one outage do not retry in step
        self.outbox.count(group[0].kind, "retried", len(group))
        h = asyncio.get_running_loop().call_later(delay, self._requeue, group)
        self._timers.add(h)
        return delay

    def _warn(self, item: Record, n: int, why: str, delay: float) -> None:
        """One line per url every WARN_EVERY seconds at most: an outage with a backlog does not flood the log."""
        key = (item.kind, item.url)
        self._failed[key] = self._failed.get(key, 0) + n
        now = time.monotonic()
        if now - self._warned.get(key, float("-inf")) < WARN_EVERY:
            return
        self._warned[key] = now
        log.warning("callback %s to %s failed (%s; %d failed send(s) since the last such line, %d pending); "
                    "retrying with backoff (next in %.1f s)", item.kind, item.url, why, self._failed.pop(key),
                    self.pending, delay)

    def _requeue(self, group: list[Record]) -> None:
        now = time.monotonic()
        self._timers = {t for t in self._timers if not t.cancelled() and t.when() > now}
        live = [i for i in group if i.key in self.outbox.items]
        if self.outbox.taking and live:
            self.outbox.ready.extend(live)
            self.outbox.wake.set()

    async def _acknowledge(self, group: list[Record], outcome: str = "sent") -> None:
        gone = await self.outbox.remove(group, outcome != "dead_letter")  # dead-lettered: wait_acked() says False
        self.delivered += gone if outcome != "dead_letter" else 0
        self.outbox.count(group[0].kind, outcome, len(group))

    async def _dead_letter(self, dead: list[tuple[Record, dict, str]], status: int | None, why: str) -> bool:
        """Move records refused for good ("refused") or past their lifetime ("expired") to the spool's dead-letter
        file, one ERROR line each; False (they are retried) when that file cannot be written."""
        if self.spool is not None:
            try:
                await self.outbox.run_io(self.spool.dead_letter,
                                   [(i.kind, i.url, i.idempotency_id, b, self._reason(i, r, why)) for i, b, r in dead],
                                   status, why)
            except (OSError, TypeError, ValueError) as e:
                log.warning("dead-letter write failed %s: %d record(s) stay pending", describe(e), len(dead))
                return False
            where = f"moved to {self.spool.dead_letter_path}"
        else:
            where = "not kept (no spool directory)"
        for i, _, r in dead:
            if r == "refused":
                log.error("callback %s %s to %s refused permanently (HTTP %s, %d time(s) in a row): %s", i.kind,
                          i.idempotency_id, i.url, status, i.refusals, where)
            else:
                log.error("callback %s %s to %s expired: not delivered %.0f s after it was made (%d attempt(s), last: "
                          "%s): %s", i.kind, i.idempotency_id, i.url, time.time() - i.born, i.attempts + 1, why, where)
        items = [i for i, _, _ in dead]
        await self._acknowledge(items, "dead_letter")  # off the spool: wait_acked() says False
        self.dead_lettered += len(items)
        if self.spool is not None:
            self.dead_letter_records += len(items)
            if self.metrics is not None:
                self.metrics.callbacks_dead_letter.set(self.dead_letter_records)
        return True

    def _reason(self, item: Record, outcome: str, why: str) -> str:
        if outcome == "refused":
            return why
        return f"expired after {time.time() - item.born:.0f} s and {item.attempts + 1} attempt(s); last: {why}"

    async def _read(self, group: list[Record]) -> tuple[list[Record], list[dict]]:
        """The group's payloads. A record whose read fails (EMFILE, EIO) is retried later on its own; one that
        reads back but does not decode can never be sent: it is acknowledged locally, with a warning. Either
        way the rest of the group goes out now (never acknowledged unsent with it)."""
        keep, bodies = [], []
        for item in group:
            if item.payload is not None:
                keep.append(item)
                bodies.append(item.payload)
                continue
            try:
                bodies.append(await self.outbox.run_io(self.spool.read, item.entry))
                keep.append(item)
            except OSError as e:
                why = f"spool read failed {describe(e)}"
                self._warn(item, 1, why, self._retry_later([item], why))
            except (ValueError, KeyError) as e:
                log.warning("spool record %s %s cannot be decoded %s: dropped (acknowledged locally)", item.kind,
                            item.idempotency_id, describe(e))
                await self._acknowledge([item], "dropped")
        return keep, bodies

    async def _post(self, group: list[Record], bodies: list[dict]) -> tuple[bool, str, int | None]:
        """(acknowledged, why not, the HTTP status if one came back)."""
        first = group[0]
        base = first.url.rstrip("/")
        if len(group) == 1:
            url, body = f"{base}/{first.kind}", bodies[0]
        elif first.merge is not None:
            url, body = f"{base}/{first.kind}", merge_payloads(bodies)
        else:
            url, body = f"{base}/{first.kind}/batch", {"results": bodies}
        if len(group) > 1:
            # one short key per POST whatever it carries (every header stays far under the 8 KB limits of
            # aiohttp and nginx); the records' own ids travel in the body
            ids = [i.idempotency_id for i in group]
            key = "merged-" + hashlib.sha256("\n".join(ids).encode()).hexdigest()[:32]
            if first.merge is not None:
                body = {**body, "record_ids": ids}
        else:
            key = first.idempotency_id
        headers = {"Idempotency-Key": key}
        try:
            async with self._session.post(url, json=body, headers=headers) as r:
                if r.status >= 300:
                    return False, f"HTTP {r.status}", r.status
                raw = await read_capped(r, ACK_CAP)  # an acknowledgement: a longer answer is a failed POST
                want = KINDS[first.kind]
                if want is None:
                    return True, "", r.status
                try:
                    answer = parse(raw)
                except ValueError:
                    answer = None
                status = answer.get("status") if isinstance(answer, dict) else None
                if str(status).lower() == want:
                    return True, "", r.status
                return False, f"HTTP {r.status} without status {want!r}", r.status
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            return False, describe(e), None



def merge_payloads(bodies: list[dict]) -> dict:
    """One payload from several of one merge key: list fields concatenated in order, the others from the first."""
    out = dict(bodies[0])
    for k in {k for b in bodies for k, v in b.items() if isinstance(v, list)}:
        out[k] = [x for b in bodies for x in (b.get(k) or [])]
    return out
