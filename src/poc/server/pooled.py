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

This module is the session: the orchestrator calls, the device claim, the jobs, the stream and the stops. What it
computes next (the config merged, the checked Assignment, the ranges done and left, the result bodies) is
pooled_plan.py's PooledPlan, pure bookkeeping the session owns and feeds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from aiohttp import web

from poc.clients.orchestrator import OrchestratorClient
from poc.engine.base import Claim
from poc.engine.jobs import BatchResult
from poc.errors import InputError
from poc.logs import describe
from poc.server import schemas
from poc.server.context import (admit, check_v1_memory, check_v2_memory, config_key, engine_key, new_runner,
                                require_ready, sender_key, served_model, track_streams)
from poc.server.fields import get_batch_size, get_number, read_url_body
from poc.server.pooled_plan import Assignment, PooledPlan, split_runs
from poc.server.security import url_policy
from poc.server.stream import JobRunner, NdjsonWriter

log = logging.getLogger("poc.pooled")

GPU_COUNT = 1  # one engine: the server's device (replicas are the parallel engine's business)


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    track_streams(app, sessions_key, lambda s, why: s.request_end("server_shutdown" if why == "shutdown" else why))
    app.add_routes(routes)


@routes.post("/pooled")
async def pooled(request: web.Request) -> web.StreamResponse:
    app = request.app
    cfg = app[config_key]
    body, url = await read_url_body(request, cfg.max_body_bytes, "orchestrator_url",
                                    {"batch_size", "max_duration", "dtype"}, url_policy(app))
    batch_size = get_batch_size(body, cfg, default=None)
    max_duration = get_number(body, "max_duration", default=cfg.pooled_max_duration, lo=0, lo_open=True,
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


class PooledSession:
    def __init__(self, app: web.Application, url: str, batch_size: int | None, max_duration: float, dtype: str):
        self.app, self.url, self.max_duration, self.dtype = app, url, max_duration, dtype
        # the device, held while there is work (a block hash, then a range to compute): its jobs borrow it; a
        # session waiting for its orchestrator holds nothing, so /health stays ready and other jobs may run
        self.claim: Claim | None = None
        self.cfg = app[config_key]
        self.sender = app[sender_key]
        self.worker_id = str(uuid.uuid4())
        # the orchestrator's config, the assignment it makes and what of it is done (pure: pooled_plan.py)
        self.plan = PooledPlan(self.cfg, batch_size, dtype, model=lambda: served_model(app),
                               check_memory=memory_check(app, dtype))
        self.batches_sent = 0
        self.runner: JobRunner | None = None
        self._last_runner: JobRunner | None = None
        self._bg: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []  # the heartbeat and the config polls
        self.end_reason: str | None = None
        self.changed = asyncio.Event()
        self.got_block_hash = asyncio.Event()
        self.ended = asyncio.Event()  # request_end was called: retried calls stop waiting
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
        plan = self.plan
        await self.emit({"status": "waiting_block_hash"})
        if not plan.conf["block_hash"]:
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
        await self.emit({"status": "received_block_hash", "block_hash": plan.conf["block_hash"][:16]})
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
        if plan.reassign(None):
            self._changed()
        if plan.bad_config is not None:
            raise plan.bad_config
        pk = plan.conf["public_key"]
        await self.emit({"status": "ready", "public_key": pk[:16] if pk else None})
        self.deadline = time.monotonic() + self.max_duration  # the wait for a block hash had its own limit
        await self.emit({"status": "computing"})
        await self._compute()
        self.give_device()  # the flush and /shutdown below need no device
        await self._finish()

    async def _build_model(self) -> None:
        """The v1 model for the block hash and params (v2's checkpoint was loaded at start)."""
        params = self.plan.conf["params"]
        proto = schemas.protocol_of(params)
        if proto == "v1":
            p = schemas.parse_v1_params(params)
            bs = self.plan.batch_size()
            check_v1_memory(self.app, p, bs, self.dtype)
            await asyncio.to_thread(self.app[engine_key].build_v1, p, self.plan.conf["block_hash"], self.dtype)
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
        deadline, plan = self.deadline, self.plan
        while self.end_reason is None:
            for line in plan.announce:
                await self.emit(line)
            plan.announce.clear()
            if plan.bad_config is not None:
                raise plan.bad_config
            a = plan.assignment
            if plan.idle(a):
                self.changed.clear()
                self.give_device()  # nothing to compute until the orchestrator says more
                if a is None:
                    await self.emit({"status": "waiting_range" if plan.conf["public_key"] else "waiting_public_key"})
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
            elif summary.reason == "exhausted" and plan.assignment == a:
                plan.complete(a)
                await self.emit({"status": "range_complete", "range_start": a.range_start, "range_end": a.range_end,
                                 "total_batches": plan.batch_number, "total_computed": plan.total_computed})
                t = asyncio.create_task(self.client.heartbeat(self.sender.pending_for(self.client.worker_url),
                                                              range_complete=[a.range_start, a.range_end]))
                self._bg.add(t)
                t.add_done_callback(self._bg.discard)

    async def _run_job(self, a: Assignment):
        start, job = self.plan.begin(a)
        label = (f"pooled {self.worker_id[:8]} {a.protocol} range {start}..{a.range_end} key {a.public_key[:8]} "
                 f"batch {a.batch_size}")
        runner = self.runner = self._last_runner = new_runner(self.app, job, self.claim, label, borrowed=True)
        if self.end_reason is not None or self.plan.assignment != a:  # changed while we got here
            runner.stop("stopped")
        summary = None
        epoch = self.plan.epoch
        try:
            async with contextlib.aclosing(runner.events()) as events:
                async for kind, item in events:
                    if kind == "batch":
                        await self._result(a, item, epoch == self.plan.epoch)
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
            self.plan.record(a, batch.nonces)
        for b in split_runs(batch):
            if self.end_reason == "error":
                return
            await self._one_result(a, b)

    async def _one_result(self, a: Assignment, b: BatchResult) -> None:
        body = self.plan.result_body(a, b)
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
        return {"total_batches_sent": self.batches_sent, "session_duration": round(time.monotonic() - self.started, 3),
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
        self.plan.merge(data)
        if self.plan.conf["block_hash"]:
            self.got_block_hash.set()

    def _apply(self, data) -> None:
        """One config poll: merged, then its command or what changed acted on."""
        what = self.plan.apply(data)
        if self.plan.conf["block_hash"]:
            self.got_block_hash.set()
        if what == "shutdown":
            self.request_end("shutdown_command")
        elif what == "changed":
            self._changed()

    def _changed(self) -> None:
        """A new assignment, or a config the worker cannot compute: the job in flight ends after its batch in
        flight (that batch is still a result) and the compute loop looks again."""
        if self.runner is not None:
            self.runner.stop("stopped")
        self.changed.set()


def memory_check(app: web.Application, dtype: str):
    """The plan's check of an assignment against the device: InputError when its batches cannot fit."""
    def check(protocol: str, params, batch_size: int) -> None:
        if protocol == "v1":
            check_v1_memory(app, params, batch_size, dtype)
        else:
            check_v2_memory(app, batch_size, params[0])
    return check


sessions_key = web.AppKey("pooled_sessions", set)
