"""The served model, as a Gonka node checks and redeploys it: the inference side of an MLNode (vLLM's routes) and
the MLNode's model routes, on the same port as everything else.

    GET  /v1/models                 the OpenAI list {"object": "list", "data": [{"id", ...}]}: the served names
                                    (--served-model-name first), else the Hub repo id, else the --model as given
    GET  /readyz                    {"ready"}: 200 when a job could start now, else 503
    POST /api/v1/inference/up       {model, dtype, additional_args}: serve that Hub repo id from the local cache
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
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from poc import dtypes, hub
from poc.errors import InputError
from poc.logs import describe
from poc.server import schemas
from poc.server.config import DTYPE_CHOICES
from poc.server.context import config_key, engine_key, metrics_key, served_model, tasks_key, wait_claim
from poc.server.pow_service import stop_every_job

log = logging.getLogger("poc.models")

CLAIM_TIMEOUT = 120.0  # seconds for the stopped jobs to free the device before a redeploy gives up (503)


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    app.add_routes(routes)


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


@routes.post("/api/v1/inference/up")
async def inference_up(request: web.Request) -> web.Response:
    app = request.app
    engine = app[engine_key]
    body = await schemas.read_json(request, app[config_key].max_body_bytes)
    model = hub.check_repo_id(body.get("model"))
    dtype = body.get("dtype") or "auto"
    if dtype not in DTYPE_CHOICES:
        raise InputError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r:.40}", "dtype")
    args = body.get("additional_args")
    if args is not None and (not isinstance(args, list) or not all(isinstance(a, str) for a in args)):
        raise InputError("additional_args must be a list of strings", "additional_args")
    if engine.state == "loading":
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
                             f"`hf download {model}` there first)", "model", status=409)
        if status == "PARTIAL":
            raise InputError(f"model {model} is only partly in {hub.CACHE_NAME} (config.json or safetensors files "
                             "missing): download it again", "model", status=409)
    try:
        await asyncio.to_thread(engine.preflight, path)
    except InputError as e:
        raise InputError(f"model {model} cannot be served here: {hub.hide_cache(e.message)}", "model",
                         status=409) from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # an unreadable or malformed config.json
        raise InputError(f"model {model} cannot be served here: its config does not read "
                         f"({hub.hide_cache(describe(e))})", "model", status=409) from None
    if engine.state == "loading":  # another redeploy began while this one looked in the cache
        raise InputError("a model is loading: retry when GET /health says ready", None, status=409)
    if args:
        log.info("inference/up %s: additional_args not applied here: %s", model, " ".join(args)[:500])
    prior = engine.broken_reason  # a failed load before this one: said again if this one cannot start
    engine.clear_broken()
    engine.start_loading()  # from here /health says loading and no job starts
    task = asyncio.create_task(_switch(app, model, path, want, prior), name=f"inference-up {model}")
    app[tasks_key]["load"] = task  # shutdown waits for it, as for the start-up load
    outcome = await asyncio.shield(task)  # a client that goes away does not interrupt a load half done
    if outcome == "failed":
        raise InputError(f"model {model} failed to load: {hub.hide_cache(engine.broken_reason or '')}", "model",
                         status=503)
    if outcome == "busy":
        raise InputError(f"the device did not come free within {CLAIM_TIMEOUT:.0f} s after stopping every job: "
                         "nothing changed", None, status=503)
    return web.json_response({"status": "OK", "model": model, "loaded": True})


def dtypes_equal(torch_dtype, name: str) -> bool:
    return str(torch_dtype).removeprefix("torch.") == name and name in dtypes.NAMES


async def _switch(app: web.Application, model: str, path: str, dtype: str | None, prior: str | None) -> str:
    """Stop every job, take the device, unload the old checkpoint and load `path` (engine.switch_model):
    "loaded", "failed" (the engine is broken with the reason) or "busy" (the device never came free: unchanged)."""
    engine = app[engine_key]
    old = served_model(app)
    old_name = old.ids[0] if old else "no model"
    await stop_every_job(app, f"POST /api/v1/inference/up {model}")
    try:
        claim = await asyncio.wait_for(wait_claim(app, f"inference/up {model}"), CLAIM_TIMEOUT)
    except asyncio.TimeoutError:
        log.warning("inference/up %s: the device did not come free within %.0f s; %s stays", model, CLAIM_TIMEOUT,
                    old_name)
        engine.loaded()
        if prior:
            engine.mark_broken(prior)
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


# --------------------------------------------------------------------------------------------------
# the model cache (the MLNode's /api/v1/models routes, read-only here)


def _model_arg(body: dict) -> dict:
    """The MLNode's Model {hf_repo, hf_commit}, checked (a Hub repo id; a commit hash or branch name, or null)."""
    repo = hub.check_repo_id(body.get("hf_repo"), "hf_repo")
    return {"hf_repo": repo, "hf_commit": hub.check_revision(body.get("hf_commit"))}


async def _model_body(request: web.Request) -> dict:
    if request.method == "GET":
        return _model_arg(dict(request.query))
    return _model_arg(await schemas.read_json(request, request.app[config_key].max_body_bytes))


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
