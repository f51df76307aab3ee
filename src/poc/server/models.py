"""The served model, as a Gonka node checks and redeploys it: the inference side of an MLNode (vLLM's routes) and
the MLNode's model routes, on the same port as everything else.

    GET  /v1/models                 the OpenAI list {"object": "list", "data": [{"id", ...}]}: the served names
                                    (--served-model-name first), else the Hub repo id, else the --model as given
    GET  /readyz                    {"ready"}: 200 when a job could start now, else 503
    POST /api/v1/inference/up       {model, dtype, additional_args}: serve that Hub repo id from the local cache
    POST /api/v1/inference/up/async the same, answered as soon as the load has begun
    GET  /api/v1/inference/up/status the last load as the MLNode's StartupStatus {status, is_starting, is_running, ...}
    POST /api/v1/inference/down     stop every job and unload: serve no model (PoC v1 only)
    POST /api/v1/models/status      {hf_repo, hf_commit} -> DOWNLOADED | PARTIAL | NOT_FOUND in the local cache
    GET  /api/v1/models/status      the same, from ?hf_repo=&hf_commit=
    GET  /api/v1/models/list        every model revision in the local cache, with its status
    POST /api/v1/models/download    202 IGNORED: nothing is downloaded at run time (the MLNode's offline answer)

The node's broker (decentralized-api/broker/broker.go queryNodeStatus) marks a node FAILED, and redeploys it with
Stop() then InferenceUp(model), when its state is INFERENCE but GET {inference URL}/health fails or the first id of
GET {inference URL}/v1/models is not the epoch's model. /api/v1/inference/up answers as the MLNode's does once the
model is up: 200 {"status": "OK"} when that model is already served (a no-op); when the local Hugging Face cache
(HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub) holds another complete checkpoint under that repo
id and its config can be served here, every job is stopped (as /api/v1/stop), the old checkpoint is unloaded and the
new one loaded (GET /health says loading, PoC routes answer 503 meanwhile), then 200; a failed load answers 503 with
the reason and leaves the server serving no model (/health 503 broken with that reason) until another
/api/v1/inference/up loads one. A repo id not in the cache, or incomplete there, or a config that cannot be served is
a 409 that changes nothing; a model that is not a Hub repo id (a path, "..", an absolute or URL form) is a 400.
`dtype` "auto" keeps --dtype; `additional_args` (vLLM flags) are logged and not applied.

The MLNode's own deploy routes (mlnode/packages/api/src/api/inference/routes.py; its validation tool deploys with
/up/async and polls /up/status until is_running) take the same request: /up/async answers at once, one load runs at
a time (409), and /down leaves the server serving no model, as one started without --model. A load cannot be
interrupted (the MLNode cancels its vLLM start): a down waits for it, then unloads.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from aiohttp import web

from poc import dtypes, hub
from poc.engine.base import Claim
from poc.errors import InputError
from poc.logs import describe
from poc.server import fields
from poc.server.config import DTYPE_CHOICES
from poc.server.context import config_key, engine_key, metrics_key, served_model, tasks_key, wait_claim
from poc.server.pow_service import stop_every_job

log = logging.getLogger("poc.models")

CLAIM_TIMEOUT = 120.0  # seconds for the stopped jobs to free the device before a redeploy gives up (503)
BUSY = f"the device did not come free within {CLAIM_TIMEOUT:.0f} s after stopping every job: nothing changed"


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    app.add_routes(routes)
    app[deploy_key] = Deploy()


# --------------------------------------------------------------------------------------------------
# the inference side


def _unavailable(app: web.Application) -> InputError | None:
    engine = app[engine_key]
    if engine.state == "loading":
        return InputError("the model is loading: retry when GET /health says ready", None, status=503)
    if engine.state == "broken":
        return InputError(f"no model is served: {hub.hide_cache(engine.broken_reason or '')}", None, status=503)
    return None


@routes.get("/v1/models")
async def list_served(request: web.Request) -> web.Response:
    """vLLM's /v1/models: 503 while no checkpoint is up (vLLM does not answer then), [] when serving PoC v1 only."""
    app = request.app
    err = _unavailable(app)
    if err is not None:
        raise err
    served = served_model(app)
    engine = app[engine_key]
    now = int(time.time())
    data = [] if served is None else [
        {"id": i, "object": "model", "created": now, "owned_by": "poc-model-server", "root": engine.model_dir,
         "parent": None, "max_model_len": served.max_seq_len} for i in served.ids]
    return web.json_response({"object": "list", "data": data})


