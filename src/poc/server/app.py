"""create_app(config): the aiohttp application, its typed keys, and the engine's life cycle.

Start-up (cleanup_ctx) starts the callback sender and loads the --model checkpoint on a thread (GET /health
says "loading" meanwhile), then logs the one readiness line once the model is loaded and the socket listens.
Shutdown (SIGTERM) stops every job: open streams end with {"status": "done", "reason": "shutdown"}, queued
callbacks get a few seconds to go out, and the engine closes.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import torch
from aiohttp import web

from poc.clients.callbacks import CallbackSender
from poc.engine import memory
from poc.engine.compute import DTYPE_NAMES
from poc.engine.engine import Engine
from poc.errors import InputError
from poc.logs import describe
from poc.server.config import ServerConfig
from poc.server.metrics import Metrics
from poc.server.schemas import ServedModel
from poc.server.stream import Claim, DeviceGate, JobRunner

log = logging.getLogger("poc.server")

config_key = web.AppKey("config", ServerConfig)
engine_key = web.AppKey("engine", Engine)
gate_key = web.AppKey("gate", DeviceGate)
metrics_key = web.AppKey("metrics", Metrics)
runners_key = web.AppKey("runners", set)  # the JobRunners in flight (for /health and shutdown)
sender_key = web.AppKey("callbacks", CallbackSender)
listening_key = web.AppKey("listening", asyncio.Event)
tasks_key = web.AppKey("tasks", dict)  # background tasks by name


def _make_engine(config: ServerConfig):
    """One device in this process (Engine), or rank processes over torch.distributed when the config asks for
    tensor/pipeline parallelism or several replicas (poc.parallel, imported only then)."""
    if config.tp * config.pp > 1 or config.replicas != 1:
        from poc.parallel.engine import make_engine

        return make_engine(config.device, config.model, config.dtype, tp=config.tp, pp=config.pp,
                           replicas=config.replicas or None, compile=config.compile,
                           fp8_experts=config.fp8_experts)
    return Engine(device=config.device, model_dir=config.model, dtype=config.dtype, compile=config.compile,
                  fp8_experts=config.fp8_experts)


def create_app(config: ServerConfig) -> web.Application:
    """The only way to get an app. Raises InputError for an unusable config (e.g. --device cuda without CUDA)."""
    from poc.server import pooled, pow, vast, warmup

    engine = _make_engine(config)
    metrics = Metrics()
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware])
    app[config_key] = config
    app[engine_key] = engine
    app[gate_key] = DeviceGate()
    app[metrics_key] = metrics
    app[runners_key] = set()
    app[sender_key] = CallbackSender(timeout=config.callback_timeout, max_pending=config.callback_max_pending,
                                     backoff_base=config.callback_backoff, metrics=metrics,
                                     backoff_max=config.callback_backoff_max, spool_dir=config.spool_dir,
                                     segment_records=config.spool_segment_records,
                                     refusal_limit=config.callback_refusal_limit)
    app[listening_key] = asyncio.Event()
    app[tasks_key] = {}
    vast.setup(app)
    pow.setup(app)
    pooled.setup(app)
    warmup.setup(app)
    app.cleanup_ctx.append(engine_ctx)
    app.on_shutdown.append(on_shutdown)
    return app


def mark_listening(app: web.Application) -> None:
    """Called once the socket is bound (model_server.py passes it as run_app's print hook)."""
    app[listening_key].set()


# --------------------------------------------------------------------------------------------------
# life cycle


async def engine_ctx(app: web.Application):
    tasks = app[tasks_key]
    await app[sender_key].start()
    tasks["load"] = asyncio.create_task(_load(app), name="load")
    tasks["announce"] = asyncio.create_task(_announce(app, tasks["load"]), name="announce")
    yield
    tasks["announce"].cancel()
    for name, t in list(tasks.items()):
        if name not in ("load", "announce"):
            t.cancel()
    await asyncio.gather(*(t for n, t in tasks.items() if n != "load"), return_exceptions=True)
    await tasks["load"]  # a load in progress cannot be interrupted; let its thread finish before closing
    await app[sender_key].close(app[config_key].shutdown_flush_seconds)
    app[engine_key].close()


async def _load(app: web.Application) -> None:
    engine = app[engine_key]
    engine.state = "loading"  # GPU routes answer 503 until the model is loaded and torch is warm
    if engine.model_dir:
        log.info("loading %s on %s", engine.model_dir, engine.device)
    claim = app[gate_key].try_claim("load and warm-up")  # free at start; keeps jobs off the engine meanwhile
    try:
        await asyncio.to_thread(engine.load)  # also warms torch up: the first request does not pay for it
    except Exception as e:
        engine.broken_reason = f"model load failed: {type(e).__name__}: {e}"
        engine.state = "broken"
        app[metrics_key].error("model_load")
        log.warning("model load failed %s; /health reports broken", describe(e))
        return
    finally:
        claim.release()
    engine.state = "ready"
    if engine.v2 is not None:
        log.info("model %s loaded in %.1f s", engine.v2.name, engine.load_seconds)


async def _announce(app: web.Application, load: asyncio.Task) -> None:
    await asyncio.shield(load)  # cancelling this task must not cancel the load
    await app[listening_key].wait()
    engine = app[engine_key]
    if engine.state == "broken":
        return
    model = engine.v2.name if engine.v2 else "none (PoC v1 only)"
    cfg = app[config_key]
    log.info("Application startup complete. model=%s device=%s listening on %s:%d", model, engine.device, cfg.host,
             cfg.port)


async def on_shutdown(app: web.Application) -> None:
    """Runs after the listening socket closed and before aiohttp waits for open handlers."""
    n = len(app[runners_key])
    if n:
        log.info("shutdown: stopping %d job(s)", n)
    for r in list(app[runners_key]):
        r.stop("shutdown")
    from poc.server.pow import pow_key

    await app[pow_key].shutdown()


# --------------------------------------------------------------------------------------------------
# helpers for the route modules


def new_runner(app: web.Application, job, claim: Claim, label: str) -> JobRunner:
    cfg = app[config_key]
    return JobRunner(app[engine_key], job, claim, label=label, metrics=app[metrics_key], registry=app[runners_key],
                     progress_interval=cfg.progress_interval, rate_log_interval=cfg.rate_log_interval)


def claim_device(app: web.Application, owner: str) -> Claim:
    """The device for one job, or 409 at once (before any response is started)."""
    c = app[gate_key].try_claim(owner)
    if c is None:
        raise InputError("busy: a job is already running", None, status=409)
    return c


def require_ready(app: web.Application) -> None:
    """503 while the checkpoint loads or after the engine broke."""
    engine = app[engine_key]
    if engine.state == "loading":
        raise InputError("the model is still loading: retry when GET /health says ready", None, status=503)
    if engine.state == "broken":
        raise InputError(f"the engine is broken ({engine.broken_reason}): restart the server", None, status=503)


def served_model(app: web.Application) -> ServedModel | None:
    engine = app[engine_key]
    if engine.v2 is None:
        return None
    cfg = app[config_key]
    return ServedModel.of(cfg.model, engine.v2.cfg, cfg.served_model_name)


def _layout(engine) -> tuple[int, int, int]:
    """(tp, pp, ranks) of a multi-process engine (poc.parallel), (1, 1, 1) for one device."""
    L = getattr(engine, "layout", None)
    return (L.tp, L.pp, L.world) if L is not None else (1, 1, 1)


def _free(engine) -> int | None:
    """The ranks' own report of their GPUs' free memory (the server process does not hold their memory)."""
    free = getattr(engine, "free_bytes", None)
    return free() if callable(free) else None


def check_v1_memory(app: web.Application, params, batch_size: int, dtype: str) -> None:
    engine = app[engine_key]
    tp, pp, ranks = _layout(engine)
    held = 0
    cur = getattr(engine, "_v1", None)  # the cached v1 model is freed before the next one is built
    if cur is not None:
        held = memory.v1_weight_bytes(cur.params, DTYPE_NAMES[cur.dtype])[0]
    last = getattr(engine, "last_v1", None)  # the ranks' model: each frees its shard before the next build
    if last is not None:
        held = memory.v1_weight_bytes(last[0], last[1])[0] // (tp * pp)
    cuda = engine.device.type == "cuda"
    fused = cuda and getattr(engine, "compile_v1", False)
    est = memory.v1_estimate(params, batch_size, dtype, tp=tp, pp=pp, cuda=cuda, fused=fused)
    memory.check_fits(est, engine.device, reclaimable=held, headroom=app[config_key].memory_headroom,
                      field="params", free=_free(engine), ranks=ranks)


def check_v2_memory(app: web.Application, batch_size: int, seq_len: int) -> None:
    engine = app[engine_key]
    tp, _pp, ranks = _layout(engine)
    dtype = getattr(engine.v2, "dtype", None)  # the loaded model's (float32 on CPU by default)
    size = dtype.itemsize if isinstance(dtype, torch.dtype) else 4
    cuda = engine.device.type == "cuda"
    est = memory.v2_estimate(engine.v2.cfg, batch_size, seq_len, size, tp=tp, cuda=cuda,
                             fused=cuda and getattr(engine, "compile_v2", False))
    memory.check_fits(est, engine.device, headroom=app[config_key].memory_headroom, field="params.seq_len",
                      free=_free(engine), ranks=ranks)


# --------------------------------------------------------------------------------------------------
# errors: always JSON, never a traceback in the log


_ERROR_KIND = {400: "bad_input", 404: "not_found", 405: "bad_method", 409: "conflict", 413: "too_large",
               422: "does_not_fit", 429: "queue_full", 500: "job", 503: "unavailable"}


@web.middleware
async def error_middleware(request: web.Request, handler):
    metrics = request.app[metrics_key]
    try:
        return await handler(request)
    except InputError as e:
        metrics.error(_ERROR_KIND.get(e.status, "bad_input"))
        log.info("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
        return web.json_response(e.to_json(), status=e.status)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        metrics.error(_ERROR_KIND.get(e.status, "http"))
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return web.json_response({"error": e.reason, "field": None}, status=e.status, headers=headers)
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        metrics.error("internal")
        log.warning("%s %s failed %s", request.method, request.path, describe(e))
        return web.json_response({"error": str(e), "error_type": type(e).__name__, "field": None}, status=500)


def model_label(app: web.Application) -> str | None:
    engine = app[engine_key]
    if engine.v2 is not None:
        return engine.v2.name
    return Path(app[config_key].model).name if app[config_key].model else None
