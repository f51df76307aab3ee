"""Outbound deliveries that must arrive: result callbacks ({url}/generated, {url}/validated), the warmup's
{callback_url}/warmup/complete and the orchestrator's {url}/results, off the event loop's critical path.

`submit(kind, url, payload, idempotency_id)` takes a payload and returns at once; `await put(...)` returns once
the record is durable. With `merge=KEY` a record is spooled at once but held: `release(KEY)` lets everything held
under KEY go out, merged into POSTs to {url}/{kind} (list fields such as artifacts, nonces, dist and dropped_nonces
concatenated in order, the rest taken from the first record, and `record_ids`: the ids of the records it carries).
A POST carries one short Idempotency-Key whatever it holds (a record's id, or "merged-" and a hash of the ids), so
no header grows with the merge, and a merged body stays under `max_post_bytes` (what does not fit goes in the next
POST; a 413 halves the POSTs to that url from then on). /api/v1/pow generation spools each batch as it is
computed this way and releases every callback_interval, so a kill -9 loses no computed batch and the MLNode still
gets merged posts; held records found in the spool at start are replayed, merged, at once. A failed group is
retried as a unit. With a spool directory (`spool_dir`, see spool.py) every record is appended and fsynced
before the first send, re-sent until acknowledged, and replayed by `start()` after a restart; without one (unit
tests, `ServerConfig.spool_dir=None`) records live in memory only. A few sender tasks POST {url}/{kind} (a record
is its (url, id) pair: the same id to two destinations is two records, never merged or deduplicated into one; the
orchestrator's results also carry `idempotency_id` in the body, so it can drop repeats); a failure is retried on a
timer with capped, jittered exponential backoff, never by sleeping in a loop that holds others up. Connection
errors, timeouts, 5xx, 408/413/429 and an answer over 4 KiB (answers.ACK_CAP: an acknowledgement is all we read;
the connection is dropped, not drained) are retried. Any other 4xx (400, 401, 403, 404, 409, 410, 422, ...) is a
refusal: after `refusal_limit` (1: not retried) of them in a row the record is moved to dead-letter.jsonl in the
spool directory (one JSON line: id, kind, url, status, reason, dead_at, payload; fsynced, never replayed, kept for
an operator, listed by `python -m poc.clients.spool dead-letter`). So is a record past its `lifetime` (seconds from
when it was made, a wall-clock time kept in the spool, so a restart does not renew it) once a send of it failed.
Each move logs one ERROR line naming kind, id, url and status and counts poc_callbacks_total{outcome="dead_letter"},
poc_errors_total{kind="callback_dead_letter"} and poc_callbacks_dead_letter_records (the file's records); without a
spool directory only the line and the counts remain. Several pending orchestrator results for one worker go out as
one POST {url}/results/batch (one at a time to an orchestrator whose batch route answers 404, 405 or 501).
Memory holds, per pending record, its id, kind, url and disk position (spool) or its payload (memory mode), and
`max_pending` bounds the count per destination url (`max_pending_total` in all), so a dead consumer cannot starve
another: a payload refused at that bound is counted and logged, not lost silently, and a producer that must not
lose anything asks `room(url)` first and waits (`wait_room`). What is pending at exit stays in the spool for the
next start.

When the spool's disk fails (ENOSPC, EIO, a deleted or read-only directory) a record is kept in memory instead
(still bounded by `max_pending`, so a producer is refused and stops once that fills) and sent from there: one
WARNING when the spool starts failing and one line when it works again (not one per record), the state in
`spool_error` (GET /health's "spool") and in poc_spool_ok / poc_errors_total{kind="spool_write"}. Every append
tries the disk again; the first that succeeds writes the memory-only records back to the spool, so they are
durable again. Records still memory-only at exit are counted in the shutdown warning: they are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import aiohttp

from poc.clients.answers import ACK_CAP, parse, read_capped
from poc.clients.spool import Entry, Spool
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


@dataclass
class _Item:
    kind: str
    url: str
    idempotency_id: str
    payload: dict | None = None  # memory mode, or a spool write that failed
    entry: Entry | None = None  # spool mode
    attempts: int = 0
    refusals: int = 0  # permanent refusals in a row
    merge: str | None = None  # sent merged with the other records of this key once released
    created: float = field(default_factory=time.monotonic)
    last_error: str = ""
    born: float = field(default_factory=time.time)  # wall clock, kept in the spool: the lifetime survives restarts
    size: int = 0  # bytes of the payload's JSON (about): bounds a merged POST

    @property
    def key(self) -> tuple[str, str]:
        return self.url, self.idempotency_id


class CallbackSender:
    def __init__(self, *, timeout: float = 10.0, max_pending: int = 10_000, backoff_base: float = 1.0,
                 backoff_max: float = 30.0, concurrency: int = 4, metrics=None, spool_dir: str | None = None,
                 segment_records: int = 1000, batch_max: int = 50, refusal_limit: int = 1, merge_max: int = 10_000,
                 max_pending_total: int | None = None, max_post_bytes: int = 1_000_000,
                 lifetime: float | None = 1800.0):
        self.timeout = timeout
        self.max_pending = max_pending  # per destination url: one dead consumer cannot starve another
        self.max_pending_total = max_pending_total or 10 * max_pending  # all destinations together (memory bound)
        self.max_post_bytes = max(1, max_post_bytes)  # a merged POST's body (about), under aiohttp's 1 MiB default
        self.lifetime = lifetime  # seconds from a record's creation; then, once a send failed, the dead-letter file
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self.concurrency, self.metrics, self.batch_max = concurrency, metrics, batch_max
        self.merge_max = merge_max  # records in one merged POST: an interval's batches, however small they are
        self.refusal_limit = max(1, refusal_limit)
        self.dead_lettered = 0
        self.spool = Spool(spool_dir, segment_records) if spool_dir else None
        self.pending = 0  # reserved + stored, not yet acknowledged
        self._per_url: dict[str, int] = {}  # the same, by destination
        self._room: asyncio.Event | None = None  # set whenever a record leaves (acknowledged or dead-lettered)
        self._post_cap: dict[str, int] = {}  # url -> bytes per merged POST after it answered 413
        self.dead_letter_records = 0  # lines in the dead-letter file (counted at start, then as they are added)
        self.delivered = 0
        self.replayed = 0
        # a record is (url, idempotency id): the same id to two destinations is two records
        self._items: dict[tuple[str, str], _Item] = {}  # stored (durable) and not yet acknowledged
        self._reserved: set[tuple[str, str]] = set()  # being written to the spool
        self._ready: deque[_Item] = deque()
        self._held: dict[str, list[_Item]] = {}  # merge key -> stored records waiting for release()
        self._released: OrderedDict[str, None] = OrderedDict()  # keys released for good (bounded: the last 1000)
        self._wake: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._acked: dict[tuple[str, str], asyncio.Future] = {}  # wait_acked() waiters
        self._workers: list[asyncio.Task] = []
        self._stores: set[asyncio.Task] = set()
        self._timers: set[asyncio.TimerHandle] = set()
        self._session: aiohttp.ClientSession | None = None
        self.policy = None  # a clients.urlpolicy.UrlPolicy: every connection obeys it (create_app sets it)
        self._io: ThreadPoolExecutor | None = None
        self._running = False
        self._warned: dict[tuple, float] = {}
        self._failed: dict[tuple, int] = {}
        self._no_batch: set[str] = set()  # urls whose /results/batch is missing: their results go out singly
        self.spool_error: str | None = None  # why the spool last failed, None while it works
        self._respooling = False

    # ------------------------------------------------------------------------------------- life cycle

    async def start(self) -> None:
        """Open the spool and queue what an earlier process left unacknowledged, then start sending."""
        self._wake, self._idle, self._room = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="poc-spool")  # one thread: appends stay in order
        if self.spool is not None:
            try:
                found = await self._run_io(self.spool.open)
            except OSError as e:  # the directory cannot even be listed: serve, from memory, and say so
                found = []
                self._spool_failed(e)
            for e in found:
                item = _Item(e.kind, e.url, e.id, entry=e, merge=e.merge, size=e.length)  # held ones too: their
                if e.created:  # owner is gone
                    item.born = e.created
                self._items[item.key] = item
                self._ready.append(item)
                self._add(1, e.url)
            try:
                self.dead_letter_records = await self._run_io(self.spool.dead_letter_count)
            except OSError:
                pass
            if self.metrics is not None:
                self.metrics.callbacks_dead_letter.set(self.dead_letter_records)
            self.replayed = len(self._items)
            if self.replayed:
                log.info("replaying %d spooled record(s) from %s", self.replayed, self.spool.dir)
                self._wake.set()
        self._session = (self.policy.session(self.timeout) if self.policy else
                         aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)))
        self._workers = [asyncio.create_task(self._work(), name=f"callbacks-{i}") for i in range(self.concurrency)]
        self._running = True

    async def close(self, timeout: float = 5.0) -> None:
        left = await self.flush(timeout)
        self._running = False
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
        await asyncio.gather(*self._workers, *self._stores, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
        if self._io is not None:
            if self.spool is not None:
                await self._run_io(self.spool.close)
            self._io.shutdown(wait=True)
            self._io = None

    # -------------------------------------------------------------------------------------- intake

    def submit(self, kind: str, url: str, payload: dict, idempotency_id: str, merge: str | None = None,
               force: bool = False) -> bool:
        """Take one POST to {url}/{kind}; False (counted, logged) when `max_pending` payloads already wait for that
        url (or `max_pending_total` in all), unless `force` (a producer handing over its last few records)."""
        r = self._reserve(kind, url, idempotency_id, force)
        if r != "new":
            return r is not None
        t = asyncio.get_running_loop().create_task(self._store(kind, url, payload, idempotency_id, merge))
        self._stores.add(t)
        t.add_done_callback(self._stores.discard)
        return True

    async def stored(self) -> None:
        """Return once every record submitted so far is stored (spooled, or kept in memory): a release after it
        covers them all. A finished store counts as stored before its done-callback takes it out of _stores: on
        Python 3.12 gather() of finished tasks is finished at once, so a loop that waited for _stores to empty
        would never give the event loop the turn that runs those callbacks (the server froze so after a stop)."""
        while pending := [t for t in self._stores if not t.done()]:
            await asyncio.wait(pending)

    async def put(self, kind: str, url: str, payload: dict, idempotency_id: str, force: bool = False) -> bool:
        """`submit`, returning once the record is on disk (spool mode): a caller that reports the payload
        elsewhere afterwards (an NDJSON line) knows it will be delivered even after a crash."""
        r = self._reserve(kind, url, idempotency_id, force)
        if r != "new":
            return r is not None
        await self._store(kind, url, payload, idempotency_id)
        return True

    def _reserve(self, kind: str, url: str, idempotency_id: str, force: bool = False) -> str | None:
        """"new" (counted as pending: store it), "dup" (already on its way) or None (refused)."""
        if kind not in KINDS:
            raise ValueError(f"callback kind must be one of {sorted(KINDS)}, got {kind!r}")
        if not self._running:
            log.warning("callback %s to %s refused: the sender is not running", kind, url)
            return None
        key = (url, idempotency_id)
        if key in self._items or key in self._reserved:
            return "dup"  # already on its way: the same record once is enough
        if not force and not self.room(url):
            self._count(kind, "dropped")
            log.warning("callback queue full (%d pending for %s, %d in all): %s payload %s not queued",
                        self._per_url.get(url, 0), url, self.pending, kind, idempotency_id)
            return None
        self._reserved.add(key)
        self._add(1, url)
        return "new"

    def room(self, url: str) -> bool:
        """Whether a record for `url` would be taken now: under the cap per destination and the total one. A
        producer that must not lose what it computed checks this first and waits (wait_room) instead."""
        return self._per_url.get(url, 0) < self.max_pending and self.pending < self.max_pending_total

    async def wait_room(self, url: str, timeout: float | None = None) -> bool:
        """Wait until `room(url)` (a record for it was acknowledged or dead-lettered), or `timeout`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.room(url):
            self._room.clear()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            try:
                await asyncio.wait_for(self._room.wait(), left)
            except asyncio.TimeoutError:
                return self.room(url)
        return True

    def release(self, merge: str, final: bool = False) -> None:
        """Send what is held under `merge`; with `final`, records still being written go out as soon as stored."""
        if final:
            self._released[merge] = None
            while len(self._released) > 1000:
                self._released.popitem(last=False)
        held = self._held.pop(merge, None)
        if held:
            self._ready.extend(held)
            self._wake.set()

    async def _store(self, kind: str, url: str, payload: dict, idempotency_id: str, merge: str | None = None) -> None:
        item = _Item(kind, url, idempotency_id, merge=merge)
        try:
            if self.spool is not None:
                try:
                    item.entry = await self._run_io(self.spool.append, idempotency_id, kind, url, payload, merge)
                except OSError as e:  # disk full, EIO, directory gone: send from memory (bounded by max_pending)
                    item.payload = payload
                    self._count(kind, "spool_error")
                    self._spool_failed(e)
                except (TypeError, ValueError) as e:  # unserialisable: this record only
                    item.payload = payload
                    self._count(kind, "spool_error")
                    log.warning("spool write failed %s: %s %s is sent from memory only", describe(e), kind,
                                idempotency_id)
                else:
                    if self.spool_error is not None:
                        self._spool_recovered()
            else:
                item.payload = payload
        finally:
            self._reserved.discard(item.key)
        item.size = item.entry.length if item.entry is not None else _json_size(payload) + len(idempotency_id) + 4
        self._items[item.key] = item
        if merge is not None and merge not in self._released:
            self._held.setdefault(merge, []).append(item)
            return
        self._ready.append(item)
        self._wake.set()

    # ---------------------------------------------------------------------------------- spool faults

    @property
    def memory_only(self) -> int:
        """Pending records that are not on disk (the spool failed when they were taken)."""
        return sum(1 for i in self._items.values() if i.entry is None) if self.spool is not None else 0

    def _spool_failed(self, e: OSError) -> None:
        """One WARNING when the spool starts failing, not one per record."""
        if self.metrics is not None:
            self.metrics.error("spool_write")
            self.metrics.spool_ok.set(0)
        if self.spool_error is None:
            log.warning("spool %s failed %s: results and callbacks are kept in memory (at most %d pending, then "
                        "producers are refused) and are lost if the process dies; every new record tries the disk "
                        "again", self.spool.dir, describe(e), self.max_pending)
        self.spool_error = f"{type(e).__name__}: {e}"

    def _spool_recovered(self) -> None:
        """The disk works again: say so once, and write the memory-only records back to the spool."""
        log.info("spool %s works again (after: %s); writing %d memory-only record(s) back to it", self.spool.dir,
                 self.spool_error, self.memory_only)
        self.spool_error = None
        if self.metrics is not None:
            self.metrics.spool_ok.set(1)
        if not self._respooling:
            self._respooling = True
            t = asyncio.get_running_loop().create_task(self._respool())
            self._stores.add(t)
            t.add_done_callback(self._stores.discard)

    async def _respool(self) -> None:
        try:
            for item in [i for i in self._items.values() if i.entry is None and i.payload is not None]:
                try:
                    entry = await self._run_io(self.spool.append, item.idempotency_id, item.kind, item.url,
                                               item.payload, item.merge)
                except OSError as e:
                    self._spool_failed(e)
                    return
                except (TypeError, ValueError):
                    continue
                if self._items.get(item.key) is item:
                    item.entry = entry  # the payload stays too: a send in progress may have read it already
                else:  # delivered meanwhile
                    with contextlib.suppress(OSError):
                        await self._run_io(self.spool.ack, [entry])
        finally:
            self._respooling = False

    # -------------------------------------------------------------------------------------- status

    async def flush(self, timeout: float) -> int:
        """Wait until everything taken so far is delivered, or `timeout`; the number still pending."""
        if self._idle is not None and self.pending:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.pending

    def pending_for(self, url: str) -> int:
        """Records for this url not yet acknowledged (being written included)."""
        return self._per_url.get(url, 0)

    async def flush_url(self, url: str, timeout: float) -> int:
        """Wait until nothing for `url` is pending, or `timeout`; the number still pending for it."""
        deadline = time.monotonic() + timeout
        while (n := self.pending_for(url)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return n

    async def wait_acked(self, url: str, idempotency_id: str, timeout: float) -> bool:
        """True once that record was acknowledged (or is not pending at all), False after `timeout`."""
        key = (url, idempotency_id)
        if key not in self._items and key not in self._reserved:
            return True
        fut = self._acked.get(key)
        if fut is None:
            fut = self._acked[key] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return False

    def last_error(self, url: str, idempotency_id: str) -> str:
        i = self._items.get((url, idempotency_id))
        return i.last_error if i else ""

    # ------------------------------------------------------------------------------------- sending

    def _add(self, n: int, url: str) -> None:
        self.pending += n
        left = self._per_url.get(url, 0) + n
        if left > 0:
            self._per_url[url] = left
        else:
            self._per_url.pop(url, None)
        if n < 0 and self._room is not None:
            self._room.set()
        if self._idle is not None:
            (self._idle.clear if self.pending else self._idle.set)()
        if self.metrics is not None:
            self.metrics.callbacks_pending.set(self.pending)

    def _count(self, kind: str, outcome: str, n: int = 1) -> None:
        if self.metrics is not None:
            self.metrics.callbacks.labels(kind, outcome).inc(n)
            if outcome in ("dropped", "dead_letter"):
                self.metrics.error(f"callback_{outcome}")

    async def _run_io(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    def _take(self) -> list[_Item]:
        """The next item, with more ready for the same url: up to batch_max orchestrator results (one
        /results/batch) or up to merge_max records of the same merge key (one merged POST, in the order they were
        taken: the reference posts an interval's batches as one). A group stays under max_post_bytes (or what the
        url's 413 taught us), whatever the merge holds: the rest goes in the next POST."""
        first = self._ready.popleft()
        group = [first]
        batch = first.kind == BATCH_KIND and first.url not in self._no_batch
        if (batch or first.merge is not None) and self._ready:
            rest = deque()
            cap = self.batch_max if first.merge is None else self.merge_max
            room = self._post_cap.get(first.url, self.max_post_bytes) - first.size
            while self._ready and len(group) < cap:
                i = self._ready.popleft()
                same = i.kind == first.kind and i.url == first.url and i.merge == first.merge
                if same and i.size > room:
                    rest.append(i)
                    break  # keeps the order: what does not fit starts the next POST
                if same:
                    room -= i.size
                (group if same else rest).append(i)
            rest.extend(self._ready)
            self._ready = rest
        if first.merge is not None:
            group.sort(key=lambda i: i.created)  # a retried group may be queued behind newer records
        return group

    async def _work(self) -> None:
        while True:
            while not self._ready:
                self._wake.clear()
                await self._wake.wait()
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
                self._ready.extendleft(reversed(group))
                self._wake.set()
                continue
            if status == TOO_LARGE and len(group) > 1:
                # our POST was too large for this consumer: smaller POSTs from now on (a bug of ours to fix, never
                # a reason to give up on the records), sent again at once
                url = group[0].url
                cap = max(1, sum(i.size for i in group) // 2)
                self._post_cap[url] = min(cap, self._post_cap.get(url, cap))
                log.warning("%s/%s answered HTTP 413 to %d records: POSTs to it now carry at most %d bytes", url,
                            group[0].kind, len(group), self._post_cap[url])
                self._ready.extendleft(reversed(group))
                self._wake.set()
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

    def _retry_later(self, group: list[_Item], why: str) -> float:
        """Queue the group again, as a unit (a merged POST is retried whole), after a jittered backoff."""
        for item in group:
            item.attempts += 1
            item.last_error = why
        d = min(self.backoff_max, self.backoff_base * 2.0 ** (max(i.attempts for i in group) - 1))
        delay = d / 2 + random.random() * d / 2  # jittered: many records after one outage do not retry in step
        self._count(group[0].kind, "retried", len(group))
        h = asyncio.get_running_loop().call_later(delay, self._requeue, group)
        self._timers.add(h)
        return delay

    def _warn(self, item: _Item, n: int, why: str, delay: float) -> None:
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

    def _requeue(self, group: list[_Item]) -> None:
        now = time.monotonic()
        self._timers = {t for t in self._timers if not t.cancelled() and t.when() > now}
        live = [i for i in group if i.key in self._items]
        if self._running and live:
            self._ready.extend(live)
            self._wake.set()

    async def _acknowledge(self, group: list[_Item], outcome: str = "sent") -> None:
        entries = [i.entry for i in group if i.entry is not None]
        if entries:
            try:
                await self._run_io(self.spool.ack, entries)
            except OSError as e:  # delivered all the same; a restart would send it once more (idempotent)
                now = time.monotonic()
                if now - self._warned.get("ack", float("-inf")) >= WARN_EVERY:  # not one line per record
                    self._warned["ack"] = now
                    log.warning("spool ack write failed %s: a restart may send those records once more", describe(e))
                if self.metrics is not None:
                    self.metrics.error("spool_ack")
        late = [i.entry for i in group if i.entry is not None and i.entry not in entries]  # re-spooled meanwhile
        if late:
            with contextlib.suppress(OSError):
                await self._run_io(self.spool.ack, late)
        for i in group:
            if self._items.pop(i.key, None) is not None:
                self._add(-1, i.url)
                self.delivered += outcome != "dead_letter"
            fut = self._acked.pop(i.key, None)
            if fut is not None and not fut.done():
                fut.set_result(outcome != "dead_letter")
        self._count(group[0].kind, outcome, len(group))

    async def _dead_letter(self, dead: list[tuple[_Item, dict, str]], status: int | None, why: str) -> bool:
        """Move records refused for good ("refused") or past their lifetime ("expired") to the spool's dead-letter
        file, one ERROR line each; False (they are retried) when that file cannot be written."""
        if self.spool is not None:
            try:
                await self._run_io(self.spool.dead_letter,
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

    def _reason(self, item: _Item, outcome: str, why: str) -> str:
        if outcome == "refused":
            return why
        return f"expired after {time.time() - item.born:.0f} s and {item.attempts + 1} attempt(s); last: {why}"

    async def _read(self, group: list[_Item]) -> tuple[list[_Item], list[dict]]:
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
                bodies.append(await self._run_io(self.spool.read, item.entry))
                keep.append(item)
            except OSError as e:
                why = f"spool read failed {describe(e)}"
                self._warn(item, 1, why, self._retry_later([item], why))
            except (ValueError, KeyError) as e:
                log.warning("spool record %s %s cannot be decoded %s: dropped (acknowledged locally)", item.kind,
                            item.idempotency_id, describe(e))
                await self._acknowledge([item], "dropped")
        return keep, bodies

    async def _post(self, group: list[_Item], bodies: list[dict]) -> tuple[bool, str, int | None]:
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


def _json_size(payload) -> int:
    """About the bytes a payload adds to a POST (memory mode; a spooled record's line length serves instead)."""
    try:
        return len(json.dumps(payload, separators=(",", ":")))
    except (TypeError, ValueError):
        return 1
