"""Fakes for the outbound side, each a small aiohttp app on 127.0.0.1 that records what it receives: an
orchestrator (/pooled) with deterministic faults and a restart, a warmup controller, and the Vast autoscaler the
PyWorker reports to. Plus an NDJSON line reader that keeps arrival times, model_server.py as a subprocess, and an
event loop on a thread for a fake that outlives a test's loop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter, deque
from pathlib import Path

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent


def diagnostic(name: str):
    """benchmarks/diagnostics/<name>.py as a module (its folder on sys.path while it loads: the scripts import
    first_result from beside them)."""
    import importlib.util

    import pytest

    folder = ROOT / "benchmarks" / "diagnostics"
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        spec = importlib.util.spec_from_file_location(f"{name}_under_test", folder / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


READY = "Application startup complete."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ThreadLoop:
    """An event loop on a thread, for a fake that outlives each test's own loop."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 10.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def routed_app(*routes: tuple[str, str, object]) -> web.Application:
    """An aiohttp app answering each (method, path, handler)."""
    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    return app


class LoopbackApp:
    """An aiohttp app on 127.0.0.1:<port> that can be stopped and started again on the same port."""

    def __init__(self, app: web.Application, port: int | None = None):
        self.app, self.port = app, port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None
        self.restarts = 0

    async def start(self) -> "LoopbackApp":
        self._runner = web.AppRunner(self.app, handle_signals=False, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def restart(self, down_for: float) -> None:
        """Go away (connections refused) for `down_for` seconds, then listen again with the same state."""
        await self.stop()
        self.app = self._rebuild()
        await asyncio.sleep(down_for)
        await self.start()
        self.restarts += 1

    def _rebuild(self) -> web.Application:  # a cleaned-up app cannot be set up again
        raise NotImplementedError


# --------------------------------------------------------------------------------------------------
# the orchestrator


class FakeOrchestrator(LoopbackApp):
    """spec-v1 §4.3's API. GET config serves one-shot replies from `commands` first, else `config`. Results are
    kept once per idempotency_id (as a real orchestrator that drops repeats), and every POST that carried an id
    is counted. Faults, by the running count n of POSTs: n % fail_every == 0 -> 500 before anything is done;
    n % drop_after_every == 0 -> processed, then the connection is dropped without an answer; n %
    drop_before_every == 0 -> dropped unprocessed. `reject_results` answers 500 to every result."""

    def __init__(self, *, fail_every: int = 0, drop_after_every: int = 0, drop_before_every: int = 0,
                 port: int | None = None, batch_route: bool = True, shutdown_delay: float = 0.0):
        self.fail_every, self.drop_after_every, self.drop_before_every = fail_every, drop_after_every, drop_before_every
        self.batch_route = batch_route  # False: no POST /results/batch (404), as a minimal orchestrator
        self.shutdown_delay = shutdown_delay  # seconds /shutdown takes to answer, after recording the call
        self.late: list[str] = []  # heartbeats and config polls that arrived after a /shutdown call
        self.connect_reply: dict = {"status": "wait"}
        self.ready_reply: dict = {}
        self.config: dict = {}
        self.commands: deque = deque()
        self.reject_results = False
        self.n_posts = 0
        self.faults = Counter()
        self.accepted: dict[str, dict] = {}
        self.accepted_at: dict[str, float] = {}
        self.posts = Counter()  # idempotency_id -> POSTs (single or batch) that carried it
        self.batch_posts = 0
        self.served: list[tuple[float, dict]] = []  # (time, reply) of GET config replies that had a "type"
        self.connects: list[dict] = []
        self.readies: list[dict] = []
        self.heartbeats: list[dict] = []
        self.shutdowns: list[dict] = []
        self.on_result = None  # callback(n_result_posts) for tests that act mid-stream
        self.result_posts = 0
        super().__init__(self._rebuild(), port)

    def _rebuild(self) -> web.Application:
        w = "/api/workers/{wid}"
        batch = [("POST", f"{w}/results/batch", self._results_batch)] if self.batch_route else []
        return routed_app(("POST", "/api/workers/connect", self._connect), ("GET", f"{w}/config", self._config),
                          ("POST", f"{w}/ready", self._ready), ("POST", f"{w}/results", self._results), *batch,
                          ("POST", f"{w}/heartbeat", self._heartbeat), ("POST", f"{w}/shutdown", self._shutdown))

    # ---------------------------------------------------------------------------------- faults

    def _fault(self, request: web.Request, when: str) -> web.Response | None:
        n = self.n_posts
        if when == "before":
            if self.fail_every and n % self.fail_every == 0:
                self.faults["500"] += 1
                return web.json_response({"error": "injected"}, status=500)
            if self.drop_before_every and n % self.drop_before_every == 0:
                self.faults["drop_before"] += 1
                return self._drop(request)
        elif self.drop_after_every and n % self.drop_after_every == 0:
            self.faults["drop_after"] += 1
            return self._drop(request)
        return None

    @staticmethod
    def _drop(request: web.Request) -> web.Response:
        request.transport.close()  # the client sees the connection go, with no status line
        raise asyncio.CancelledError

    async def _post(self, request: web.Request, process) -> web.StreamResponse:
        self.n_posts += 1
        r = self._fault(request, "before")
        if r is not None:
            return r
        reply = await process(await request.json())
        r = self._fault(request, "after")
        return r if r is not None else web.json_response(reply)

    # ---------------------------------------------------------------------------------- routes

    async def _connect(self, request):
        async def p(body):
            self.connects.append(body)
            return self.connect_reply
        return await self._post(request, p)

    async def _config(self, request):
        if self.shutdowns:
            self.late.append("config")
        if self.commands:
            reply = self.commands.popleft()
            self.served.append((time.monotonic(), reply))
        else:
            reply = self.config
        return web.json_response(reply)

    async def _ready(self, request):
        async def p(body):
            self.readies.append(body)
            return self.ready_reply
        return await self._post(request, p)

    def _take(self, result: dict) -> None:
        rid = result["idempotency_id"]
        self.posts[rid] += 1
        if rid not in self.accepted:
            self.accepted[rid] = result
            self.accepted_at[rid] = time.monotonic()

    def _accept(self, results: list[dict], key: str | None = None, batch: bool = False) -> dict:
        """One result POST, single (with its Idempotency-Key header) or batch: 500 while rejecting, else each result
        taken and on_result told the count."""
        if self.reject_results:
            raise web.HTTPInternalServerError()
        assert key is None or key == results[0]["idempotency_id"]
        self.batch_posts += batch
        self.result_posts += 1
        for r in results:
            self._take(r)
        if self.on_result is not None:
            self.on_result(self.result_posts)
        return {"status": "ok"}

    async def _results(self, request):
        async def p(body):
            return self._accept([body], key=request.headers.get("Idempotency-Key", "missing"))
        return await self._post(request, p)

    async def _results_batch(self, request):
        async def p(body):
            return self._accept(body["results"], batch=True)
        return await self._post(request, p)

    async def _heartbeat(self, request):
        async def p(body):
            if self.shutdowns:
                self.late.append("heartbeat")
            self.heartbeats.append(body)
            return {"status": "ok"}
        return await self._post(request, p)

    async def _shutdown(self, request):
        async def p(body):
            self.shutdowns.append(body)
            await asyncio.sleep(self.shutdown_delay)
            return {"status": "ok"}
        return await self._post(request, p)

    # ---------------------------------------------------------------------------------- checks

    def spans(self, public_key: str | None = None) -> list[tuple[int, int]]:
        """(first_nonce, last_nonce) of every accepted result, sorted."""
        return sorted((r["first_nonce"], r["last_nonce"]) for r in self.accepted.values()
                      if public_key is None or r["public_key"] == public_key)


def covers_exactly(spans: list[tuple[int, int]], start: int, end: int) -> bool:
    """The spans tile [start, end]: no gap, no overlap."""
    nxt = start
    for a, b in spans:
        if a != nxt or b < a:
            return False
        nxt = b + 1
    return nxt == end + 1


# --------------------------------------------------------------------------------------------------
# the warmup controller


class FakeController(LoopbackApp):
    """GET /warmup/params: "waiting" for the first `ready_after` polls, then ready with `params`.
    POST /warmup/complete: 500 for the first `fail_complete` posts, then recorded."""

    def __init__(self, params: dict | None = None, ready_after: int = 2, fail_complete: int = 0):
        self.params, self.ready_after, self.fail_complete = params, ready_after, fail_complete
        self.polls: list[tuple[float, str]] = []
        self.completes: list[tuple[float, dict]] = []
        self.complete_posts = 0
        super().__init__(self._rebuild())

    def _rebuild(self) -> web.Application:
        return routed_app(("GET", "/warmup/params", self._params), ("POST", "/warmup/complete", self._complete))

    async def _params(self, request):
        self.polls.append((time.monotonic(), request.query.get("job_id")))
        if self.params is not None and len(self.polls) > self.ready_after:
            return web.json_response({"status": "ready", "params": self.params})
        return web.json_response({"status": "waiting"})

    async def _complete(self, request):
        self.complete_posts += 1
        if self.complete_posts <= self.fail_complete:
            return web.json_response({"error": "injected"}, status=500)
        self.completes.append((time.monotonic(), await request.json()))
        return web.json_response({"ok": True})


# --------------------------------------------------------------------------------------------------
# the Vast autoscaler (what the PyWorker reports to)


class FakeAutoscaler(LoopbackApp):
    def __init__(self, pubkey_pem: str):
        self.pubkey_pem = pubkey_pem
        self.status: list[tuple[float, dict]] = []
        self.deleted: list[dict] = []
        self.pubkey_fetches = 0
        super().__init__(self._rebuild())

    def _rebuild(self) -> web.Application:
        return routed_app(("GET", "/pubkey/", self._pubkey), ("POST", "/worker_status/", self._status),
                          ("POST", "/delete_requests/", self._delete))

    async def _pubkey(self, request):
        self.pubkey_fetches += 1
        return web.Response(text=self.pubkey_pem)

    async def _status(self, request):
        self.status.append((time.monotonic(), await request.json()))
        return web.json_response({"ok": True})

    async def _delete(self, request):
        self.deleted.append(await request.json())
        return web.json_response({"ok": True})


# --------------------------------------------------------------------------------------------------
# reading NDJSON as it arrives


class Lines:
    """Reads an NDJSON response in the background: `items` holds (arrival time, line)."""

    def __init__(self, resp):
        self.resp = resp
        self.items: list[tuple[float, dict]] = []
        self.ended = False
        self.error: Exception | None = None  # the connection broke (a killed server)
        self.task = asyncio.create_task(self._read())

    async def _read(self) -> None:
        try:
            async for raw in self.resp.content:
                self.items.append((time.monotonic(), json.loads(raw)))
        except (aiohttp.ClientError, ConnectionError) as e:
            self.error = e
        finally:
            self.ended = True

    def lines(self) -> list[dict]:
        return [d for _, d in self.items]

    async def wait(self, pred, timeout: float = 10.0, start: int = 0) -> tuple[float, dict, int]:
        """The first line at index >= start matching `pred`: (arrival time, line, index)."""
        t0 = time.monotonic()
        i = start
        while True:
            while i < len(self.items):
                t, d = self.items[i]
                if pred(d):
                    return t, d, i
                i += 1
            assert not self.ended, f"stream ended without the line; last lines: {self.lines()[-5:]}"
            assert time.monotonic() - t0 < timeout, f"no such line in {timeout} s; last lines: {self.lines()[-5:]}"
            await asyncio.sleep(0.005)

    async def finish(self, timeout: float = 20.0) -> list[dict]:
        await asyncio.wait_for(self.task, timeout)
        return self.lines()


def status(name: str):
    return lambda d: d.get("status") == name


def is_result(d: dict) -> bool:
    return "idempotency_id" in d


async def wait_until(cond, timeout: float = 10.0, what: str = "") -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what or cond}"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------------------------------
# model_server.py as a subprocess