@routes.get("/readyz")
async def readyz(request: web.Request) -> web.Response:
    """The MLNode's readiness probe: ready unless a checkpoint is loading or the engine is broken."""
    ready = request.app[engine_key].state in ("ready", "busy")
    return web.json_response({"ready": ready}, status=200 if ready else 503)


async def _begin_up(request: web.Request, refused: int = 409) -> web.Response | tuple[str, asyncio.Task]:
    """What /api/v1/inference/up and /up/async share: the request checked (400; 409 while a load runs; `refused`
    for a model that cannot be loaded here; nothing changed), then the load started in the background: (model,
    its task), or the answer of a no-op (the model is served)."""
    app = request.app
    engine = app[engine_key]
    body = await fields.read_json(request, app[config_key].max_body_bytes)
    model = hub.check_repo_id(body.get("model"))
    dtype = body.get("dtype") or "auto"
    if dtype not in DTYPE_CHOICES:
        raise InputError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r:.40}", "dtype")
    args = body.get("additional_args")
    if args is not None and (not isinstance(args, list) or not all(isinstance(a, str) for a in args)):
        raise InputError("additional_args must be a list of strings", "additional_args")
    if loading(app):
        raise InputError("a model is loading: retry when GET /health says ready", None, status=409)
    want = None if dtype == "auto" else dtype
    served = served_model(app)
    if served is not None and model in served.names:
        if want is None or dtypes_equal(engine.v2.dtype, want):
            return web.json_response({"status": "OK", "model": model, "loaded": False})
        path = engine.model_dir  # the same checkpoint in another dtype
    else:
        status, path = await asyncio.to_thread(hub.cache_status, model)
        if status in ("NOT_FOUND", "PARTIAL"):  # the path for the operator's log; the caller reads no machine path
            log.info("inference/up %s: %s in %s", model, status, hub.hub_cache_dir())
        if status == "NOT_FOUND":
            raise InputError(f"model {model} is not in {hub.CACHE_NAME} (nothing is downloaded at run time: "
                             f"`hf download {model}` there first)", "model", status=refused)
        if status == "PARTIAL":
            raise InputError(f"model {model} is only partly in {hub.CACHE_NAME} (config.json or safetensors files "
                             "missing): download it again", "model", status=refused)
    try:
        await asyncio.to_thread(engine.preflight, path)
    except InputError as e:
        raise InputError(f"model {model} cannot be served here: {hub.hide_cache(e.message)}", "model",
                         status=refused) from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # an unreadable or malformed config.json
        raise InputError(f"model {model} cannot be served here: its config does not read "
                         f"({hub.hide_cache(describe(e))})", "model", status=refused) from None
    if loading(app):  # another redeploy began while this one looked in the cache
        raise InputError("a model is loading: retry when GET /health says ready", None, status=409)
    if args:
        log.info("inference/up %s: additional_args not applied here: %s", model, " ".join(args)[:500])
    prior = engine.broken_reason  # a failed load before this one: said again if this one cannot start
    engine.clear_broken()
    engine.start_loading()  # from here /health says loading and no job starts
    task = asyncio.create_task(_switch(app, model, path, want, prior), name=f"inference-up {model}")
    app[tasks_key]["load"] = task  # shutdown waits for it, as for the start-up load
    note_load(app, model, task)
    return model, task


@routes.post("/api/v1/inference/up")
async def inference_up(request: web.Request) -> web.Response:
    engine = request.app[engine_key]
    started = await _begin_up(request)
    if isinstance(started, web.Response):
        return started
    model, task = started
    outcome = await asyncio.shield(task)  # a client that goes away does not interrupt a load half done
    if outcome == "failed":
        raise InputError(f"model {model} failed to load: {hub.hide_cache(engine.broken_reason or '')}", "model",
                         status=503)
    if outcome == "busy":
        raise InputError(BUSY, None, status=503)
    return web.json_response({"status": "OK", "model": model, "loaded": True})


@routes.post("/api/v1/inference/up/async")
async def inference_up_async(request: web.Request) -> web.Response:
    """The MLNode's background deploy: /api/v1/inference/up's request and checks, answered as soon as the load has
    begun (GET /api/v1/inference/up/status follows it). A 409 means a load runs, as the MLNode's does (its
    validation tool then waits for it); a model that cannot be loaded here (not cached, or its config) is a 422,
    which stops the tool at once."""
    started = await _begin_up(request, refused=422)
    if isinstance(started, web.Response):
        return started
    model, _ = started
    return web.json_response({"status": "starting", "model": model,
                              "message": f"loading {model} in the background: GET /api/v1/inference/up/status "
                                         "says when it is running"})


