"""POST /pooled: orchestrator mode (spec-v1 §4.3). The orchestrator hands this worker nonce ranges; every computed
batch is a result delivered to it exactly once, and the NDJSON stream reports each step as it happens.

    POST /pooled {"orchestrator_url": "http://...", ["batch_size": 100], ["max_duration": 600], ["dtype": "float16"]}

Session: connect (with retry) -> poll GET config every pooled_poll_interval until a block_hash arrives (up to
pooled_wait_timeout) -> claim the device -> build the model -> ready (with retry) -> compute the assigned range,
batch by batch, until "shutdown", max_duration (counted from "computing", as the reference's compute loop), a stop
(/api/v1/stop and the others: context.end_sessions) or the server stops -> give the device back -> flush ->
/shutdown {"stats"}. The device is held only while there is work: not while waiting for the block hash or for a
range (a session waiting for its orchestrator must not keep /health busy and every other job out). Fixed against
the reference (spec-v1 §6):
- F1b: every nonce of the range is computed, exactly once (the engine's iterator is the range; a job stopped for
  a command resumes with the nonces not yet computed: with replicas, results arrive out of order and a stop
  drops batches dealt but not launched, so "after the last result" would skip some and repeat others);
- F3/F14: lines are written as they happen; results go through the durable CallbackSender (spooled on disk and
  fsynced before the send, re-sent with backoff until the orchestrator answers {"status": "ok"}, replayed after a
  restart; one `idempotency_id` per batch, also the Idempotency-Key header), so the orchestrator's speed never
  holds up the engine thread, the command polls or the stream; a backlog goes out through /results/batch; when
  the sender holds as many pending results for the orchestrator as it takes (callback_max_pending), the session
  says "paused" and takes no further batch until one is delivered or dead-lettered ("resumed"): the job runner's
  bound pauses the engine meanwhile (JobRunner.hold), and the commands, heartbeats and max_duration still apply;
- F5: nothing is dropped: the batch in flight when a job stops is sent, the final flush waits (bounded) for the
  acknowledgements, and what is still unacknowledged stays in the spool;
- F7: commands and config changes apply within one poll interval: "switch_job" (restart the range under the new
  key), "compute" with a new public_key (continue the range under it; a key in a plain config is only taken before
  the first job, as the reference), a new block_hash/params/r_target/range (a new job), "shutdown"; an exhausted
  range is reported ({"status": "range_complete"}, and in the next heartbeat) and the session waits for a new one; a
  missing r_target takes the chain default instead of 0 (which kept every result empty);
- F15: every ending calls /shutdown, including "shutdown" while waiting and a failed registration.
Result bodies keep the reference's keys and order (v1: nonces/dist under r_target; v2: artifacts) and add
first_nonce/last_nonce (the batch's computed span) and idempotency_id. One GPU group: worker_id = node_id = 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Iterator

from aiohttp import web

from poc.clients.orchestrator import OrchestratorClient
from poc.engine.base import Claim
from poc.engine.jobs import BatchResult, Limits, V1Job, V2Job
from poc.errors import InputError
from poc.logs import describe
from poc.protocol import v1, v2
from poc.server import schemas
from poc.server.context import (admit, check_v1_memory, check_v2_memory, config_key, engine_key, new_runner,
                                require_ready, sender_key, served_model, track_streams)
from poc.server.results import v1_hits
from poc.server.security import url_policy
from poc.server.stream import JobRunner, NdjsonWriter, add_spans

log = logging.getLogger("poc.pooled")

MERGE_KEYS = ("block_hash", "block_height", "r_target", "params", "public_key", "nonce_range_start",
              "nonce_range_end", "batch_size", "poc_stronger_rng")
DEFAULTS = {"block_hash": "", "block_height": 0, "r_target": 0.0, "params": {}, "public_key": "",
            "nonce_range_start": 0, "nonce_range_end": 0}
INT_KEYS = ("block_height", "nonce_range_start", "nonce_range_end", "batch_size")  # 7.0 is taken as 7
KEY_COMMANDS = ("switch_job", "compute")  # the config commands that move the public key once computing
GPU_COUNT = 1  # one engine: the server's device (replicas are the parallel engine's business)


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    track_streams(app, sessions_key, lambda s, why: s.request_end("server_shutdown" if why == "shutdown" else why))
    app.add_routes(routes)


@routes.post("/pooled")
async def pooled(request: web.Request) -> web.StreamResponse:
    app = request.app
    cfg = app[config_key]
    body, url = await schemas.read_url_body(request, cfg.max_body_bytes, "orchestrator_url",
                                            {"batch_size", "max_duration", "dtype"}, url_policy(app))
    batch_size = schemas.get_batch_size(body, cfg, default=None)
    max_duration = schemas.get_number(body, "max_duration", default=cfg.pooled_max_duration, lo=0, lo_open=True,
                                      hi=cfg.max_duration_limit)
    dtype = schemas.get_dtype(body)
    require_ready(app)  # 503 or 409 here, before the 200; the device itself is claimed when work arrives
    if app[engine_key].busy:
        raise InputError("busy: a job is already running", None, status=409)
    session = PooledSession(app, url, batch_size, max_duration, dtype)
    w = NdjsonWriter(request)
    app[sessions_key].add(session)
    try:
        await w.open()
        await session.run(w)
    finally:
        app[sessions_key].discard(session)
        session.give_device()
    await w.close()
    return w.resp


@dataclass(frozen=True)
class Assignment:
    """What the orchestrator asks for now, checked."""

    protocol: str
    block_hash: str
    block_height: int
    public_key: str
    r_target: float
    params: object  # V1Params, or (seq_len, k_dim)
    params_key: str  # canonical JSON, for comparisons and ids
    range_start: int
    range_end: int
    batch_size: int
    stronger_rng: bool

    @property
    def work(self) -> tuple:
        """The computation without the key: a key change alone continues the same work."""
        return (self.protocol, self.block_hash, self.block_height, self.params_key, self.r_target, self.range_start,
                self.range_end, self.stronger_rng)


class PooledSession:
    def __init__(self, app: web.Application, url: str, batch_size: int | None, max_duration: float, dtype: str):
        self.app, self.url, self.req_batch_size, self.max_duration, self.dtype = app, url, batch_size, max_duration, dtype
        # the device, held while there is work (a block hash, then a range to compute): its jobs borrow it; a
        # session waiting for its orchestrator holds nothing, so /health stays ready and other jobs may run
        self.claim: Claim | None = None
        self.cfg = app[config_key]
        self.sender = app[sender_key]
        self.worker_id = str(uuid.uuid4())
        self.conf = dict(DEFAULTS)
        self.range_given = False
        self.assignment: Assignment | None = None
        self.bad_config: InputError | None = None
        self.announce: list[dict] = []  # status lines of applied changes, written before the next job starts
        self.computed: dict[tuple, list[list[int]]] = {}  # work -> the nonces computed, as sorted [lo, hi] spans
        self.epoch = 0  # bumped by switch_job: a batch of the job it stopped must not count as computed any more
        self.finished: set[tuple] = set()  # works whose range is exhausted
        self.counters_for: tuple | None = None
        self.batch_number = self.total_computed = self.total_valid = 0
        self.batches_sent = 0
        self.runner: JobRunner | None = None
        self._last_runner: JobRunner | None = None
        self._bg: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []  # the heartbeat and the config polls
        self._conf_seen = ""
        self.end_reason: str | None = None
        self.changed = asyncio.Event()
        self.got_block_hash = asyncio.Event()
        self.ended = asyncio.Event()  # request_end was called: retried calls stop waiting
        self.r_target_warned = False
        self.started = time.monotonic()
        self.deadline: float | None = None  # max_duration counts from "computing", as the reference's compute loop
        self._lock = asyncio.Lock()
        self.client: OrchestratorClient | None = None
        self.w: NdjsonWriter | None = None
        self._client_gone_logged = False

    # ------------------------------------------------------------------------------------ plumbing

    async def emit(self, obj: dict) -> None:
        async with self._lock:
            if not await self.w.write(obj) and not self._client_gone_logged:
                self._client_gone_logged = True
                log.info("pooled %s: the client went away; the session goes on (results go to the orchestrator)",
                         self.worker_id[:8])

    def request_end(self, reason: str) -> None:
        if self.end_reason is None:
            self.end_reason = reason
        if self.runner is not None:
            self.runner.stop("shutdown" if reason == "server_shutdown" else "stopped")
        self.changed.set()
        self.got_block_hash.set()
        self.ended.set()

    def take_device(self) -> None:
        """Claim the device for the work that arrived (503 or 409 as an InputError, ending the session)."""
        if self.claim is None:
            self.claim = admit(self.app, "/pooled")

    def give_device(self) -> None:
        """Give the device back once the last job's thread has ended (idempotent)."""
        claim, self.claim = self.claim, None
        if claim is None:
            return
        f = self._last_runner.future if self._last_runner is not None else None
        if f is None or f.done():
            claim.release()
        else:
            if self.runner is not None:
                self.runner.stop("stopped")
            f.add_done_callback(lambda _f: claim.release())

    async def _unless_ended(self, call):
        """The reply of a retried orchestrator call, or None when the session ends first (SIGTERM, a shutdown
        command): connect and ready retry for up to a minute against an unreachable orchestrator."""
        task = asyncio.ensure_future(call)
        end = asyncio.ensure_future(self.ended.wait())
        try:
            await asyncio.wait({task, end}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            end.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        return None if task.cancelled() else task.result()

    async def _end_early(self) -> None:
        """The session ended before computing anything: say so, and still tell the orchestrator (F15)."""
        await self.emit({"status": "shutdown"})
        await self._shutdown(self._stats(), retry=self.end_reason != "server_shutdown")

    async def _stop_background(self) -> None:
        """End the heartbeat, the config polls and any range_complete heartbeat in flight."""
        me = asyncio.current_task()
        tasks = [t for t in (*self._tasks, *self._bg) if t is not me]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _shutdown(self, stats: dict, retry: bool = True) -> None:
        """POST /shutdown once nothing else goes to the orchestrator: the reference stops its heartbeat there, and an
        orchestrator that forgets the worker on /shutdown must not see it beat (or poll) again. The device goes back
        first: /shutdown may be retried for a while against an orchestrator that is down."""
        self.give_device()
        await self._stop_background()
        await self.client.shutdown(stats, retry=retry)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    # ------------------------------------------------------------------------------------- session

    async def run(self, w: NdjsonWriter) -> None:
        self.w = w
        c = self.cfg
        tasks = self._tasks
        async with OrchestratorClient(self.url, self.worker_id, timeout=c.orchestrator_timeout,
                                      retries=c.orchestrator_retries, retry_base=c.orchestrator_retry_base,
                                      policy=url_policy(self.app)) as client:
            self.client = client
            try:
                await self.emit({"status": "registering", "worker_id": self.worker_id, "gpu_count": GPU_COUNT})
                r = await self._unless_ended(client.connect(GPU_COUNT, [{"device": str(self.app[engine_key].device)}]))
                if r is None:
                    await self._end_early()
                    return
                if not r.ok:
                    await self.emit({"error": "Failed to register with orchestrator", "error_type": "ConnectionError",
                                     "detail": r.error})
                    await self._shutdown({"error": f"registration failed: {r.error}"}, retry=False)  # F15
                    return
                self._merge(r.data)
                tasks.append(asyncio.create_task(self._heartbeats(), name=f"pooled-heartbeat-{self.worker_id[:8]}"))
                tasks.append(asyncio.create_task(self._polls(), name=f"pooled-poll-{self.worker_id[:8]}"))
                await self.emit({"status": "registered", "worker_id": self.worker_id})
                await self._main()
            except InputError as e:  # a config the worker cannot compute (or the device busy): say why, end the session
                await self._fail(e.message, "InputError", field=e.field, http_status=e.status)
            except Exception as e:
                log.warning("pooled %s failed %s", self.worker_id[:8], describe(e))
                await self._fail(str(e), type(e).__name__)
            finally:
                await self._stop_background()
                if self.runner is not None:
                    self.runner.stop("stopped")

    async def _main(self) -> None:
        c = self.cfg
        await self.emit({"status": "waiting_block_hash"})
        if not self.conf["block_hash"]:
            try:
                await asyncio.wait_for(self.got_block_hash.wait(), c.pooled_wait_timeout)
            except asyncio.TimeoutError:
                await self.emit({"status": "timeout", "message": "No block_hash received"})
                await self._shutdown({"reason": "timeout_waiting_block_hash"})
                return
        if self.end_reason is not None:  # "shutdown" while waiting: still tell the orchestrator (F15)
            await self._end_early()
            return
        self.take_device()  # work arrived: the device from here (a 409 line if another job took it meanwhile)
        await self.emit({"status": "received_block_hash", "block_hash": self.conf["block_hash"][:16]})
        await self.emit({"status": "loading_model"})
        t0 = time.monotonic()
        await self._build_model()
        await self.emit({"status": "model_loaded", "load_time": round(time.monotonic() - t0, 3)})
        r = await self._unless_ended(self.client.ready(GPU_COUNT))
        if r is None:
            await self._end_early()
            return
        if not r.ok:
            await self._fail("Failed to notify ready", "ConnectionError", detail=r.error)
            return
        self._merge(r.data)
        self._reassign(None)
        if self.bad_config is not None:
            raise self.bad_config
        pk = self.conf["public_key"]
        await self.emit({"status": "ready", "public_key": pk[:16] if pk else None})
        self.deadline = time.monotonic() + self.max_duration  # the wait for a block hash had its own limit
        await self.emit({"status": "computing"})
        await self._compute()
        self.give_device()  # the flush and /shutdown below need no device
        await self._finish()

    async def _build_model(self) -> None:
        """The v1 model for the block hash and params (v2's checkpoint was loaded at start)."""
        params = self.conf["params"]
        proto = schemas.protocol_of(params)
        if proto == "v1":
            p = schemas.parse_v1_params(params)
            bs = self._batch_size()
            check_v1_memory(self.app, p, bs, self.dtype)
            await asyncio.to_thread(self.app[engine_key].build_v1, p, self.conf["block_hash"], self.dtype)
        else:
            schemas.parse_v2_params(params, served_model(self.app))

    async def _fail(self, message: str, error_type: str, **extra) -> None:
        line = {"error": message, "error_type": error_type, **extra}
        engine = self.app[engine_key]
        if engine.state == "broken":
            line["fatal"] = True  # the line goes out; the process stays up and /health says broken (F4)
        await self.emit(line)
        if self.client is not None:
            await self._shutdown({"error": message}, retry=self.end_reason != "server_shutdown")

    # ------------------------------------------------------------------------------------- compute

    async def _compute(self) -> None:
        deadline = self.deadline
        while self.end_reason is None:
            for line in self.announce:
                await self.emit(line)
            self.announce.clear()
            if self.bad_config is not None:
                raise self.bad_config
            a = self.assignment
            if a is None or a.work in self.finished:
                self.changed.clear()
                self.give_device()  # nothing to compute until the orchestrator says more
                if a is None:
                    await self.emit({"status": "waiting_range" if self.conf["public_key"] else "waiting_public_key"})
                try:
                    await asyncio.wait_for(self.changed.wait(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    self.request_end("max_duration")
                continue
            self.take_device()
            summary = await self._run_job(a)
            if summary.reason == "error":
                await self._fail(summary.error, summary.error_type)
                self.end_reason = "error"
                return
            if summary.reason == "shutdown":
                self.request_end("server_shutdown")
            elif summary.reason == "exhausted" and self.assignment == a:
                self.finished.add(a.work)
                await self.emit({"status": "range_complete", "range_start": a.range_start, "range_end": a.range_end,
                                 "total_batches": self.batch_number, "total_computed": self.total_computed})
                t = asyncio.create_task(self.client.heartbeat(self.sender.pending_for(self.client.worker_url),
                                                              range_complete=[a.range_start, a.range_end]))
                self._bg.add(t)
                t.add_done_callback(self._bg.discard)

    async def _run_job(self, a: Assignment):
        if self.counters_for != a.work:
            self.counters_for = a.work
            self.batch_number = self.total_computed = self.total_valid = 0
        spans = self.computed.get(a.work, [])
        start = next(uncomputed(spans, a.range_start, a.range_end), a.range_end + 1)
        nonces = uncomputed(spans, a.range_start, a.range_end)
        lim = Limits(max_nonces=None, max_duration=None)  # the session keeps time
        if a.protocol == "v1":
            job = V1Job(block_hash=a.block_hash, public_key=a.public_key, block_height=a.block_height, params=a.params,
                        r_target=a.r_target, nonces=nonces, batch_size=a.batch_size, dtype=self.dtype, limits=lim)
        else:
            seq_len, k_dim = a.params
            job = V2Job(block_hash=a.block_hash, public_key=a.public_key, block_height=a.block_height,
                        seq_len=seq_len, k_dim=k_dim, nonces=nonces, batch_size=a.batch_size,
                        stronger_rng=a.stronger_rng, limits=lim)
        label = (f"pooled {self.worker_id[:8]} {a.protocol} range {start}..{a.range_end} key {a.public_key[:8]} "
                 f"batch {a.batch_size}")
        runner = self.runner = self._last_runner = new_runner(self.app, job, self.claim, label, borrowed=True)
        if self.end_reason is not None or self.assignment != a:  # changed while we got here
            runner.stop("stopped")
        summary = None
        epoch = self.epoch
        try:
            async with contextlib.aclosing(runner.events()) as events:
                async for kind, item in events:
                    if kind == "batch":
                        await self._result(a, item, epoch == self.epoch)
                    elif kind == "progress":
                        await self.emit({"status": "progress", **item})
                    else:
                        summary = item
        finally:
            self.runner = None
            runner.close()
        return summary

    async def _result(self, a: Assignment, batch: BatchResult, current: bool = True) -> None:
        """One batch -> one result per contiguous run of its nonces (a batch of a resumed job may straddle nonces
        computed earlier): durable in the spool first, then the line (so a streamed result is never lost)."""
        if not batch.nonces:
            return
        if current:
            add_spans(self.computed.setdefault(a.work, []), batch.nonces)
        for b in split_runs(batch):
            if self.end_reason == "error":
                return
            await self._one_result(a, b)

    async def _one_result(self, a: Assignment, b: BatchResult) -> None:
        self.batch_number += 1
        self.total_computed += len(b.nonces)
        head = {"worker_id": 0, "public_key": a.public_key, "block_hash": a.block_hash, "block_height": a.block_height}
        if a.protocol == "v1":
            nonces, dist = v1_hits(b, a.r_target)
            self.total_valid += len(nonces)
            body = {**head, "nonces": nonces, "dist": dist, "node_id": 0, "batch_number": self.batch_number,
                    "batch_computed": len(b.nonces), "batch_valid": len(nonces)}
        else:
            arts = b.artifacts or []
            self.total_valid += len(arts)
            body = {**head, "artifacts": arts, "encoding": v2.encoding(a.params[1]), "node_id": 0,
                    "batch_number": self.batch_number, "batch_computed": len(b.nonces), "batch_valid": len(arts)}
            if b.dropped:
                body["dropped_nonces"] = b.dropped
        body.update(total_computed=self.total_computed, total_valid=self.total_valid,
                    elapsed_seconds=int(b.elapsed), first_nonce=b.nonces[0], last_nonce=b.nonces[-1])
        body["idempotency_id"] = result_id(a, b.nonces[0], b.nonces[-1], len(b.nonces))
        url = self.client.worker_url
        if not self.sender.room(url) and self.runner is not None and not self.runner.ending:
            await self._wait_room(url)
        # past the cap only once the job is ending: the few batches that were in flight (the cap pauses the work)
        if not await self.sender.put("results", url, body, body["idempotency_id"], force=not self.sender.room(url)):
            # the sender is not running (the server is stopping): nothing more can be made durable
            self.request_end("error")
            await self._fail(f"the result sender took no more results ({self.sender.pending} pending): stopping",
                             "SenderClosed")
            return
        self.batches_sent += 1
        await self.emit(body)

    async def _wait_room(self, url: str) -> None:
        """The orchestrator's results are at the sender's cap (it has been unreachable for long): take no batch
        until one is delivered or dead-lettered, or the job ends (a command, max_duration, shutdown)."""
        await self.emit({"status": "paused", "pending_results": self.sender.pending_for(url)})
        log.warning("pooled %s paused: %d results pending for %s (the cap per destination)", self.worker_id[:8],
                    self.sender.pending_for(url), url)
        while not self.sender.room(url) and not self.runner.ending:
            await self.runner.hold(self.sender.wait_room(url))
        if self.sender.room(url):
            await self.emit({"status": "resumed", "pending_results": self.sender.pending_for(url)})

    async def _finish(self) -> None:
        c = self.cfg
        if self.end_reason == "error":
            return
        await self.emit({"status": "stopping", "reason": self.end_reason})
        server_down = self.end_reason == "server_shutdown"
        left = await self.sender.flush_url(self.client.worker_url,
                                           c.shutdown_flush_seconds if server_down else c.pooled_flush_seconds)
        stats = self._stats()
        await self._shutdown(stats, retry=not server_down)
        line = {"status": "shutdown", "total_batches_sent": stats["total_batches_sent"],
                "session_duration": stats["session_duration"]}
        if left:
            line["pending_results"] = left  # still in the spool: re-sent until acknowledged, also after a restart
        await self.emit(line)

    def _stats(self) -> dict:
        return {"total_batches_sent": self.batches_sent, "session_duration": round(self.elapsed, 3),
                "pending_results": self.sender.pending_for(self.client.worker_url), "reason": self.end_reason}

    # ------------------------------------------------------------------------- commands and config

    async def _polls(self) -> None:
        interval = self.cfg.pooled_poll_interval
        down = False
        while True:
            await asyncio.sleep(interval)
            if self.end_reason is not None:
                return
            if self.deadline is not None and time.monotonic() >= self.deadline:
                self.request_end("max_duration")
                return
            r = await self.client.config()
            if not r.ok:
                if not down:
                    down = True
                    await self.emit({"status": "orchestrator_unreachable", "error": r.error})
                continue
            if down:
                down = False
                await self.emit({"status": "orchestrator_reachable"})
            self._apply(r.data)

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.pooled_heartbeat_interval)
            await self.client.heartbeat(self.sender.pending_for(self.client.worker_url))

    def _merge(self, data) -> None:
        if not data or not isinstance(data, dict):
            return  # {} or null: nothing to merge (as the reference)
        for k in MERGE_KEYS:
            if k in data and data[k] is not None:
                v = data[k]
                if k in INT_KEYS and isinstance(v, float) and v.is_integer():
                    v = int(v)  # a Python orchestrator's division (as params' integer fields already are)
                self.conf[k] = v
        if "nonce_range_start" in data or "nonce_range_end" in data:
            self.range_given = True
        if self.conf["block_hash"]:
            self.got_block_hash.set()

    def _apply(self, data) -> None:
        """One config poll: merge it, then act on its command or on what changed."""
        if not data or not isinstance(data, dict):
            return
        typ = data.get("type")
        if self.assignment is not None and typ not in KEY_COMMANDS and "public_key" in data:
            # as the reference: a key in a plain config is merged but never applied while computing (only the
            # commands move the key), so an orchestrator that keeps serving the first key after a switch_job
            # does not switch the worker back
            data = {k: v for k, v in data.items() if k != "public_key"}
        self._merge(data)
        if typ == "shutdown":
            self.request_end("shutdown_command")
            return
        self._reassign(typ)

    def _reassign(self, typ) -> None:
        seen = json.dumps([self.conf, self.range_given], sort_keys=True, default=str)
        if seen == self._conf_seen:
            return  # nothing changed since the last poll (a repeated command is a no-op)
        self._conf_seen = seen
        try:
            new = self._assignment()
        except InputError as e:
            self.bad_config = e
            if self.runner is not None:
                self.runner.stop("stopped")
            self.changed.set()
            return
        cur = self.assignment
        if new is None or new == cur:
            return
        if cur is None:
            pass
        elif new.work == cur.work:  # only the key changed
            if typ == "switch_job":  # restart the range under the new key, counters reset (§4.3)
                self.computed.pop(new.work, None)
                self.epoch += 1
                self.finished.discard(new.work)
                self.counters_for = None
                self.announce.append({"status": "switched_public_key", "public_key": new.public_key[:16]})
            else:  # "compute": go on with the range under the new key
                self.announce.append({"status": "public_key_set", "public_key": new.public_key[:16]})
        elif (new.block_hash, new.params_key) == (cur.block_hash, cur.params_key) and new.r_target == cur.r_target:
            self.announce.append({"status": "new_range", "range_start": new.range_start, "range_end": new.range_end})
        else:
            self.announce.append({"status": "new_job", "block_hash": new.block_hash[:16], "block_height":
                                  new.block_height, "range_start": new.range_start, "range_end": new.range_end})
        self.assignment = new
        if self.runner is not None:
            self.runner.stop("stopped")  # ends after the batch in flight; that batch is still a result
        self.changed.set()

    def _batch_size(self) -> int:
        if self.req_batch_size is not None:
            return self.req_batch_size
        bs = self.conf.get("batch_size")
        if bs is not None:
            return schemas.get_batch_size({"batch_size": bs}, self.cfg)
        return self.cfg.pooled_batch_size

    def _assignment(self) -> Assignment | None:
        """The checked assignment, None while something is missing; InputError for a value that is wrong."""
        c = self.conf
        if not c["block_hash"] or not c["public_key"] or not self.range_given:
            return None
        bh, height, pk = schemas.get_header(c)
        params = c["params"]
        proto = schemas.protocol_of(params)
        if proto == "v1":
            p = schemas.parse_v1_params(params)
            r = c["r_target"]
            if r in (None, 0, 0.0):  # never given: the chain default, not 0 (which keeps every result empty: F7)
                r = v1.DEFAULT_R_TARGET
                if not self.r_target_warned:
                    self.r_target_warned = True
                    self.announce.append({"status": "r_target_default", "r_target": r})
            r_target = schemas.get_number({"r_target": r}, "r_target", lo=0, lo_open=True)
        else:
            p = schemas.parse_v2_params(params, served_model(self.app))
            r_target = 0.0
        start = schemas.get_int(c, "nonce_range_start", lo=0, hi=schemas.MAX_NONCE)
        # both ends are inclusive; an end below the start is an empty range (the reference's iterator yields
        # nothing and the session goes on): reported as complete at once, and the session waits for another
        end = schemas.get_int(c, "nonce_range_end", hi=schemas.MAX_NONCE)
        bs = self._batch_size()
        if proto == "v1":
            check_v1_memory(self.app, p, bs, self.dtype)
        else:
            check_v2_memory(self.app, bs, p[0])
        stronger = schemas.get_bool(c, "poc_stronger_rng", default=False)
        return Assignment(proto, bh, height, pk, r_target, p, json.dumps(params, sort_keys=True), start, end, bs,
                          stronger)


def uncomputed(spans: list[list[int]], start: int, end: int) -> Iterator[int]:
    """The nonces of [start, end] outside `spans`, in order. The spans are copied here, on the loop: the engine
    thread iterates while the loop adds this job's batches to them."""
    snapshot = [(lo, hi) for lo, hi in spans]

    def gen():
        n = start
        for lo, hi in snapshot:
            if lo > n:
                yield from range(n, min(lo, end + 1))
            n = max(n, hi + 1)
            if n > end:
                return
        yield from range(n, end + 1)

    return gen()


def split_runs(b: BatchResult) -> list[BatchResult]:
    """The batch as one BatchResult per run of consecutive nonces (itself when it is one run)."""
    cuts = [i for i in range(1, len(b.nonces)) if b.nonces[i] != b.nonces[i - 1] + 1]
    if not cuts:
        return [b]
    out = []
    for i, j in zip([0, *cuts], [*cuts, len(b.nonces)]):
        ns = b.nonces[i:j]
        lo, hi = ns[0], ns[-1]
        arts = None if b.artifacts is None else [x for x in b.artifacts if lo <= x["nonce"] <= hi]
        out.append(BatchResult(index=b.index, nonces=ns, elapsed=b.elapsed, batch_seconds=b.batch_seconds,
                               dist=None if b.dist is None else b.dist[i:j], artifacts=arts,
                               dropped=[n for n in b.dropped if lo <= n <= hi]))
    return out


def result_id(a: Assignment, first: int, last: int, count: int) -> str:
    """Deterministic: the same batch computed again (a switch back, a replay) has the same id, so the
    orchestrator keeps it once."""
    ident = f"results|{a.protocol}|{a.block_hash}|{a.public_key}|{a.params_key}|{a.r_target!r}|{a.stronger_rng}|" \
            f"{first}|{last}|{count}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


sessions_key = web.AppKey("pooled_sessions", set)
