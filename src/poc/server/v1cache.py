"""The PoC v1 model a job leaves on the device is a cache: the next job with the same params, block hash and dtype
(the rest of a PoC stage: more generation, then validation) reuses it instead of building it again (MainNet params:
~6 s on an H100). It holds the model's weights (memory.v1_weight_bytes: 35.5 GB in fp16 for MainNet, spread over the
ranks of a multi-GPU layout), so it is dropped once the device has had no job for `v1_cache_idle` seconds
(POC_V1_CACHE_IDLE, 300 by default; 0 keeps it until the next v1 model replaces it)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time

from aiohttp import web

from poc.engine import memory
from poc.server.context import config_key, engine_key

log = logging.getLogger("poc.server")


async def release_when_idle(app: web.Application) -> None:
    """Runs for the life of the app (engine_ctx): drops the engine's v1 model after `v1_cache_idle` s without a job,
    under a claim of its own, so no job can start meanwhile."""
    idle = app[config_key].v1_cache_idle
    if not idle:
        return
    engine = app[engine_key]
    last_release = [time.monotonic()]  # when the device was last given back (any thread)
    engine.lock.on_release(lambda: last_release.__setitem__(0, time.monotonic()))
    step = min(idle / 4, 30.0)
    while True:
        await asyncio.sleep(step)
        if engine.busy or engine.state != "ready" or not engine.v1_held_bytes():
            continue
        if time.monotonic() - last_release[0] < idle:
            continue
        claim = engine.try_claim("v1 cache release")
        if claim is None:
            continue
        try:
            freed = await asyncio.to_thread(release_and_trim, engine)
        finally:
            claim.release()
        log.info("v1 model released after %.0f s without a job (%.2f GB a device)", idle, freed / 1e9)


def release_and_trim(engine) -> int:
    """engine.release_v1, a full collection, then the heap trimmed. The job that used the model leaves it in
    reference cycles (its thread's frames), which only the cyclic collector frees, and an idle server allocates too
    little to run it: a 0.8 GB model stayed resident after its release (RSS +0.83 GB) until the next job."""
    freed = engine.release_v1()
    gc.collect()
    memory.trim_heap()  # what was freed in small blocks, from the build threads' arenas too
    return freed
