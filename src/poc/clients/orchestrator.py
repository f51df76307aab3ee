"""The orchestrator's HTTP API (spec-v1 §4.3), async: registration, config polling, ready, heartbeat, shutdown.

Every call is JSON with a per-attempt timeout. "With retry" calls (connect, ready, shutdown) try `retries` times,
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

    async def connect(self, gpu_count: int, gpu_info: list) -> Reply:
        return await self._call("POST", "/api/workers/connect",
                                {"worker_id": self.worker_id, "gpu_count": gpu_count, "gpu_info": gpu_info}, True)

    async def config(self) -> Reply:
        return await self._call("GET", f"/api/workers/{self.worker_id}/config", None, False)

    async def ready(self, gpu_count: int) -> Reply:
        return await self._call("POST", f"/api/workers/{self.worker_id}/ready", {"gpu_count": gpu_count}, True)

    async def heartbeat(self, pending_results: int, **extra) -> Reply:
        return await self._call("POST", f"/api/workers/{self.worker_id}/heartbeat",
                                {"pending_results": pending_results, **extra}, False)

    async def shutdown(self, stats: dict, retry: bool = True) -> Reply:
        return await self._call("POST", f"/api/workers/{self.worker_id}/shutdown", {"stats": stats}, retry)

    async def _call(self, method: str, path: str, body, retry: bool) -> Reply:
        tries = self.retries if retry else 1
        r = Reply(False, error="not tried")
        for attempt in range(1, tries + 1):
            r = await self._once(method, path, body)
            if r.ok:
                return r
            if attempt < tries:
                delay = self.retry_base * 2 ** (attempt - 1)
                log.info("orchestrator %s %s failed (attempt %d/%d: %s); retrying in %.1f s", method, path, attempt,
                         tries, r.error, delay)
                await asyncio.sleep(delay)
        return r

    async def _once(self, method: str, path: str, body) -> Reply:
        try:
            async with self._session.request(method, self.base + path, json=body) as resp:
                raw = await resp.read()
                if resp.status >= 300:
                    log.info("orchestrator %s %s: HTTP %d", method, path, resp.status)
                    return Reply(False, error=UNREACHABLE)
                try:
                    return Reply(True, await resp.json(content_type=None) if raw.strip() else None)
                except ValueError:
                    log.info("orchestrator %s %s: HTTP %d with a body that is not JSON", method, path, resp.status)
                    return Reply(False, error=UNREACHABLE)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            log.info("orchestrator %s %s failed %s", method, path, describe(e))
            return Reply(False, error=UNREACHABLE)