class ServerProcess:
    """model_server.py on 127.0.0.1:<port>, its output in a log file; stopped by its PID. Its spool is beside the
    log unless the arguments or the environment name one (the default, ./spool, is inside the checkout)."""

    def __init__(self, log: Path, *args: str, port: int | None = None, env: dict | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._out = open(log, "ab")
        e = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        if "--spool-dir" not in args and not e.get("POC_SPOOL_DIR"):
            args = (*args, "--spool-dir", str(log.parent / f"{log.stem}-spool"))
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "model_server.py"), "--port", str(self.port),
                                      "--device", "cpu", *args], stdout=self._out, stderr=subprocess.STDOUT,
                                     cwd=ROOT, env=e)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    async def wait_ready(self, timeout: float = 60.0, count: int = 1) -> None:
        t0 = time.monotonic()
        while self.text().count(READY) < count:
            assert self.proc.poll() is None, f"server exited {self.proc.returncode}:\n{self.text()}"
            assert time.monotonic() - t0 < timeout, self.text()
            await asyncio.sleep(0.05)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._out.close()
        return self.proc.returncode


# --------------------------------------------------------------------------------------------------
# an engine with replicas, made deterministic


class TwoReplicaEngine:
    """What DistEngine does with two replicas, made deterministic: batches are dealt in nonce order, two
    ahead, to replicas A and B; results arrive in completion order. A is stuck on its first batch while B races
    ahead (A completes only when B has nothing left); a stop reports each replica's launched batch and drops its
    queued one (A's, the job's third batch, lies before B's launched one). The launched batches are reported
    B's first on odd stops (the last result to arrive is then the oldest) and A's first on even ones.
    v1 batches carry zero distances (every nonce a hit), v2 batches an artifact per nonce."""

    @staticmethod
    def make(base):
        import numpy as np

        from poc.engine.jobs import BatchResult, JobSummary, V1Job, take

        class Engine(base):
            stops = 0

            def _run(self, job, emit, stop):
                if isinstance(job, V1Job):
                    self.v1_compute(job.params, job.block_hash, job.dtype)  # as the ranks: the model for the job
                queues = {"A": [], "B": []}
                n = 0

                def deal(r):
                    nonces = take(job.nonces, job.batch_size)
                    if nonces:
                        queues[r].append(nonces)

                def report(nonces):
                    nonlocal n
                    n += 1
                    if isinstance(job, V1Job):
                        out = {"dist": np.zeros(len(nonces))}
                    else:
                        out = {"artifacts": [{"nonce": x, "vector_b64": ""} for x in nonces]}
                    emit(BatchResult(index=n, nonces=nonces, elapsed=0.0, batch_seconds=0.0, **out))

                for _ in range(2):
                    deal("A")
                    deal("B")
                while True:
                    if stop.is_set():
                        Engine.stops += 1
                        for r in ("BA" if Engine.stops % 2 else "AB"):  # launched: reported; queued: dropped
                            if queues[r]:
                                report(queues[r][0])
                        return JobSummary("stopped", n, 0, 0.0)
                    r = "B" if queues["B"] else "A"
                    if not queues[r]:
                        return JobSummary("exhausted", n, 0, 0.0)
                    report(queues[r].pop(0))
                    deal(r)
                    time.sleep(0.005)

        return Engine


class ReversedArrivalEngine:
    """The real engine's numbers, delivered as replicas may deliver them: every batch of a job is computed, then
    emitted in reverse dealing order (the last batch first), renumbered by arrival."""

    @staticmethod
    def make(base):
        import dataclasses

        class Engine(base):
            def _run(self, job, emit, stop):
                held = []
                summary = super()._run(job, held.append, stop)
                for i, b in enumerate(reversed(held), 1):
                    emit(dataclasses.replace(b, index=i))
                return summary

        return Engine
