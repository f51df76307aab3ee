"""/api/v1/pow/*: the API a Gonka MLNode speaks to its PoC backend. The request's params say which protocol.

PoC v2 (spec-v2 §e): POST /init/generate (continuous generation, artifacts to {url}/generated), POST /generate
(explicit nonces, optional validation; queued FIFO, or `wait: true`), GET /generate/{request_id}, GET /status,
POST /stop. PoC v1 (spec-v1 §4.5): POST /init, /init/generate, /init/validate, /phase/generate,
/phase/validate, /validate (a ProofBatch, scored and posted to {url}/validated), GET /status, POST /stop.

The routes read the body and answer; the work is the PoC service's (server/pow_service.py), which the MLNode's
routes (server/mlnode.py) call too.
"""

from __future__ import annotations

from aiohttp import web

from poc.server import fields
from poc.server.context import config_key
from poc.server.pow_service import PowService, pow_key
from poc.server.stream import json_text

PREFIX = "/api/v1/pow"
routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    """The API as a sub-application at PREFIX; its service lives on the parent app (pow_key), whose keys it uses."""
    app[pow_key] = PowService(app)
    sub = web.Application()
    sub.add_routes(routes)
    app.add_subapp(PREFIX, sub)


def ok(state: str) -> web.Response:
    return web.json_response({"status": "OK", "pow_status": {"status": state}})


def _svc(request: web.Request) -> PowService:
    return request.config_dict[pow_key]


async def _body(request: web.Request) -> dict:
    return await fields.read_json(request, request.config_dict[config_key].max_body_bytes)


@routes.post("/init")
async def init(request: web.Request) -> web.Response:
    return ok(await _svc(request).init(await _body(request)))


@routes.post("/init/generate")
async def init_generate(request: web.Request) -> web.Response:
    return ok(await _svc(request).init_generate(await _body(request)))


@routes.post("/init/validate")
async def init_validate(request: web.Request) -> web.Response:
    return ok(await _svc(request).init_validate(await _body(request)))


@routes.post("/phase/generate")
async def phase_generate(request: web.Request) -> web.Response:
    return ok(await _svc(request).phase_generate())


@routes.post("/phase/validate")
async def phase_validate(request: web.Request) -> web.Response:
    return ok(await _svc(request).phase_validate())


@routes.post("/validate")
async def validate(request: web.Request) -> web.Response:
    """A v1 ProofBatch to score; the ValidatedBatch goes to {url}/validated (and GET /generate/{id})."""
    svc = _svc(request)
    svc.need_v1()  # 409 before the body is read
    return web.json_response(await svc.validate(await _body(request)))


@routes.post("/generate")
async def generate(request: web.Request) -> web.Response:
    return web.json_response(await _svc(request).generate(await _body(request)), dumps=json_text)


@routes.get("/generate/{request_id}")
async def generate_result(request: web.Request) -> web.Response:
    return web.json_response(_svc(request).result(request.match_info["request_id"]), dumps=json_text)


@routes.get("/status")
async def status(request: web.Request) -> web.Response:
    return web.json_response(_svc(request).status(), dumps=json_text)


@routes.post("/stop")
async def stop(request: web.Request) -> web.Response:
    await _svc(request).stop_all()
    return ok("STOPPED")