@routes.get("/api/v1/inference/up/status")
async def inference_up_status(request: web.Request) -> web.Response:
    """The MLNode's StartupStatus {status, is_starting, is_running, elapsed_seconds, error} (+ "model") of the last
    load: not_started (none since the server started without --model, or since a down), in_progress, completed or
    failed; elapsed_seconds counts from the load's start (while it runs and after it completed, as the MLNode's)."""
    app = request.app
    engine, d = app[engine_key], app[deploy_key]
    running = engine.state in ("ready", "busy") and engine.v2 is not None
    body = {"status": "not_started", "is_starting": False, "is_running": running, "elapsed_seconds": None,
            "error": None, "model": d.model}
    if d.task is None:
        pass
    elif not d.task.done():
        body.update(status="in_progress", is_starting=True, is_running=False, elapsed_seconds=time.time() - d.started)
    elif d.error:
        body.update(status="failed", error=hub.hide_cache(d.error))  # as /health's reason: no machine path
    else:
        body.update(status="completed", elapsed_seconds=time.time() - d.started)
    return web.json_response(body)


@routes.post("/api/v1/inference/down")
async def inference_down(request: web.Request) -> web.Response:
    """The MLNode's down: every job stopped (as /api/v1/stop: what was computed is delivered) and the checkpoint
    unloaded; the server then serves no model, as one started without --model (PoC v1 only). A load in progress
    cannot be interrupted: the down waits for it, then unloads what it loaded. No body is read."""
    app = request.app
    engine = app[engine_key]
    while (t := app[tasks_key].get("load")) is not None and not t.done():
        await asyncio.shield(t)
    app[deploy_key].clear()  # no load to report from here (the MLNode's not_started)
    old = served_model(app)
    name = old.ids[0] if old else None
    prior = engine.broken_reason
    if engine.v2 is None and engine.model_dir is None and prior is None:
        await stop_every_job(app, "POST /api/v1/inference/down")
        return web.json_response({"status": "OK", "unloaded": None})
    engine.clear_broken()
    engine.start_loading()  # from here no job starts and a second deploy is a 409
    task = asyncio.create_task(_unload(app, name or engine.model_dir or "no model", prior), name="inference-down")
    app[tasks_key]["load"] = task  # shutdown waits for it
    outcome = await asyncio.shield(task)
    if outcome == "failed":
        raise InputError(f"unloading failed: {engine.broken_reason}", None, status=503)
    if outcome == "busy":
        raise InputError(BUSY, None, status=503)
    return web.json_response({"status": "OK", "unloaded": name})


def dtypes_equal(torch_dtype, name: str) -> bool:
    return str(torch_dtype).removeprefix("torch.") == name and name in dtypes.NAMES


async def _take_device(app: web.Application, what: str, prior: str | None) -> Claim | None:
    """Stop every job and take the device for a deploy change; None when it did not come free within
    CLAIM_TIMEOUT (the engine is then as it was: ready, or broken with `prior`)."""
    engine = app[engine_key]
    await stop_every_job(app, f"POST /api/v1/{what}")
    try:
        return await asyncio.wait_for(wait_claim(app, what), CLAIM_TIMEOUT)
    except asyncio.TimeoutError:
        old = served_model(app)
        log.warning("%s: the device did not come free within %.0f s; %s stays", what, CLAIM_TIMEOUT,
                    old.ids[0] if old else "no model")
        engine.loaded()
        if prior:
            engine.mark_broken(prior)
        return None


async def _switch(app: web.Application, model: str, path: str, dtype: str | None, prior: str | None) -> str:
    """Stop every job, take the device, unload the old checkpoint and load `path` (engine.switch_model):
    "loaded", "failed" (the engine is broken with the reason) or "busy" (the device never came free: unchanged)."""
    engine = app[engine_key]
    old = served_model(app)
    old_name = old.ids[0] if old else "no model"
    claim = await _take_device(app, f"inference/up {model}", prior)
    if claim is None:
        return "busy"
    try:
        log.info("inference/up: unloading %s, loading %s from %s", old_name, model, path)
        await asyncio.to_thread(engine.switch_model, path, dtype)
    except Exception as e:  # the engine is broken with the reason: /health and every PoC route say it
        app[metrics_key].error("model_load")
        log.warning("inference/up %s: model load failed %s; /health reports broken", model, describe(e))
        return "failed"
    finally:
        claim.release()
    log.info("model %s loaded in %.1f s", model, engine.load_seconds or 0.0)
    return "loaded"


