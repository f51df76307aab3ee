"""The orchestrator's HTTP API (spec-v1 §4.3), async: registration, config polling, ready, heartbeat, shutdown.

Every call is JSON with a per-attempt timeout, and its answer is read up to a cap (clients/answers.py: 64 KiB for
connect, config and ready, which carry params; 4 KiB for heartbeat and shutdown); a longer one is a failed call. "With retry" calls (connect, ready, shutdown) try `retries` times,
sleeping retry_base, 2x, 4x ... between attempts (the reference: 5 tries, 1-2-4-8 s); the others try once. A
failure is a connection error, a timeout, an HTTP status >= 400 or a body that is not JSON. Results do not go
through here: they are records of the durable CallbackSender (kind "results" under `results_url`), so a slow or
failing orchestrator never holds up the compute loop or the command polls (spec-v1 §6 F14).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from poc.clients.answers import ACK_CAP, PARAMS_CAP, parse, read_capped
from poc.logs import describe

log = logging.getLogger("poc.orchestrator")
UNREACHABLE = "orchestrator unreachable"  # what a stream is told: the detail (refused, 404, ...) is only logged


@dataclass
class Reply:
    ok: bool
    data: Any = None  # the decoded JSON (any type) when ok
    error: str = ""


class OrchestratorClient:
    def __init__(self, base_url: str, worker_id: str, *, timeout: float = 10.0, retries: int = 5,
                 retry_base: float = 1.0, policy=None):
        self.base = base_url.rstrip("/")
        self.worker_id = worker_id
        self.timeout, self.retries, self.retry_base = timeout, retries, retry_base
        self._session: aiohttp.ClientSession | None = None
        self.policy = policy  # a clients.urlpolicy.UrlPolicy every connection obeys

    @property
    def worker_url(self) -> str:
        """What the result records are posted under: {worker_url}/results and {worker_url}/results/batch."""
        return f"{self.base}/api/workers/{self.worker_id}"

    async def __aenter__(self) -> "OrchestratorClient":
        self._session = (self.policy.session(self.timeout) if self.policy else
                         aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout)))
        return self

    async def __aexit__(self, *exc) -> None:
        await self._session.close()

    # ---------------------------------------------------------------------------------------- calls

    # connect, config and ready answers carry the assignment (a params object among it); heartbeat and shutdown
    # answers are only acknowledgements
    async def connect(self, gpu_count: int, gpu_info: list) -> Reply:
        return await self._call("POST", "/api/workers/connect",
                                {"worker_id": self.worker_id, "gpu_count": gpu_count, "gpu_info": gpu_info}, True,
                                PARAMS_CAP)

    async def config(self) -> Reply:
        return await self._call("GET", f"/api/workers/{self.worker_id}/config", None, False, PARAMS_CAP)

    async def ready(self, gpu_count: int) -> Reply:
        return await self._call("POST", f"/api/workers/{self.worker_id}/ready", {"gpu_count": gpu_count}, True,
                                PARAMS_CAP)

    async def heartbeat(self, pending_results: int, **extra) -> Reply:
        return await self._call("POST", f"/api/workers/{self.worker_id}/heartbeat",
                                {"pending_results": pending_results, **extra}, False, ACK_CAP)

    async def shutdown(self, stats: dict, retry: bool = True) -> Reply:
        return await self._call("POST", f"/api/workers/{self.worker_id}/shutdown", {"stats": stats}, retry, ACK_CAP)

    async def _call(self, method: str, path: str, body, retry: bool, cap: int) -> Reply:
        tries = self.retries if retry else 1
        r = Reply(False, error="not tried")
        for attempt in range(1, tries + 1):
            r = await self._once(method, path, body, cap)
            if r.ok:
                return r
            if attempt < tries:
                delay = self.retry_base * 2 ** (attempt - 1)
                log.info("orchestrator %s %s failed (attempt %d/%d: %s); retrying in %.1f s", method, path, attempt,
                         tries, r.error, delay)
                await asyncio.sleep(delay)
        return r

    async def _once(self, method: str, path: str, body, cap: int) -> Reply:
        try:
            async with self._session.request(method, self.base + path, json=body) as resp:
                if resp.status >= 300:  # the body is not read: nothing in it changes the outcome
                    log.info("orchestrator %s %s: HTTP %d", method, path, resp.status)
                    return Reply(False, error=UNREACHABLE)
                raw = await read_capped(resp, cap)
                try:
                    return Reply(True, parse(raw))
                except ValueError:
                    log.info("orchestrator %s %s: HTTP %d with a body that is not JSON", method, path, resp.status)
                    return Reply(False, error=UNREACHABLE)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.info("orchestrator %s %s failed %s", method, path, describe(e))
            return Reply(False, error=UNREACHABLE)
