"""The bridge between the engine's worker thread and the event loop, and the NDJSON writer.

A job runs as `engine.run(job, emit, stop, claim)` on a worker thread, under the device claim that admission
took (context.admit). `emit(BatchResult)` hands each batch to the loop with `loop.call_soon_threadsafe(...)`;
the thread's completion is queued behind every emit, so draining the queue after it loses no batch. Setting
`stop` (client gone, /stop, SIGTERM) ends the job after the batch in flight. The claim is released only when the
worker thread has ended. `pump` writes a job's events as NDJSON lines; `collect` runs a job to its end.
Backpressure is the runner's, one bound for every consumer: at most `max_waiting` computed batches wait for the
consumer to take them, then emit() blocks the engine thread (the device pauses; the engine keeps what it already
dealt) until the consumer takes one, the job stops or the consumer leaves. A consumer is behind when it takes no
batch: a stream reader that drains slowly (NdjsonWriter.write waits for it), or a consumer whose sink is full (a
callback destination or the result spool at its cap), which waits in `hold()` until the sink has room or the job
ends.
The job's nonces are dealt through a `JobOrder`, so each computed batch takes its place in the job's own sequence
and `next_nonce` resumes at the first nonce not computed, whatever order the batches (replicas) arrived in.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import dataclasses
import json
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AsyncIterator, Awaitable, Callable, Iterable, Iterator

from aiohttp import web

from poc.engine.base import Claim, EngineBase
from poc.engine.jobs import BatchResult, JobSummary, V1Job
from poc.errors import InputError
from poc.logs import describe_parts, name_os_thread, os_thread_name
from poc.protocol import v1
from poc.server.config import ServerConfig, config_key

if TYPE_CHECKING:
    from poc.server.metrics import Metrics

log = logging.getLogger("poc.server")

_DONE = object()
JOB_THREAD = "poc-job"  # the OS name of the thread that runs a job's engine.run (while it runs)
STALLED_BUFFER = 1 << 20  # bytes a stalled client may have queued before further lines are dropped


# --------------------------------------------------------------------------------------------------
# what was computed, in the job's own order


def add_spans(spans: list[list[int]], nonces: Iterable[int]) -> None:
    """Merge nonces into sorted, disjoint [lo, hi] spans (few: gaps come only from dropped batches)."""
    new: list[list[int]] = []
    for n in sorted(nonces):
        if new and n <= new[-1][1] + 1:
            new[-1][1] = max(new[-1][1], n)
        else:
            new.append([n, n])
    merged: list[list[int]] = []
    for lo, hi in sorted(spans + new):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    spans[:] = merged


def remove_span(spans: list[list[int]], p: int) -> None:
    """Take position p out of sorted, disjoint [lo, hi] spans."""
    for i, (lo, hi) in enumerate(spans):
        if lo <= p <= hi:
            spans[i:i + 1] = [s for s in ([lo, p - 1], [p + 1, hi]) if s[0] <= s[1]]
            return


class JobOrder:
    """A job's nonce iterator that records the order it deals its nonces in, as arithmetic runs (one run for the
    /generate sequences: start, start+1, ... or a v2 node lattice), so that a computed nonce has a position in the
    job's own sequence. The engine thread deals, the loop looks up: hence the lock. A sequence that is not
    increasing (explicit nonce lists) is not tracked."""

    def __init__(self, nonces: Iterator[int]):
        self._it = iter(nonces)
        self._lock = threading.Lock()
        self._firsts: list[int] = []  # per run, its first nonce (increasing)
        self._starts: list[int] = []  # per run, the position of its first nonce
        self._runs: list[list[int]] = []  # per run, [first nonce, step, count]
        self.ordered = True

    def __iter__(self) -> "JobOrder":
        return self

    def __next__(self) -> int:
        n = next(self._it)
        with self._lock:
            if self.ordered:
                self._record(n)
        return n

    def _record(self, n: int) -> None:
        if self._runs:
            r = self._runs[-1]
            last = r[0] + r[1] * (r[2] - 1)
            if n <= last:
                self.ordered = False
                return
            if r[2] == 1:  # the run's second nonce sets its step
                r[1] = n - last
            if n - last == r[1]:
                r[2] += 1
                return
        self._starts.append(self._starts[-1] + self._runs[-1][2] if self._runs else 0)
        self._firsts.append(n)
        self._runs.append([n, 0, 1])

    def position(self, n: int) -> int | None:
        """n's index in the job's sequence, None when it was not dealt (or the sequence is not tracked)."""
        with self._lock:
            i = bisect.bisect_right(self._firsts, n) - 1
            if not self.ordered or i < 0:
                return None
            (first, step, count), start = self._runs[i], self._starts[i]
        if n == first:
            return start
        k, rem = divmod(n - first, step) if step else (0, 1)
        return start + k if rem == 0 and k < count else None

    def nonce(self, position: int) -> int:
        """The nonce dealt at `position`."""
        with self._lock:
            i = bisect.bisect_right(self._starts, position) - 1
            (first, step, _), start = self._runs[i], self._starts[i]
        return first + (position - start) * step


# --------------------------------------------------------------------------------------------------
# one job on a worker thread


@dataclass
class JobStats:
    protocol: str
    label: str
    computed: int = 0
    valid: int = 0  # v1: dist < r_target; v2: artifacts (finite vectors)
    dropped: int = 0  # v2: nonces whose vector was NaN/Inf (reported, not counted as valid)
    batches: int = 0
    order: JobOrder | None = None  # the job's nonces as dealt
    done_spans: list[list[int]] = field(default_factory=list)  # positions in `order` computed, as [lo, hi] spans
    started: float = field(default_factory=time.monotonic)

    @property
    def next_nonce(self) -> int | None:
        """The resume point: past the last nonce before the first one (in the job's own order) not computed, so a
        job started from it loses nothing. With one engine and results in order that is the largest nonce computed
        + 1; with replicas (out of order) or a stop that dropped a dealt batch, nonces computed beyond the gap are
        computed again by the resumed job."""
        if not self.done_spans or self.order is None:
            return None
        lo, hi = self.done_spans[0]
        return self.order.nonce(0) if lo > 0 else self.order.nonce(hi) + 1

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def rate(self) -> float:
        e = self.elapsed
        return self.computed / e if e > 0 else 0.0

    def as_json(self) -> dict:
        d = {"computed": self.computed}
        if self.protocol == "v1":
            d["valid"] = self.valid
        else:
            d["dropped"] = self.dropped
        d.update(batches=self.batches, elapsed=round(self.elapsed, 3), nonces_per_second=round(self.rate, 3))
        return d


class JobRunner:
    """Runs one engine job on a worker thread; `events()` yields ("batch", BatchResult), ("progress", stats)
    and finally ("done", JobSummary) on the loop. Leaving `events()` early stops the job."""

    def __init__(self, engine: EngineBase, job, claim: Claim, *, label: str, metrics: "Metrics",
                 registry: set["JobRunner"], progress_interval: float = 2.0, rate_log_interval: float = 5.0,
                 max_waiting: int | None = None, borrowed: bool = False):
        order = JobOrder(job.nonces)  # the engine deals from it: computed batches get their place in the job
        self.engine, self.claim, self.metrics, self.registry = engine, claim, metrics, registry
        self.borrowed = borrowed  # the claim is the caller's (a /pooled session's): never released here
        self.job = dataclasses.replace(job, nonces=order)
        self.stats = JobStats(job.protocol, label, order=order)
        self.progress_interval, self.rate_log_interval = progress_interval, rate_log_interval
        self.stop_event = threading.Event()
        self.stop_reason: str | None = None
        self.started = False
        self.future: asyncio.Future | None = None
        self.summary: JobSummary | None = None
        self.arrived_computed = self.arrived_valid = 0  # counted as batches reach the loop (logs, metrics)
        self.lost: list[BatchResult] = []  # computed, but its consumer had gone (see undelivered())
        self._q: asyncio.Queue | None = None
        self._ends = 0  # the thread's end and the consumer's: the loss is reported after both
        # backpressure (see the module docstring): the room for computed batches waiting for the consumer
        self._room = threading.Semaphore(max_waiting) if max_waiting else None
        self._consumer_left = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = asyncio.Event()  # stop() on the loop's side: wakes a consumer in hold()

    def stop(self, reason: str = "stopped") -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
        self.stop_event.set()
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nobody holds
                self._loop.call_soon_threadsafe(self._stopping.set)

    @property
    def ending(self) -> bool:
        """Stopped, or the engine thread has ended: no batch still to come waits for room."""
        return self.stop_event.is_set() or (self.future is not None and self.future.done())

    async def hold(self, ready: Awaitable) -> None:
        """The consumer's sink is full: the consumer takes no batch until `ready` completes (its sink has room) or
        the job is ending. Meanwhile the batches in flight wait here in order and, past `max_waiting`, emit() blocks
        the engine thread: the device pauses."""
        waits = [asyncio.ensure_future(ready), asyncio.ensure_future(self._stopping.wait())]
        try:
            await asyncio.wait([*waits, *([self.future] if self.future is not None else [])],
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in waits:
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: a failed wait ends the hold, the caller looks again
                t.cancel()

    def close(self) -> None:
        """Stop the job; if it never started, give the device back now."""
        self.stop("stopped")
        if not self.started:
            self._release()

    def _release(self) -> None:
        if not self.borrowed:
            self.claim.release()

    def _run(self, emit: Callable[[BatchResult], None]) -> JobSummary:
        was = os_thread_name()
        name_os_thread(JOB_THREAD)  # the executor's thread, for this job: top -H and the soak tell it from serving
        try:
            return self.engine.run(self.job, emit, self.stop_event, claim=self.claim)
        except Exception as e:  # one line to the client and the log; never a traceback (the engine classifies it)
            s = self.stats
            return JobSummary(reason="error", batches=s.batches, computed=s.computed, elapsed=s.elapsed,
                              error=str(e), error_type=type(e).__name__)
        finally:
            if was:
                name_os_thread(was)

    def _valid(self, b: BatchResult) -> int:
        if isinstance(self.job, V1Job):
            return int(v1.valid(b.dist, self.job.r_target).sum()) if b.dist is not None else 0
        return len(b.artifacts or [])

    def _arrive(self, q: asyncio.Queue, b: BatchResult) -> None:
        """On the loop, in emit order, before any consumer sees the batch: the metrics and the job's log totals
        count it here, so they are complete when the job ends even if the stream's reader left early."""
        valid = self._valid(b)
        self.arrived_computed += len(b.nonces)
        self.arrived_valid += valid
        self.metrics.batch(self.stats.protocol, len(b.nonces), valid, self.stats.rate, b.batch_seconds)
        q.put_nowait(b)

    def _count(self, b: BatchResult) -> None:
        """The totals the stream's lines carry, counted as the lines are written."""
        s = self.stats
        s.batches += 1
        s.computed += len(b.nonces)
        if b.nonces and s.order is not None:
            lo, hi = s.order.position(b.nonces[0]), s.order.position(b.nonces[-1])
            if lo is not None and hi is not None and hi - lo == len(b.nonces) - 1:  # a batch is a run of the order
                add_spans(s.done_spans, range(lo, hi + 1))
            else:
                add_spans(s.done_spans, [p for p in map(s.order.position, b.nonces) if p is not None])
        if not isinstance(self.job, V1Job):
            s.dropped += len(b.dropped)
        s.valid += self._valid(b)

    def undelivered(self, b: BatchResult) -> None:
        """The consumer could not pass this batch on (its client had gone or stalled): taken out of the stream's
        totals again (the done line and next_nonce count what was written), and logged at the end."""
        self.lost.append(b)
        s = self.stats
        s.batches -= 1
        s.computed -= len(b.nonces)
        s.valid -= self._valid(b)
        if not isinstance(self.job, V1Job):
            s.dropped -= len(b.dropped)
        if s.order is not None:
            for p in map(s.order.position, b.nonces):
                if p is not None:
                    remove_span(s.done_spans, p)

    def _ended(self) -> None:
        """Called when the thread ended and when the consumer left; the second call logs what never reached the
        consumer's client: batches marked undelivered() and batches the consumer left behind in the queue."""
        self._ends += 1
        if self._ends < 2:
            return
        while self._q is not None and not self._q.empty():
            item = self._q.get_nowait()
            if isinstance(item, BatchResult) and item.nonces:
                self.lost.append(item)
        if not self.lost:
            return
        nonces = [n for b in self.lost for n in b.nonces]
        self.metrics.error("undelivered")
        log.warning("%d computed batch(es), %d nonces (%d..%d), never reached the client: it had gone (%s; the "
                    "stream's done line, if it got one, counts only what it was sent)", len(self.lost), len(nonces),
                    min(nonces), max(nonces), self.stats.label)
        self.lost = []

    def _rate_line(self) -> None:
        s = self.stats
        log.info("rate: %.1f nonces/s, computed %d, valid %d (%s)", s.rate, s.computed, s.valid, s.label)

    async def events(self) -> AsyncIterator[tuple[str, object]]:
        loop = self._loop = asyncio.get_running_loop()
        if self.stop_event.is_set():
            self._stopping.set()
        q: asyncio.Queue = asyncio.Queue()
        self._q = q

        def emit(b: BatchResult) -> None:  # on the worker thread
            if self._room is not None:
                while not self._room.acquire(timeout=0.05):
                    if self.stop_event.is_set() or self._consumer_left:
                        break
            loop.call_soon_threadsafe(self._arrive, q, b)

        def thread_done(f: asyncio.Future) -> None:
            # runs on the loop after every emit the thread scheduled before returning, whether or not anyone
            # still listens (a cancelled handler): the job is accounted for and the device released here
            summary: JobSummary = f.result()  # _run never raises
            if summary.reason == "stopped" and self.stop_reason:
                summary.reason = self.stop_reason
            self.summary = summary
            self.registry.discard(self)
            self._finish(summary)
            self._release()
            q.put_nowait(_DONE)
            self._ended()

        self.started = True
        self.registry.add(self)
        self.future = loop.run_in_executor(None, self._run, emit)
        self.future.add_done_callback(thread_done)
        s = self.stats
        log.info("job started: %s", s.label)
        next_progress = time.monotonic() + self.progress_interval
        next_rate = time.monotonic() + self.rate_log_interval
        try:
            while True:
                now = time.monotonic()
                try:
                    item = await asyncio.wait_for(q.get(), max(0.0, min(next_progress, next_rate) - now))
                except asyncio.TimeoutError:
                    item = None
                if item is _DONE:
                    yield "done", self.summary
                    return
                if isinstance(item, BatchResult):
                    if self._room is not None:
                        self._room.release()
                    self._count(item)
                    yield "batch", item
                now = time.monotonic()
                if now >= next_rate:
                    self._rate_line()
                    next_rate = now + self.rate_log_interval
                if now >= next_progress:
                    next_progress = now + self.progress_interval
                    yield "progress", s.as_json()
        finally:
            self._consumer_left = True  # emit() stops waiting for room
            self.stop_event.set()  # a consumer that left early (client gone, task cancelled) stops the job
            self._ended()

    def _finish(self, summary: JobSummary) -> None:
        s = self.stats
        self.metrics.job_done(s.protocol, summary.reason)
        if summary.reason == "error":
            self.metrics.error("job")
            log.warning("job failed %s: %s after %d nonces", s.label,
                        describe_parts(summary.error_type, summary.error), self.arrived_computed)
        else:
            rate = self.arrived_computed / summary.elapsed if summary.elapsed > 0 else 0.0
            log.info("job done: %s, reason %s, computed %d, valid %d in %.1f s (%.1f nonces/s)", s.label,
                     summary.reason, self.arrived_computed, self.arrived_valid, summary.elapsed, rate)


async def pump(w: "NdjsonWriter", runner: JobRunner, make_line) -> None:
    """A job's events as NDJSON lines: make_line(batch, runner) per batch (None: nothing to say), progress lines, an
    error line if it failed, the done line. A client that went away stops the job (watched also while nothing is
    written, e.g. during a v1 model build); a reader that takes nothing ends it as `stalled`. A cancelled handler
    (the server cancels it when its client goes; a shutdown has named its own reason first) ends the job as
    `disconnect`, a failure here as `error`, re-raised for the caller's error line. The reason is given before this
    yields to the loop again (the wait for the watch below): an engine thread that ends meanwhile is counted under
    the reason the job has then."""
    watch = asyncio.create_task(_watch_client(w, runner))
    try:
        await _pump_events(w, runner, make_line)
    except asyncio.CancelledError:
        runner.stop("disconnect")
        raise
    except Exception:
        runner.stop("error")
        raise
    finally:
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)


