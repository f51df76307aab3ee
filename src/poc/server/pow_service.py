"""The PoC service behind /api/v1/pow (server/pow.py) and the MLNode's /api/v1/inference/pow (server/mlnode.py): one
generation loop, the FIFO queue of /generate and v1 /validate requests, the PoC v1 init and phase. Its API takes
request bodies as dicts and returns Python values; a refusal is an InputError carrying the HTTP status the routes
answer with. `stop_every_job` ends every PoC job and every other running job (the MLNode's stop).

Fixed against the reference (spec-v2 §f 7-12): batch_size, seq_len, k_dim and nonces are range-checked (400, never a
spinning loop or an endless retry); duplicate nonces are refused; `wait: true` while generation (or a stream) holds
the device is a 409 at once, not a wait; NaN-dropped nonces are reported and not counted as processed; /stop
delivers what was computed (every batch is spooled as it is computed and released to the sender, completed results
stay readable for result_ttl) instead of discarding it; validation scores missing or undecodable vectors as
mismatches, and leaves out of the sample the nonces it could not compute itself, as the deployed plugin does
(protocol.v2.validate: past 10% of them, no verdict). As in the reference, the background queue yields:
/init/generate and `wait: true` take the device from a queued job, which goes back to the head of the queue and runs
again once the device is free.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

from aiohttp import web

from poc.engine.jobs import BatchResult
from poc.errors import InputError
from poc.logs import describe
from poc.protocol import v1, v2
from poc.server import fields, schemas
from poc.server.context import (admission, check_v1_memory, claim_device, config_key,
                                default_v2_batch, end_sessions, engine_key, new_runner, require_ready, runners_key,
                                sender_key, served_model, tasks_key, wait_claim)
from poc.server.jobs import validate_v1
from poc.server.results import v1_hits, v2_body
from poc.server.stream import JobRunner, collect

log = logging.getLogger("poc.pow")

SHUTDOWN_JOB_WAIT = 30.0  # seconds shutdown waits for a stopped queued job to end its batch in flight


# --------------------------------------------------------------------------------------------------
# continuous generation (/init/generate, /phase/generate)


class Generation:
    """One generation loop on the device. Each batch is spooled as it arrives (a record held under this
    generation's id: durable at once, so a kill -9 loses none). The first batch is released as soon as it is
    stored (the chain weighs what a node committed early in the PoC window: the node's early-share guard); then
    every callback_interval seconds, and once more when it ends (stop, shutdown or error), what was held is
    released and goes to {url}/generated merged, as the reference posts (clients/callbacks.py). When the sender
    has no room for the url (its cap per destination), the generation takes no further batch until room opens
    (records delivered or moved to the dead-letter file): the runner's bound then pauses the engine, and the
    batches in flight wait in the runner, in order (JobRunner.hold). Once the job ends, what was in flight goes to
    the sender past its cap rather than wait in memory. Nothing is dropped."""

    def __init__(self, app: web.Application, protocol: str, init, runner: JobRunner):
        self.app, self.protocol, self.init, self.runner = app, protocol, init, runner
        self.id = uuid.uuid4().hex
        self.seq = itertools.count(1)
        self.error: str | None = None
        self.task: asyncio.Task | None = None
        self.paused = False  # waiting for room at the sender
        self.pauses = 0

    @property
    def active(self) -> bool:
        return self.task is not None and not self.task.done()

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"pow-generation-{self.id[:8]}")

    async def stop(self, reason: str = "stopped") -> None:
        self.runner.stop(reason)  # a paused generation stops waiting for room
        if self.task is not None:
            await asyncio.shield(self.task)  # ends after the batch in flight, with a final release

    async def _run(self) -> None:
        interval = self.app[config_key].callback_interval
        last = time.monotonic()
        first = True  # the first batch goes out at once: the chain judges early work (the node's early-share guard)
        try:
            async with contextlib.aclosing(self.runner.events()) as events:
                async for kind, item in events:
                    if kind == "batch":
                        if await self.spool(item) and first and (item.artifacts or self.protocol == "v1"):
                            first = False
                            await self.app[sender_key].stored()
                            self.app[sender_key].release(self.id)
                            last = time.monotonic()
                    elif kind == "done" and item.reason == "error":
                        self.error = f"{item.error_type}: {item.error}"
                    if time.monotonic() - last >= interval:
                        self.app[sender_key].release(self.id)
                        last = time.monotonic()
        finally:
            try:  # the batches handed over just before the end are stored first, so the final release merges them
                await self.app[sender_key].stored()
            finally:
                self.app[sender_key].release(self.id, final=True)
            self.runner.close()

    async def _wait_room(self) -> None:
        """Hold the generation until the sender has room for the url, or the job is ending."""
        sender, url = self.app[sender_key], self.init.url
        self.paused = True
        self.pauses += 1
        log.warning("generation %s paused: %d callback record(s) pending for %s (the cap per destination); it resumes "
                    "as they are delivered or dead-lettered", self.id[:8], sender.pending_for(url), url)
        try:
            while not sender.room(url) and not self.runner.ending:
                sender.release(self.id)  # the held records must go out to make room
                await self.runner.hold(sender.wait_room(url))
        finally:
            self.paused = False
        if sender.room(url):
            log.info("generation %s resumes", self.id[:8])

    async def spool(self, b: BatchResult) -> bool:
        """Hand one computed batch to the callback sender, held until the next release (nothing is discarded),
        after waiting for room while the job goes on; True when it went to the sender (not empty)."""
        url = self.init.url
        if url is None:
            return False
        i = self.init
        if self.protocol == "v2":
            if not b.artifacts and not b.dropped:
                return False
            payload = {"public_key": i.public_key, "block_hash": i.block_hash, "block_height": i.block_height,
                       "node_id": i.node_id, **v2_body(b, i.k_dim)}
        else:
            nonces, dist = v1_hits(b, i.r_target)
            if not nonces:
                return False
            payload = v1.ProofBatch(i.public_key, i.block_hash, i.block_height, nonces, dist, i.node_id).to_json()
        sender = self.app[sender_key]
        if not sender.room(url) and not self.runner.ending:
            await self._wait_room()
        # past the cap only once the job is ending: the few batches that were in flight (the cap pauses the work)
        sender.submit("generated", url, payload, f"{self.id}-{next(self.seq)}", merge=self.id,
                      force=not sender.room(url))
        return True

    def stats(self) -> dict:
        s = self.runner.stats
        processed = s.computed - s.dropped  # NaN-dropped nonces are not "processed" (spec-v2 §f 7)
        d = {"total_processed": processed, "nonces_per_second": round(s.rate, 3)}
        if self.paused or self.pauses:
            d["paused"], d["pauses"] = self.paused, self.pauses  # waiting for callback room (see Generation)
        if self.protocol == "v1":
            d["total_valid"] = s.valid
        else:
            d["dropped_nonces"] = s.dropped
        return d


# --------------------------------------------------------------------------------------------------
# the queue (/generate without wait, /validate for v1)


@dataclass
class QueuedJob:
    kind: str  # "generate" (v2) or "validate_v1"
    request: object  # PowV2Generate, or (ProofBatch, PowV1Init)
    n_nonces: int
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    status: str = "queued"  # queued | running | completed | failed | cancelled
    result: dict | None = None
    error: str | None = None
    finished_at: float | None = None
    runner: JobRunner | None = None
    preempted: bool = False  # stopped to let generation or a wait=true request have the device; runs again

    def view(self) -> dict:
        d = {"status": self.status, "request_id": self.id}
        if self.result is not None:
            d.update(self.result)
        if self.error is not None:
            d["error"] = self.error
        return d


class PowService:
    def __init__(self, app: web.Application):
        self.app = app
        self.gen: Generation | None = None
        self.v1_init: schemas.PowV1Init | None = None
        self.v1_phase = "IDLE"
        self.queue: deque[QueuedJob] = deque()
        self.jobs: dict[str, QueuedJob] = {}
        self.queued_nonces = 0  # queued + running
        self._wake = asyncio.Event()
        self._worker: asyncio.Task | None = None
        self._closing = False
        self._running: tuple[QueuedJob, object] | None = None  # the queued job on the device, and its claim
        self._job_ended = asyncio.Event()
        self._holdoff = 0  # preemptions in progress: the queue takes the device only when this is 0
        self._resume = asyncio.Event()

    @property
    def cfg(self):
        return self.app[config_key]

    # ------------------------------------------------------------------------------- life cycle

    def _ensure_worker(self) -> None:
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._work(), name="pow-queue")
            self.app[tasks_key]["pow-queue"] = self._worker

    async def shutdown(self) -> None:
        """SIGTERM: stop generation (releasing its spooled batches to the sender) and the queue."""
        self._closing = True
        await self._stop_all("shutdown")
        # a queued job just stopped ends after its batch in flight: the worker is cancelled once it is idle, never
        # inside the job (Python 3.11's wait_for can swallow a cancel that meets a result: the task would then hang)
        deadline = time.monotonic() + SHUTDOWN_JOB_WAIT
        while self._running is not None and time.monotonic() < deadline:
            self._job_ended.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._job_ended.wait(), max(0.0, deadline - time.monotonic()))
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)

    async def _stop_all(self, reason: str) -> None:
        # the queue first: while generation stops and frees the device, the worker must not start a queued job
        now = time.monotonic()
        while self.queue:
            j = self.queue.popleft()
            j.status, j.finished_at = "cancelled", now
            self.queued_nonces -= j.n_nonces
        if self.gen is not None and self.gen.active:
            await self.gen.stop(reason)
        for j in self.jobs.values():
            if j.status == "running" and j.runner is not None:
                j.status = "cancelled"
                j.runner.stop(reason)
        self.v1_phase = "IDLE"

    # ----------------------------------------------------------------------------------- helpers

    def _refuse_if_generating(self) -> None:
        if self.gen is not None and self.gen.active:
            raise InputError("Already generating: POST /api/v1/pow/stop first", None, status=409)

    async def _claim_before_queue(self, owner: str):
        """The device for generation or a wait=true request: a queued job holding it is stopped after its batch in
        flight and put back at the head of the queue (the reference's queue waits while generation runs and
        interleaves with wait=true, spec-v2 §e.2). Anything else holding the device: 409 at once."""
        running = self._running
        if running is None or self.app[engine_key].lock.holder is not running[1]:
            return claim_device(self.app, owner)
        job, _ = running
        self._holdoff += 1
        try:
            job.preempted = True
            if job.runner is not None:
                job.runner.stop("preempted")
            while self._running is not None and self._running[0] is job:
                self._job_ended.clear()
                await self._job_ended.wait()
            return claim_device(self.app, owner)  # before the queue can claim again (no await in between)
        finally:
            self._holdoff -= 1
            if not self._holdoff:
                self._resume.set()

    async def _start_generation(self, protocol: str, init, job, label: str) -> None:
        claim = await self._claim_before_queue(f"pow generation ({protocol})")
        self.gen = Generation(self.app, protocol, init, new_runner(self.app, job, claim, label))
        self.gen.start()

    def _default_batch(self, seq_len: int) -> int:
        """A v2 request's batch when it gives none: the engine's for the served model (context.default_v2_batch)."""
        return default_v2_batch(self.app, seq_len)

    def need_v1(self) -> schemas.PowV1Init:
        """The PoC v1 init in place; 409 without one."""
        if self.v1_init is None:
            raise InputError("PoC v1 is not initialized: POST /api/v1/pow/init first", None, status=409)
        return self.v1_init

    # ------------------------------------------------------------------------------------- the API

    @property
    def v1_in_progress(self) -> bool:
        """PoC v1 initialized (generating or validating, until stop_all) or generating."""
        return self.v1_init is not None or self._v1_generating()

    async def init_generate(self, body: dict) -> str:
        """Start continuous generation (v1 or v2 by the params); the state, "GENERATING"."""
        if "params" not in body:
            raise InputError("missing required field: params", "params")
        proto = schemas.protocol_of(body["params"])
        require_ready(self.app)
        if proto == "v1":
            init = schemas.parse_pow_v1_init(body, self.cfg, need_node=True)
            admission(self.app, v1=(init.params, init.batch_size, "float16"))
            if self._v1_generating() and init == self.v1_init:
                return "GENERATING"  # the reference starts nothing anew for the same init
            await self._stop_v1_generation()
            self._refuse_if_generating()
            await self._start_generation("v1", init, init.job(),
                                         f"v1 pow generation node {init.node_id}/{init.node_count}")
            self.v1_init, self.v1_phase = init, "GENERATING"
            return "GENERATING"
        init = schemas.parse_pow_v2_init(body, self.cfg, served_model(self.app), self._default_batch)
        admission(self.app, v2=(init.batch_size, init.seq_len))
        self._refuse_if_generating()
        await self._start_generation("v2", init, init.job(), f"v2 pow generation node {init.node_id}/{init.node_count} "
                                                             f"group {init.group_id}/{init.n_groups}")
        return "GENERATING"

    async def _v1_init_body(self, body: dict, need_node: bool) -> schemas.PowV1Init:
        if "params" not in body:
            raise InputError("missing required field: params", "params")
        if schemas.protocol_of(body["params"]) != "v1":
            raise InputError("PoC v2 has no /init or /init/validate: use /init/generate or /generate", "params")
        require_ready(self.app)
        init = schemas.parse_pow_v1_init(body, self.cfg, need_node=need_node)
        admission(self.app, v1=(init.params, init.batch_size, "float16"))
        await self._stop_v1_generation()
        self._refuse_if_generating()
        return init

    def _v1_generating(self) -> bool:
        return self.gen is not None and self.gen.active and self.gen.protocol == "v1"

    async def _stop_v1_generation(self) -> None:
        """A v1 init or phase call while v1 generation runs switches the phase, as the reference's (an MLNode sends
        /init/validate straight after generating, with no stop): generation ends after its batch in flight and
        what it computed is released to {url}/generated. v2 generation still needs /stop (409)."""
        if self._v1_generating():
            await self.gen.stop()

    async def init(self, body: dict) -> str:
        """PoC v1 init (no generation); the state, "IDLE"."""
        self.v1_init, self.v1_phase = await self._v1_init_body(body, need_node=False), "IDLE"
        return "IDLE"

    async def init_validate(self, body: dict) -> str:
        """PoC v1 init for validation; the state, "VALIDATING"."""
        self.v1_init, self.v1_phase = await self._v1_init_body(body, need_node=False), "VALIDATING"
        return "VALIDATING"

    async def phase_generate(self) -> str:
        """PoC v1 generation under the init in place; the state, "GENERATING"."""
        init = self.need_v1()
        if init.node_id < 0:
            raise InputError("node_id and node_count were not given to /init: use /init/generate", "node_id")
        if self._v1_generating():
            return "GENERATING"  # the reference only sets the phase it is already in
        require_ready(self.app)
        self._refuse_if_generating()
        await self._start_generation("v1", init, init.job(),
                                     f"v1 pow generation node {init.node_id}/{init.node_count}")
        self.v1_phase = "GENERATING"
        return "GENERATING"

    async def phase_validate(self) -> str:
        """End generation (its batches still delivered); the state, "VALIDATING"."""
        self.need_v1()
        if self.gen is not None and self.gen.active:
            await self.gen.stop()
        self.v1_phase = "VALIDATING"
        return "VALIDATING"

    async def validate(self, body: dict) -> dict:
        """Queue a v1 ProofBatch to score; the ValidatedBatch goes to {url}/validated (and result(id))."""
        init = self.need_v1()
        batch = schemas.parse_proof_batch(body, self.cfg, as_reference=True)
        if batch.block_hash != init.block_hash:
            raise InputError(f"block_hash {fields.short(batch.block_hash)} is not the initialized {init.block_hash!r}",
                             "block_hash")
        # queued, not admitted: it waits for the device (and a load) in the queue; only its memory is checked now
        check_v1_memory(self.app, init.params, max(1, min(len(set(batch.nonces)), 100)), "float16")
        job = self._enqueue("validate_v1", (batch, init), len(batch.nonces))
        return {"status": "OK", "pow_status": {"status": self.v1_phase}, "request_id": job.id,
                "queued_count": len(batch.nonces)}

    async def generate(self, body: dict) -> dict:
        """v2 artifacts (or a verdict) for explicit nonces: queued ({"status": "queued", "request_id", ...}), or with
        `wait: true` computed now ({"status": "completed", ...}; 409 at once while generation holds the device)."""
        require_ready(self.app)
        req = schemas.parse_pow_v2_generate(body, self.cfg, served_model(self.app), self._default_batch)
        admission(self.app, v2=(req.batch_size, req.seq_len))
        if req.wait:
            # 409 at once while generation runs, never a blocking wait (§f 11); a queued job steps aside
            claim = await self._claim_before_queue("pow /generate wait")
            job = QueuedJob("generate", req, len(req.nonces), status="running")
            result = await self._compute_v2(job, claim)
            return {"status": "completed", "request_id": job.id, **result}
        job = self._enqueue("generate", req, len(req.nonces))
        return {"status": "queued", "request_id": job.id, "queued_count": len(req.nonces)}

    def result(self, request_id: str, named: str | None = None) -> dict:
        """A queued request's view; 404 once unknown or expired. `named`: the id as the caller wrote it (messages)."""
        self._sweep()
        job = self.jobs.get(request_id)
        if job is None:
            raise InputError(f"Request {named or request_id} not found (unknown, or expired "
                             f"{self.cfg.result_ttl:.0f} s after it finished)", "request_id", status=404)
        return job.view()

    def status(self) -> dict:
        """{"status": LOADING | GENERATING | VALIDATING | IDLE, "is_model_initialized", "config", "stats", "queue"
        [, "last_error"]}."""
        engine = self.app[engine_key]
        gen = self.gen if self.gen is not None and self.gen.active else None
        if engine.state == "loading":
            state = "LOADING"
        elif gen is not None:
            state = "GENERATING"
        elif self.v1_phase == "VALIDATING":
            state = "VALIDATING"
        else:
            state = "IDLE"
        running = sum(1 for j in self.jobs.values() if j.status == "running")
        body = {"status": state, "is_model_initialized": engine.v2 is not None or self.v1_init is not None,
                "config": gen.init.status_config() if gen else (self.v1_init.status_config() if self.v1_init else None),
                "stats": gen.stats() if gen else None,
                "queue": {"queued": len(self.queue), "running": running, "queued_nonces": self.queued_nonces}}
        if self.gen is not None and not self.gen.active and self.gen.error:
            body["last_error"] = self.gen.error
        return body

    async def stop_all(self) -> None:
        """Stop generation (its batches still delivered), the queue and the v1 init."""
        await self._stop_all("stopped")
        self.v1_init = None

    # ------------------------------------------------------------------------------------ queue

    def _enqueue(self, kind: str, req, n: int) -> QueuedJob:
        if self._closing:
            raise InputError("the server is shutting down", None, status=503)
        if self.queued_nonces + n > self.cfg.max_queued_nonces:
            raise InputError(f"Queue full: {self.queued_nonces} nonces queued, {n} more would pass the limit of "
                             f"{self.cfg.max_queued_nonces}", "nonces", status=429)
        self._sweep()
        job = QueuedJob(kind, req, n)
        self.jobs[job.id] = job
        self.queue.append(job)
        self.queued_nonces += n
        self._ensure_worker()
        self._wake.set()
        return job

    def _sweep(self) -> None:
        """Forget results `result_ttl` seconds after they finished."""
        cut = time.monotonic() - self.cfg.result_ttl
        for rid in [r for r, j in self.jobs.items() if j.finished_at is not None and j.finished_at < cut]:
            del self.jobs[rid]

    async def _work(self) -> None:
        while True:
            while not self.queue:
                self._wake.clear()
                await self._wake.wait()
            while self._holdoff:  # a preemption is handing the device to generation or a wait=true request
                self._resume.clear()
                await self._resume.wait()
            job = self.queue[0]
            claim = await wait_claim(self.app, f"pow queue {job.id[:8]}")  # waits (without blocking the loop) for the device
            if not self.queue or self.queue[0] is not job:  # cancelled by /stop meanwhile
                claim.release()
                continue
            self.queue.popleft()
            job.status, job.preempted = "running", False
            self._running = (job, claim)
            try:
                if job.kind == "generate":
                    job.result = await self._compute_v2(job, claim)
                else:
                    job.result = await self._validate_v1(job, claim)
                if job.status == "running":
                    job.status = "completed"
                    self._deliver(job)
            except InputError as e:
                if job.preempted and job.status == "running":  # runs again, from its first nonce, when free
                    job.status = "queued"
                    self.queue.appendleft(job)
                    continue
                job.status = "cancelled" if job.status == "cancelled" else "failed"
                job.error = e.message
            except Exception as e:  # one line, the queue goes on
                job.status, job.error = "failed", f"{type(e).__name__}: {e}"
                log.warning("queued job %s failed %s", job.id, describe(e))
            finally:
                claim.release()
                job.runner = None
                self._running = None
                self._job_ended.set()
                if job.status != "queued":
                    job.finished_at = time.monotonic()
                    self.queued_nonces -= job.n_nonces

    async def _compute_v2(self, job: QueuedJob, claim) -> dict:
        req: schemas.PowV2Generate = job.request
        label = f"v2 pow /generate of {len(req.nonces)} nonces" + (" (validation)" if req.received is not None else "")
        job.runner = new_runner(self.app, req.job(), claim, label)
        results, _ = await collect(job.runner)
        # batches arrive in completion order (replicas): answer in the request's order, as one device does
        pos = {n: i for i, n in enumerate(req.nonces)}
        arts = sorted((a for b in results for a in (b.artifacts or [])), key=lambda a: pos[a["nonce"]])
        dropped = sorted((n for b in results for n in b.dropped), key=pos.__getitem__)
        if req.received is None:
            out = {"artifacts": arts, "encoding": v2.encoding(req.k_dim)}
            if dropped:
                out["dropped_nonces"] = dropped
            return out
        computed = {a["nonce"]: a["vector_b64"] for a in arts}
        try:
            return v2.validate(computed, req.received, req.nonces, req.k_dim, req.stat)
        except v2.NoVerdict as e:  # the queued job fails with it (no callback); a wait=true request gets the 503
            raise InputError(str(e), "nonces", status=503) from None

    async def _validate_v1(self, job: QueuedJob, claim) -> dict:
        batch, init = job.request
        vb = await validate_v1(self.app, batch, init.params, init.r_target, init.fraud_threshold, "float16", claim,
                               on_runner=lambda r: setattr(job, "runner", r))
        return vb.to_json()

    def _deliver(self, job: QueuedJob) -> None:
        """The completed job's callback, if it asked for one."""
        sender = self.app[sender_key]
        if job.kind == "validate_v1":
            _batch, init = job.request
            if init.url:  # one record per finished job (the queue bounds them): past the cap rather than lost
                sender.submit("validated", init.url, job.result, job.id, force=True)
            return
        req: schemas.PowV2Generate = job.request
        if not req.url:
            return
        head = {"request_id": job.id, "block_hash": req.block_hash, "block_height": req.block_height,
                "public_key": req.public_key, "node_id": req.node_id}
        # a verdict's callback leaves out per_nonce (evidence for GET /generate/{id}), as the plugin's does: it stays
        # one small record whatever the sample size
        body = {k: v for k, v in job.result.items() if k != "per_nonce"}
        sender.submit("validated" if req.received is not None else "generated", req.url, {**head, **body},
                      job.id, force=True)


pow_key = web.AppKey("pow", PowService)


async def stop_every_job(app: web.Application, why: str) -> None:
    """Stop every job: PoC generation, the queue and the v1 init, any /generate job, and every /pooled or /warmup
    session, computing or still waiting for its work (the MLNode's stop ends all its work too). What was computed
    is still delivered (a session's results and its orchestrator's /shutdown go out after its job has ended)."""
    await app[pow_key].stop_all()
    end_sessions(app, "stopped")
    others = list(app[runners_key])
    for r in others:
        r.stop("stopped")
    if others:
        log.info("%s: stopped %d other job(s)", why, len(others))