async def _unload(app: web.Application, name: str, prior: str | None) -> str:
    """Stop every job, take the device and unload the checkpoint (engine.unload_model): "unloaded", "failed" (the
    engine is broken with the reason) or "busy" (the device never came free: unchanged)."""
    engine = app[engine_key]
    claim = await _take_device(app, "inference/down", prior)
    if claim is None:
        return "busy"
    try:
        log.info("inference/down: unloading %s", name)
        await asyncio.to_thread(engine.unload_model)
    except Exception as e:  # the engine is broken with the reason
        app[metrics_key].error("model_load")
        log.warning("inference/down: unloading %s failed %s; /health reports broken", name, describe(e))
        return "failed"
    finally:
        claim.release()
    log.info("inference/down: %s unloaded; serving no model", name)
    return "unloaded"


# --------------------------------------------------------------------------------------------------
# the last load, for GET /api/v1/inference/up/status


@dataclass
class Deploy:
    """The last load of a checkpoint: the start-up one, or one an inference/up began; none after a down."""

    model: str | None = None
    task: asyncio.Task | None = None
    started: float = 0.0  # time.time() when it began
    error: str | None = None  # why it failed, once it has

    def clear(self) -> None:
        self.model, self.task, self.started, self.error = None, None, 0.0, None


deploy_key = web.AppKey("deploy", Deploy)


def loading(app: web.Application) -> bool:
    """A checkpoint is being loaded or unloaded (or the start-up load, compile at start included, still runs)."""
    task = app[deploy_key].task
    return app[engine_key].state == "loading" or (task is not None and not task.done())


def note_load(app: web.Application, model: str, task: asyncio.Task) -> None:
    """Record a load that has begun; when it ends, whether it failed and why (the engine's reason)."""
    d, engine = app[deploy_key], app[engine_key]
    d.model, d.task, d.started, d.error = model, task, time.time(), None

    def ended(t: asyncio.Task) -> None:
        if d.task is not t:  # a down has cleared it, or a later load took its place
            return
        if t.cancelled():
            d.error = "the load was cancelled"
        elif engine.broken_reason:
            d.error = engine.broken_reason
        elif t.exception() is None and t.result() == "busy":
            d.error = BUSY

    task.add_done_callback(ended)


# --------------------------------------------------------------------------------------------------
# the model cache (the MLNode's /api/v1/models routes, read-only here)


def _model_arg(body: dict) -> dict:
    """The MLNode's Model {hf_repo, hf_commit}, checked (a Hub repo id; a commit hash or branch name, or null)."""
    repo = hub.check_repo_id(body.get("hf_repo"), "hf_repo")
    return {"hf_repo": repo, "hf_commit": hub.check_revision(body.get("hf_commit"))}


async def _model_body(request: web.Request) -> dict:
    if request.method == "GET":
        return _model_arg(dict(request.query))
    return _model_arg(await fields.read_json(request, request.app[config_key].max_body_bytes))


@routes.post("/api/v1/models/status")
@routes.get("/api/v1/models/status")
async def model_status(request: web.Request) -> web.Response:
    m = await _model_body(request)
    status, _ = await asyncio.to_thread(hub.cache_status, m["hf_repo"], m["hf_commit"])
    return web.json_response({"model": m, "status": status, "progress": None, "error_message": None})


@routes.get("/api/v1/models/list")
async def model_list(request: web.Request) -> web.Response:
    found = await asyncio.to_thread(hub.cached_models)
    return web.json_response({"models": [{"model": {"hf_repo": r, "hf_commit": c}, "status": s} for r, c, s in found]})


@routes.post("/api/v1/models/download")
async def model_download(request: web.Request) -> web.Response:
    """What the MLNode answers with HF_HUB_OFFLINE set: acknowledged, not done (no download at run time here)."""
    m = await _model_body(request)
    return web.json_response({"task_id": f"{m['hf_repo']}:{m['hf_commit'] or 'latest'}:offline", "status": "IGNORED",
                              "model": m}, status=202)
