"""The callback sender's outbox (callbacks.py): the records it must deliver, from the moment one is taken until it is
acknowledged or dead-lettered. Delivery (who POSTs what, when, and what a failure means) is the sender's; this is
the records' bookkeeping.

A record is its (url, idempotency id) pair: the same id to two destinations is two records. `reserve` counts one
as pending (or refuses it: `max_pending` per destination url, `max_pending_total` in all, so a dead consumer cannot
starve another; `room(url)` and `wait_room` let a producer that must not lose anything wait instead), `store`
writes it to the spool (appended and fsynced, spool.py) and queues it in `ready` for the sender's workers, who wait
on `wake`. A record taken with `merge=KEY` is stored but held until `release(KEY)`; `stored()` returns once every
record taken so far is stored, so a release after it covers them all. `remove` takes records off the spool once
acknowledged (or dead-lettered) and wakes who waits on them (`flush`, `flush_url`, `wait_acked`, `wait_room`).
`open` replays what an earlier process left in the spool: every record, held ones too (their owner is gone), is
ready at once. Memory holds, per pending record, its id, kind, url and disk position (spool) or its payload
(memory mode: no spool directory, as in unit tests). What is pending at exit stays in the spool for the next start.

When the spool's disk fails (ENOSPC, EIO, a deleted or read-only directory) a record is kept in memory instead
(still bounded by `max_pending`, so a producer is refused and stops once that fills) and sent from there: one
WARNING when the spool starts failing and one line when it works again (not one per record), the state in
`spool_error` (GET /health's "spool") and in poc_spool_ok / poc_errors_total{kind="spool_write"}. Every append
tries the disk again; the first that succeeds writes the memory-only records back to the spool, so they are
durable again. Records still memory-only at exit (`memory_only`) are lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from poc.clients.spool import Entry, Spool
from poc.logs import describe

log = logging.getLogger("poc.callbacks")  # the sender's log: one logger for a record's whole way out

WARN_EVERY = 5.0  # seconds between failed spool-ack lines


@dataclass
class Record:
    """One record: where it goes, where it is kept (a spool entry, or its payload), how its delivery went."""

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


class Outbox:
    def __init__(self, *, kinds, max_pending: int, max_pending_total: int | None, metrics, spool_dir: str | None,
                 segment_records: int):
        self.kinds = kinds  # what may be taken
        self.max_pending = max_pending  # per destination url: one dead consumer cannot starve another
        self.max_pending_total = max_pending_total or 10 * max_pending  # all destinations together (memory bound)
        self.metrics = metrics
        self.spool = Spool(spool_dir, segment_records) if spool_dir else None
        self.taking = False  # records are taken between the sender's start and its close
        self.pending = 0  # reserved + stored, not yet acknowledged
        self._per_url: dict[str, int] = {}  # the same, by destination
        self._room: asyncio.Event | None = None  # set whenever a record leaves (acknowledged or dead-lettered)
        self._idle: asyncio.Event | None = None
        self.wake: asyncio.Event | None = None  # set whenever records are ready: the sender's workers wait on it
        self.replayed = 0
        self.items: dict[tuple[str, str], Record] = {}  # stored (durable) and not yet acknowledged
        self._reserved: set[tuple[str, str]] = set()  # being written to the spool
        self.ready: deque[Record] = deque()  # stored and released: the sender takes them from the left
        self._held: dict[str, list[Record]] = {}  # merge key -> stored records waiting for release()
        self._released: OrderedDict[str, None] = OrderedDict()  # keys released for good (bounded: the last 1000)
        self._acked: dict[tuple[str, str], asyncio.Future] = {}  # wait_acked() waiters
        self.stores: set[asyncio.Task] = set()  # spool writes under way
        self._io: ThreadPoolExecutor | None = None
        self.spool_error: str | None = None  # why the spool last failed, None while it works
        self._respooling = False
        self._ack_warned = float("-inf")

    # ------------------------------------------------------------------------------------- life cycle

    async def open(self) -> None:
        """Open the spool and make ready what an earlier process left unacknowledged."""
        self.wake, self._idle, self._room = asyncio.Event(), asyncio.Event(), asyncio.Event()
        self._idle.set()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="poc-spool")  # one thread: appends stay in order
        if self.spool is None:
            return
        try:
            found = await self.run_io(self.spool.open)
        except OSError as e:  # the directory cannot even be listed: serve, from memory, and say so
            found = []
            self._spool_failed(e)
        for e in found:
            item = Record(e.kind, e.url, e.id, entry=e, merge=e.merge, size=e.length)  # held ones too: their
            if e.created:  # owner is gone
                item.born = e.created
            self.items[item.key] = item
            self.ready.append(item)
            self._add(1, e.url)
        self.replayed = len(self.items)
        if self.replayed:
            log.info("replaying %d spooled record(s) from %s", self.replayed, self.spool.dir)
            self.wake.set()

    async def close(self) -> None:
        if self._io is not None:
            if self.spool is not None:
                await self.run_io(self.spool.close)
            self._io.shutdown(wait=True)
            self._io = None

    async def run_io(self, fn, *args):
        """`fn(*args)` on the spool's one I/O thread, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    # -------------------------------------------------------------------------------------- intake

    def reserve(self, kind: str, url: str, idempotency_id: str, force: bool = False) -> str | None:
        """"new" (counted as pending: store it), "dup" (already on its way) or None (refused)."""
        if kind not in self.kinds:
            raise ValueError(f"callback kind must be one of {sorted(self.kinds)}, got {kind!r}")
        if not self.taking:
            log.warning("callback %s to %s refused: the sender is not running", kind, url)
            return None
        key = (url, idempotency_id)
        if key in self.items or key in self._reserved:
            return "dup"  # already on its way: the same record once is enough
        if not force and not self.room(url):
            self.count(kind, "dropped")
            log.warning("callback queue full (%d pending for %s, %d in all): %s payload %s not queued",
                        self._per_url.get(url, 0), url, self.pending, kind, idempotency_id)
            return None
        self._reserved.add(key)
        self._add(1, url)
        return "new"

    def store_soon(self, kind: str, url: str, payload: dict, idempotency_id: str, merge: str | None = None) -> None:
        """`store` in a task of its own: `stored()` waits for it."""
        t = asyncio.get_running_loop().create_task(self.store(kind, url, payload, idempotency_id, merge))
        self.stores.add(t)
        t.add_done_callback(self.stores.discard)

    async def store(self, kind: str, url: str, payload: dict, idempotency_id: str, merge: str | None = None) -> None:
        """Write a reserved record to the spool (or keep it in memory) and queue it: ready, or held under `merge`."""
        item = Record(kind, url, idempotency_id, merge=merge)
        try:
            if self.spool is not None:
                try:
                    item.entry = await self.run_io(self.spool.append, idempotency_id, kind, url, payload, merge)
                except OSError as e:  # disk full, EIO, directory gone: send from memory (bounded by max_pending)
                    item.payload = payload
                    self.count(kind, "spool_error")
                    self._spool_failed(e)
                except (TypeError, ValueError) as e:  # unserialisable: this record only
                    item.payload = payload
                    self.count(kind, "spool_error")
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
        self.items[item.key] = item
        if merge is not None and merge not in self._released:
            self._held.setdefault(merge, []).append(item)
            return
        self.ready.append(item)
        self.wake.set()

    async def stored(self) -> None:
        """Return once every record submitted so far is stored (spooled, or kept in memory): a release after it
        covers them all. A finished store counts as stored before its done-callback takes it out of `stores`: on
        Python 3.12 gather() of finished tasks is finished at once, so a loop that waited for `stores` to empty
        would never give the event loop the turn that runs those callbacks (the server froze so after a stop)."""
        while pending := [t for t in self.stores if not t.done()]:
            await asyncio.wait(pending)

    def release(self, merge: str, final: bool = False) -> None:
        """Send what is held under `merge`; with `final`, records still being written go out as soon as stored."""
        if final:
            self._released[merge] = None
            while len(self._released) > 1000:
                self._released.popitem(last=False)
        held = self._held.pop(merge, None)
        if held:
            self.ready.extend(held)
            self.wake.set()

    async def remove(self, group: list[Record], delivered: bool) -> int:
        """Take acknowledged (or, not `delivered`, dead-lettered) records off the spool and out of the count, and
        answer who waits on them; the number that were still pending."""
        entries = [i.entry for i in group if i.entry is not None]
        if entries:
            try:
                await self.run_io(self.spool.ack, entries)
            except OSError as e:  # delivered all the same; a restart would send it once more (idempotent)
                now = time.monotonic()
                if now - self._ack_warned >= WARN_EVERY:  # not one line per record
                    self._ack_warned = now
                    log.warning("spool ack write failed %s: a restart may send those records once more", describe(e))
                if self.metrics is not None:
                    self.metrics.error("spool_ack")
        late = [i.entry for i in group if i.entry is not None and i.entry not in entries]  # re-spooled meanwhile
        if late:
            with contextlib.suppress(OSError):
                await self.run_io(self.spool.ack, late)
        gone = 0
        for i in group:
            if self.items.pop(i.key, None) is not None:
                self._add(-1, i.url)
                gone += 1
            fut = self._acked.pop(i.key, None)
            if fut is not None and not fut.done():
                fut.set_result(delivered)
        return gone

    # ---------------------------------------------------------------------------------- spool faults

    @property
    def memory_only(self) -> int:
        """Pending records that are not on disk (the spool failed when they were taken)."""
        return sum(1 for i in self.items.values() if i.entry is None) if self.spool is not None else 0

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
            self.stores.add(t)
            t.add_done_callback(self.stores.discard)

    async def _respool(self) -> None:
        try:
            for item in [i for i in self.items.values() if i.entry is None and i.payload is not None]:
                try:
                    entry = await self.run_io(self.spool.append, item.idempotency_id, item.kind, item.url,
                                              item.payload, item.merge)
                except OSError as e:
                    self._spool_failed(e)
                    return
                except (TypeError, ValueError):
                    continue
                if self.items.get(item.key) is item:
                    item.entry = entry  # the payload stays too: a send in progress may have read it already
                else:  # delivered meanwhile
                    with contextlib.suppress(OSError):
                        await self.run_io(self.spool.ack, [entry])
        finally:
            self._respooling = False

    # -------------------------------------------------------------------------------------- counts

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

    def pending_for(self, url: str) -> int:
        """Records for this url not yet acknowledged (being written included)."""
        return self._per_url.get(url, 0)

    async def flush(self, timeout: float) -> int:
        """Wait until everything taken so far is delivered, or `timeout`; the number still pending."""
        if self._idle is not None and self.pending:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except asyncio.TimeoutError:
                pass
        return self.pending

    async def flush_url(self, url: str, timeout: float) -> int:
        """Wait until nothing for `url` is pending, or `timeout`; the number still pending for it."""
        deadline = time.monotonic() + timeout
        while (n := self.pending_for(url)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return n

    async def wait_acked(self, url: str, idempotency_id: str, timeout: float) -> bool:
        """True once that record was acknowledged (or is not pending at all), False after `timeout`."""
        key = (url, idempotency_id)
        if key not in self.items and key not in self._reserved:
            return True
        fut = self._acked.get(key)
        if fut is None:
            fut = self._acked[key] = asyncio.get_running_loop().create_future()
        try:
            return await asyncio.wait_for(asyncio.shield(fut), timeout)
        except asyncio.TimeoutError:
            return False

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

    def count(self, kind: str, outcome: str, n: int = 1) -> None:
        """poc_callbacks_total{kind, outcome}, and poc_errors_total for a record dropped or dead-lettered."""
        if self.metrics is not None:
            self.metrics.callbacks.labels(kind, outcome).inc(n)
            if outcome in ("dropped", "dead_letter"):
                self.metrics.error(f"callback_{outcome}")


def _json_size(payload) -> int:
    """About the bytes a payload adds to a POST (memory mode; a spooled record's line length serves instead)."""
    try:
        return len(json.dumps(payload, separators=(",", ":")))
    except (TypeError, ValueError):
        return 1
