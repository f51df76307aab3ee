"""The Vast-style routes at the root: GET|POST /health, POST /generate (NDJSON), POST /validate, GET /metrics.

/generate speaks PoC v1 (spec-v1 §4.1: the batch line keys and order, `dist < r_target`) or PoC v2 (artifacts),
chosen by `params`. Unlike the reference it streams each batch as it is done, stops when the client goes, counts
every computed nonce (F9), uses the request's batch_size (F10), and adds progress and final "done" lines.
"""

from __future__ import annotations

import logging

from aiohttp import web

from poc.hub import hide_cache
from poc.logs import describe
from poc.server import fields, schemas
from poc.server.context import (admit, config_key, engine_key, metrics_key, model_label, new_runner, runners_key,
                                sender_key)
from poc.server.jobs import VALIDATE_BATCH_SIZE, admit_job, parse_generate, validate_v1
from poc.server.metrics import CONTENT_TYPE
from poc.server.stream import JobRunner, NdjsonWriter, json_text, pump

log = logging.getLogger("poc.server")
routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    app.add_routes(routes)


@routes.get("/health")
@routes.post("/health")  # the PyWorker's benchmark posts here
async def health(request: web.Request) -> web.Response:
    """`state` loading | ready | busy | broken, plus the model, the device and the running job; 503 unless ready/busy.

    `status` is the reference's field (spec-v1 §4.0: always "healthy" there): "healthy" with the 200, so a client
    written for the reference keeps working, and the state itself with a 503 (loading, broken)."""
    app = request.app
    engine = app[engine_key]
    state = engine.state
    runners = list(app[runners_key])
    ok = state in ("ready", "busy")
    body = {"status": "healthy" if ok else state, "state": state, "model": model_label(app), "device": str(engine.device),
            "cuda_broken": engine.state == "broken" and engine.device.type == "cuda",
            "job": (_job_json(runners[0]) if runners else None)}
    numerics = engine.v2_fp8()
    if numerics is not None:  # an FP8 checkpoint: which arithmetic (README: POC_FP8, POC_FP8_SCALES)
        body["fp8"] = numerics
    attention = engine.v2_attention()
    if attention is not None:  # the loaded model's attention recipe (README: --attention)
        body["attention"] = attention
    router = engine.v2_router()
    if router is not None:  # a sigmoid router's float32 GEMM (README: POC_ROUTER_GEMM)
        body["router"] = router
    if engine.state == "broken":
        body["reason"] = hide_cache(engine.broken_reason or "")  # the cache named, not its path
    sender = app[sender_key]
    if sender.spool is not None:  # a failing disk does not stop computing, but results are then not durable
        body["spool"] = {"ok": sender.spool_error is None, "error": sender.spool_error,
                         "memory_only": sender.memory_only, "pending": sender.pending}
    return web.json_response(body, status=200 if ok else 503)


def _job_json(r: JobRunner) -> dict:
    """The running job: `computed`/`valid` as /metrics counts them (what the device produced), `delivered` what its
    client has been sent so far (behind by the few batches backpressure lets wait)."""
    d = {"label": r.stats.label, **r.stats.as_json(), "delivered": r.stats.computed, "computed": r.arrived_computed}
    if "valid" in d:
        d["valid"] = r.arrived_valid
    return d


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    engine = request.app[engine_key]
    data = request.app[metrics_key].render(engine.state, engine.load_seconds)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE})


# --------------------------------------------------------------------------------------------------
# /generate


@routes.post("/generate")
async def generate(request: web.Request) -> web.StreamResponse:
    app = request.app
    cfg = app[config_key]
    body = fields.unwrap(await fields.read_json(request, cfg.max_body_bytes))
    job, lines, label = parse_generate(app, body, "/generate")
    claim = admit_job(app, job, "/generate")  # 422 or 409 here, before the 200 goes out
    runner = new_runner(app, job, claim, label)
    try:
        return await stream_job(request, runner, lines.line)
    finally:
        runner.close()


async def stream_job(request: web.Request, runner: JobRunner, make_line) -> web.StreamResponse:
    """Write one line per batch that has something to say, progress lines, and the final line."""
    w = NdjsonWriter(request)
    await w.open()
    try:
        await pump(w, runner, make_line)
    except Exception as e:  # after the 200 went out, a failure can only be one more line (pump ended the job)
        log.warning("stream failed %s", describe(e))
        await w.write({"error": str(e), "error_type": type(e).__name__})
    await w.close()
    return w.resp


# --------------------------------------------------------------------------------------------------
# /validate (PoC v1)


@routes.post("/validate")
async def validate(request: web.Request) -> web.Response:
    """Recompute a submitted v1 ProofBatch and answer the ValidatedBatch fields."""
    app = request.app
    cfg = app[config_key]
    body = fields.unwrap(await fields.read_json(request, cfg.max_body_bytes))
    req = schemas.parse_v1_validate(body, cfg)
    bs = min(len(req.batch.nonces), VALIDATE_BATCH_SIZE)
    claim = admit(app, "/validate", v1=(req.params, bs, req.dtype))
    vb = await validate_v1(app, req.batch, req.params, req.r_target, req.fraud_threshold, req.dtype, claim)
    return web.json_response(vb.to_json(), dumps=json_text)  # a NaN distance is null, never a bare NaN
