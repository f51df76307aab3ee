"""What the route modules share: the app's typed keys and `admit()`, the one gate before a job starts.

`admit(app, owner, v1=..., v2=...)` checks, in this order and before any response starts: the engine is ready
(503 while loading or broken), the job fits the devices' free memory (422, the engine's estimate), and the device
is free (409: the engine's lock, claimed for the job). `wait_claim` is the same lock for the background queue,
awaited on the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Callable

from aiohttp import web

from poc.clients.callbacks import CallbackSender
from poc.engine.base import Claim, EngineBase
from poc.hub import hide_cache
from poc.errors import InputError
from poc.protocol import v1
from poc.server.config import config_key
from poc.server.metrics import Metrics
from poc.server.schemas import ServedModel
from poc.server.stream import JobRunner

engine_key = web.AppKey("engine", EngineBase)
metrics_key = web.AppKey("metrics", Metrics)
runners_key = web.AppKey("runners", set)  # the JobRunners in flight (for /health and shutdown)
sender_key = web.AppKey("callbacks", CallbackSender)
listening_key = web.AppKey("listening", asyncio.Event)
tasks_key = web.AppKey("tasks", dict)  # background tasks by name
freed_key = web.AppKey("freed", asyncio.Event)  # set on the loop whenever the engine's device lock is released
enders_key = web.AppKey("enders", list)  # track_streams' enders: each ends one route's sessions (end_sessions)

log = logging.getLogger("poc.server")


def track_streams(app: web.Application, key: web.AppKey, end: Callable[[object, str], None]) -> None:
    """app[key]: a route's open sessions (the route adds and discards them). Each one is end(s, reason)ed on
    shutdown ("shutdown") and by every stop (end_sessions: "stopped"), also while it only waits for work."""
    app[key] = set()
    app.setdefault(enders_key, []).append(lambda reason: [end(s, reason) for s in list(app[key])])

    async def on_shutdown(app: web.Application) -> None:
        for s in list(app[key]):
            end(s, "shutdown")

    app.on_shutdown.append(on_shutdown)


def end_sessions(app: web.Application, reason: str = "stopped") -> None:
    """End every tracked session (/pooled, /warmup), whether it holds the device or waits for work."""
    for end in app.get(enders_key, ()):
        end(reason)


def require_ready(app: web.Application) -> None:
    """503 while the checkpoint loads or after the engine broke."""
    engine = app[engine_key]
    if engine.state == "loading":
        raise InputError("the model is still loading: retry when GET /health says ready", None, status=503)
    if engine.state == "broken":
        raise InputError(f"the engine is broken ({hide_cache(engine.broken_reason or '')}): restart the server, or "
                         "load a model with POST /api/v1/inference/up", None, status=503)


def check_v1_memory(app: web.Application, params: v1.V1Params, batch_size: int, dtype: str) -> None:
    app[engine_key].check_v1_memory(params, batch_size, dtype, headroom=app[config_key].memory_headroom)


def check_v2_memory(app: web.Application, batch_size: int, seq_len: int) -> None:
    app[engine_key].check_v2_memory(batch_size, seq_len, headroom=app[config_key].memory_headroom)


def default_v2_batch(app: web.Application, seq_len: int) -> int:
    """The batch size of a v2 request that gives none: the engine's rule for the loaded model and layout
    (EngineBase.default_v2_batch), within max_batch_size and the memory headroom."""
    cfg = app[config_key]
    b = app[engine_key].default_v2_batch(seq_len, cfg.memory_headroom, cfg.max_batch_size)
    log.info("no batch_size in the request: batch %d for seq_len %d (the served model's default)", b, seq_len)
    return b


def claim_device(app: web.Application, owner: str) -> Claim:
    """The device for one job, or 409 at once (before any response is started)."""
    c = app[engine_key].try_claim(owner)
    if c is None:
        raise InputError("busy: a job is already running", None, status=409)
    return c


def admission(app: web.Application, *, v1: tuple | None = None, v2: tuple | None = None) -> None:
    """Whether a job may start, short of the device: readiness, then the memory estimate of the job (v1=(params,
    batch_size, dtype) or v2=(batch_size, seq_len)): 503 or 422 before anything starts. The routes that claim the
    device at once call admit(); the PoC service claims it its own way (a queued job steps aside)."""
    require_ready(app)
    if v1 is not None:
        check_v1_memory(app, *v1)
    if v2 is not None:
        check_v2_memory(app, *v2)


def admit(app: web.Application, owner: str, *, v1: tuple | None = None, v2: tuple | None = None) -> Claim:
    """admission(), then the device claim: 503, 422 or 409 before anything starts."""
    admission(app, v1=v1, v2=v2)
    return claim_device(app, owner)


def watch_releases(app: web.Application) -> None:
    """Wake wait_claim() on every release of the engine's lock, from whichever thread released it."""
    loop, freed = asyncio.get_running_loop(), app[freed_key]

    def on_release() -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is waiting
            loop.call_soon_threadsafe(freed.set)

    app[engine_key].lock.on_release(on_release)


async def wait_claim(app: web.Application, owner: str) -> Claim:
    """Wait for the device without blocking the loop (the background queue; requests get a 409 instead)."""
    engine, freed = app[engine_key], app[freed_key]
    while True:
        c = engine.try_claim(owner)
        if c is not None:
            return c
        freed.clear()
        await freed.wait()


def new_runner(app: web.Application, job, claim: Claim, label: str, borrowed: bool = False) -> JobRunner:
    """A JobRunner for `job` on the engine under `claim` (`borrowed`: the caller keeps it and releases it)."""
    cfg = app[config_key]
    return JobRunner(app[engine_key], job, claim, label=label, metrics=app[metrics_key], registry=app[runners_key],
                     progress_interval=cfg.progress_interval, rate_log_interval=cfg.rate_log_interval,
                     max_waiting=cfg.stream_max_waiting, borrowed=borrowed)


def served_model(app: web.Application) -> ServedModel | None:
    """The loaded checkpoint's names; --served-model-name names the --model one only (POST /api/v1/inference/up
    may have loaded another from the Hugging Face cache: its repo id names it)."""
    engine = app[engine_key]
    if engine.v2 is None:
        return None
    cfg = app[config_key]
    names = cfg.served_model_name if engine.model_dir == cfg.model else ()
    return ServedModel.of(engine.model_dir, engine.v2.cfg, names)


def model_label(app: web.Application) -> str | None:
    """The served model as /v1/models names it (its first id: the served name, else the Hub repo id); None while no
    checkpoint is loaded (v1 only, loading, or a load that failed)."""
    served = served_model(app)
    return served.ids[0] if served is not None else None