async def _watch_client(w: "NdjsonWriter", runner: JobRunner) -> None:
    """A client that goes away stops the job within ~0.2 s, even while nothing is written (a v1 model build)."""
    while not w.client_gone():
        await asyncio.sleep(0.2)
    runner.stop("disconnect")


async def _pump_events(w: "NdjsonWriter", runner: JobRunner, make_line) -> None:
    async with contextlib.aclosing(runner.events()) as events:
        async for kind, item in events:
            if kind == "batch":
                line = make_line(item, runner)
                if w.gone or w.stalled or (line is not None and not await w.write(line)):
                    runner.undelivered(item)  # computed after the client went: logged at the job's end
            elif kind == "progress":
                if not w.stalled:
                    await w.write({"status": "progress", **item})
            else:
                summary: JobSummary = item
                if summary.reason == "error":
                    await w.write({"error": summary.error, "error_type": summary.error_type})
                await w.write(done_line(summary, runner.stats))
            if w.client_gone():  # checked after every batch, even when it wrote nothing
                runner.stop("disconnect")
            elif w.stalled:  # the reader takes nothing: the device stops computing for nobody
                runner.stop("stalled")


async def collect(runner: JobRunner) -> tuple[list[BatchResult], JobSummary]:
    """Run a job to its end; InputError(503/500) unless every nonce was computed."""
    results: list[BatchResult] = []
    summary = None
    try:
        async with contextlib.aclosing(runner.events()) as events:
            async for kind, item in events:
                if kind == "batch":
                    results.append(item)
                elif kind == "done":
                    summary = item
    finally:
        runner.close()
    if summary.reason == "error":
        raise InputError(f"computation failed ({summary.error_type}): {summary.error}", None, status=500)
    if summary.reason != "exhausted":
        raise InputError(f"computation {summary.reason} before it finished", None, status=503)
    return results, summary


