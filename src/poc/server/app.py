"""create_app(config): the aiohttp application (the keys it sets are in context.py), and the engine's life cycle.

Start-up (cleanup_ctx) starts the callback sender and loads the --model checkpoint on a thread (GET /health
says "loading" meanwhile), then logs the one readiness line once the model is loaded and the socket listens.
Shutdown (SIGTERM) stops every job: open streams end with {"status": "done", "reason": "shutdown"}, queued
callbacks get a few seconds to go out, and the engine closes.
"""

from __future__ import annotations

import asyncio
import gc
import logging

from aiohttp import web

from poc.clients.callbacks import CallbackSender
from poc.engine import factory
from poc.errors import InputError
from poc.logs import describe
from poc.server import gpu, mlnode, models, pooled, pow, security, v1cache, vast, warmup
from poc.server.config import ServerConfig
from poc.server.context import (config_key, engine_key, freed_key, listening_key, metrics_key, runners_key,
                                sender_key, tasks_key, watch_releases)
from poc.server.metrics import Metrics
from poc.server.pow_service import pow_key

log = logging.getLogger("poc.server")


def create_app(config: ServerConfig) -> web.Application:
    """The only way to get an app. Raises InputError for an unusable config (e.g. --device cuda without CUDA)."""
    engine = factory.make_engine(config.device, config.model, config.dtype, tp=config.tp, pp=config.pp,
                                 replicas=config.replicas, layout=config.layout, compile=config.compile,
                                 options=config.options, diagnostics=config.diagnostics)
    metrics = Metrics()
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[error_middleware],
                          handler_args=security.handler_args(config))
    security.setup(app, config)  # the guard middleware (cap, Origin, body deadlines, auth) and the outbound-URL policy
    app[config_key] = config
    app[engine_key] = engine
    app[freed_key] = asyncio.Event()
    app[metrics_key] = metrics
    app[runners_key] = set()
    app[sender_key] = CallbackSender(timeout=config.callback_timeout, max_pending=config.callback_max_pending,
                                     backoff_base=config.callback_backoff, metrics=metrics,
                                     backoff_max=config.callback_backoff_max, spool_dir=config.spool_dir,
                                     segment_records=config.spool_segment_records,
                                     refusal_limit=config.callback_refusal_limit,
                                     max_pending_total=config.callback_max_pending_total,
                                     max_post_bytes=config.callback_max_post_bytes,
                                     lifetime=config.callback_lifetime)
    app[sender_key].policy = security.url_policy(app)
    app[listening_key] = asyncio.Event()
    app[tasks_key] = {}
    vast.setup(app)
    pow.setup(app)
    mlnode.setup(app)  # the MLNode's routes, on top of /api/v1/pow
    models.setup(app)  # the inference side a node checks (/v1/models), redeploys (/api/v1/inference/up), the cache
    gpu.setup(app)
    pooled.setup(app)
    warmup.setup(app)
    from poc.server.scrape import AppCollector

    metrics.registry.register(AppCollector(app))  # queue depths and build info, read at scrape time
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
    watch_releases(app)
    tasks["load"] = asyncio.create_task(_load(app), name="load")
    cfg = app[config_key]
    if cfg.model:  # GET /api/v1/inference/up/status follows it as it follows a redeploy
        models.note_load(app, (cfg.served_model_name or (cfg.model,))[0], tasks["load"])
    tasks["announce"] = asyncio.create_task(_announce(app, tasks["load"]), name="announce")
    tasks["v1_cache"] = asyncio.create_task(v1cache.release_when_idle(app), name="v1_cache")  # POC_V1_CACHE_IDLE
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
    engine.start_loading()  # GPU routes answer 503 until the model is loaded and torch is warm
    if engine.model_dir:
        log.info("loading %s on %s", engine.model_dir, engine.device)
    claim = engine.try_claim("load and warm-up")  # free at start; keeps jobs off the engine meanwhile
    try:
        await asyncio.to_thread(engine.load)  # also warms torch up: the first request does not pay for it
        shapes = app[config_key].compile_at_start
        if shapes:  # the expected shapes compiled before the readiness line (warm_start.py; jobs get 409 meanwhile)
            from poc.server import warm_start

            await asyncio.to_thread(warm_start.run, engine, shapes, claim)  # under the start-up claim
    except Exception as e:  # the engine marked itself broken (a failed warm-up is only a warning: warm_start.run)
        app[metrics_key].error("model_load")
        log.warning("model load failed %s; /health reports broken", describe(e))
        return
    finally:
        claim.release()
        gc.freeze()  # what start-up made lives as long as the process: full collections no longer walk it (bigjson.py)
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
    await app[pow_key].shutdown()


# --------------------------------------------------------------------------------------------------
# errors: always JSON, never a traceback in the log


_ERROR_KIND = {400: "bad_input", 401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "bad_method",
               408: "body_timeout", 409: "conflict", 413: "too_large", 422: "does_not_fit", 429: "queue_full",
               500: "job", 503: "unavailable"}


@web.middleware
async def error_middleware(request: web.Request, handler):
    metrics = request.config_dict[metrics_key]  # a sub-application (/api/v1/pow) finds the root app's
    try:
        return await handler(request)
    except InputError as e:
        metrics.error(_ERROR_KIND.get(e.status, "bad_input"))
        log.info("%s %s -> %d: %s", request.method, request.path, e.status, e.message)
        return _closing_if_unread(request, web.json_response(e.to_json(), status=e.status))
    except web.HTTPException as e:
        if e.status < 400:
            raise
        metrics.error(_ERROR_KIND.get(e.status, "http"))
        headers = {k: v for k, v in e.headers.items() if k.lower() == "allow"}
        return _closing_if_unread(request, web.json_response({"error": e.reason, "field": None}, status=e.status,
                                                             headers=headers))
    except (asyncio.CancelledError, ConnectionError):
        raise
    except Exception as e:
        metrics.error("internal")
        log.warning("%s %s failed %s", request.method, request.path, describe(e))
        return web.json_response({"error": str(e), "error_type": type(e).__name__, "field": None}, status=500)


def _closing_if_unread(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """An error answered before the request body was read (a 413 over the size limit, a 408): the rest of the body
    is still on the socket, so the server will not keep this connection. Say so (Connection: close), or a client
    that reuses it for its next request meets a reset."""
    if request.body_exists and not request.content.is_eof():
        resp.force_close()
    return resp