def done_line(summary: JobSummary, stats: JobStats) -> dict:
    """The final line; `next_nonce` as start_nonce resumes the job (JobStats.next_nonce: nothing is skipped, nonces
    computed past a gap may be computed again)."""
    d = {"status": "done", "reason": summary.reason}
    d.update(stats.as_json())
    if stats.next_nonce is not None:
        d["next_nonce"] = stats.next_nonce
    return d


# --------------------------------------------------------------------------------------------------
# NDJSON


def dumps(obj) -> bytes:
    """One NDJSON line; floats keep Python repr (round-trip exact), non-finite ones become null."""
    try:
        return json.dumps(obj, allow_nan=False).encode() + b"\n"
    except ValueError:
        return json.dumps(_finite(obj)).encode() + b"\n"


def json_text(obj) -> str:
    """Strict JSON text (web.json_response's and the callback client's `dumps`): non-finite floats become null."""
    return dumps(obj)[:-1].decode()


def _finite(o):
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_finite(v) for v in o]
    return o


class NdjsonWriter:
    """A chunked application/x-ndjson response written line by line; notices a client that went away."""

    def __init__(self, request: web.Request, stall_timeout: float | None = None):
        self.request = request
        # a client that takes no bytes for this long is stalled: the line in hand stays buffered for it, the job is
        # stopped (reason "stalled") and only the final line is still queued behind it
        cfg = request.config_dict.get(config_key)
        self.stall_timeout = stall_timeout if stall_timeout is not None else \
            (cfg.stall_timeout if cfg is not None else ServerConfig.stall_timeout)
        self.stalled = False
        self.resp = web.StreamResponse(headers={"Content-Type": "application/x-ndjson", "Cache-Control": "no-cache",
                                                "X-Accel-Buffering": "no"})
        self.gone = False

    async def open(self) -> None:
        await self.resp.prepare(self.request)

    def client_gone(self) -> bool:
        t = self.request.transport
        if t is None or t.is_closing():
            self.gone = True
        return self.gone

    async def write(self, obj) -> bool:
        """False when the client is gone (nothing more will reach it)."""
        if self.client_gone():
            return False
        t = self.request.transport
        if self.stalled and t is not None and t.get_write_buffer_size() > STALLED_BUFFER:
            return False  # a stalled client is owed no more memory
        try:
            # the bytes reach the transport before the wait for the client to drain them: a timeout leaves them queued
            await asyncio.wait_for(self.resp.write(dumps(obj)), 1.0 if self.stalled else self.stall_timeout)
            return True
        except asyncio.TimeoutError:
            if not self.stalled:
                log.warning("stream client %s took nothing for %g s: stalled", self.request.remote, self.stall_timeout)
            self.stalled = True
            return True
        except (ConnectionError, RuntimeError):  # reset by peer, or "Cannot write to closing transport"
            self.gone = True
            return False

    async def close(self) -> None:
        if not self.client_gone():
            try:
                await self.resp.write_eof()
            except (ConnectionError, RuntimeError):
                self.gone = True
