"""The MLNode's own routes, so a Gonka network node ("decentralized-api") can drive this server with nothing in
between: its MLNode client (decentralized-api/mlnodeclient) calls them on the node's `poc_port` base URL.

    GET  /api/v1/state                          {"state": POW|INFERENCE|TRAIN|STOPPED, ...}, always 200
    POST /api/v1/stop                           (no body) stops every PoC job: generation, the queue, streams
    GET  /api/v1/versions, /api/v1/pow/versions  what this server is (the MLNode's capability probe)
    POST /api/v1/inference/pow/init/generate    PoC v2 continuous generation  -> /api/v1/pow/init/generate
    POST /api/v1/inference/pow/generate         explicit nonces (+ validation) -> /api/v1/pow/generate
    GET  /api/v1/inference/pow/generate/{id}    a queued request's result      -> /api/v1/pow/generate/{id}
    GET  /api/v1/inference/pow/status           {"status", "backends": [...]}  <- /api/v1/pow/status
    POST /api/v1/inference/pow/stop             {"status", "results", ...}: every job, as /api/v1/stop

One process plays both roles the MLNode and its vLLM backends play: every /api/v1/inference/pow route fills the
defaults the MLNode fills (params.k_dim 12, group_id 0 of n_groups 1: this server is the one backend; a missing
batch_size, 32 in the MLNode, is the batch that serves the loaded model best, as /api/v1/pow picks it), drops the
node's stat_test.p_value_threshold as the MLNode does (fraud_threshold, 0.01 unless given, decides: the verdict the
network gives), hands the request to the PoC service behind /api/v1/pow (server/pow_service.py, the one
implementation: its Python API, not the /api/v1/pow routes), and answers
in the MLNode's shapes (decentralized-api/mlnodeclient/poc_v2_requests.go decodes them): the one backend is
reported under this server's port. A request id is the /api/v1/pow one, the same in the callback's `request_id`;
the MLNode's "<port>:<id>" form is accepted on read-back too. The inference side the node also checks (/health,
/v1/models, /api/v1/inference/up) is server/models.py; the GPU routes are server/gpu.py.

State (what the node's broker reads, decentralized-api/mlnodeclient/client.go): "POW" while PoC v1 is initialized
(generating or validating, until /stop), as the MLNode's PoW manager; "INFERENCE" when a --model checkpoint is
loaded and no v1 work is on (the MLNode runs PoC v2 inside its vLLM, so a node expects INFERENCE around v2 PoC;
`poc_status` says what PoC v2 is doing); "STOPPED" otherwise (v1 only and idle, still loading, or broken). Never
"TRAIN". This server serves no inference: `poc_validation_inference` is false (the capability the node's gateway
reads). The node's inference URL may point here too: /health and /v1/models answer for the loaded checkpoint
(its broker marks a node FAILED unless they do), though no chat completion is served.
"""

from __future__ import annotations

import logging

from aiohttp import web

import poc
from poc.errors import InputError
from poc.server import fields
from poc.server.context import config_key, engine_key, served_model
from poc.server.pow_service import pow_key, stop_every_job
from poc.server.stream import json_text

log = logging.getLogger("poc.mlnode")

V2 = "/api/v1/inference/pow"
MLNODE_K_DIM = 12  # its params.k_dim default


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    app.add_routes(routes)


# --------------------------------------------------------------------------------------------------
# management


def node_state(app: web.Application) -> str:
    engine = app[engine_key]
    if app[pow_key].v1_in_progress:
        return "POW"
    if engine.state in ("ready", "busy") and engine.v2 is not None:
        return "INFERENCE"
    return "STOPPED"


@routes.get("/api/v1/state")
async def state(request: web.Request) -> web.Response:
    """The node's StateResponse {state, version, poc_validation_inference}, plus what the MLNode adds in INFERENCE."""
    app = request.app
    engine = app[engine_key]
    pow_state = app[pow_key].status()["status"]  # LOADING, GENERATING, VALIDATING or IDLE
    served = served_model(app)
    body = {"state": node_state(app), "version": poc.__version__,
            "poc_status": "NO_BACKENDS" if engine.state in ("loading", "broken") else _aggregate(pow_state),
            "inference_healthy": engine.state in ("ready", "busy") and served is not None,
            "loaded_model": served.ids[0] if served is not None else None,
            "poc_validation_inference": False}
    return web.json_response(body)


@routes.post("/api/v1/stop")
async def stop_all(request: web.Request) -> web.Response:
    """The node's Stop(): no body, and it does not read the answer, so this must really stop (and say 200)."""
    await stop_every_job(request.app, "POST /api/v1/stop")
    return web.json_response({"status": "OK"})


@routes.get("/api/v1/versions")
@routes.get("/api/v1/pow/versions")
async def versions(request: web.Request) -> web.Response:
    """What the MLNode's capability probe reads from a backend (vllm_version, poc_validation_inference) and what
    its own /api/v1/versions answers (version): one object for both routes."""
    app = request.app
    engine = app[engine_key]
    return web.json_response({"version": poc.__version__, "vllm_version": f"poc-model-server {poc.__version__}",
                              "poc_validation_inference": False, "server": "poc-model-server",
                              "protocols": ["v1", "v2"] if engine.v2 is not None else ["v1"],
                              "model": engine.v2.name if engine.v2 is not None else None,
                              "port": app[config_key].port})


# --------------------------------------------------------------------------------------------------
# PoC v2, as the MLNode serves it


def _port(request: web.Request) -> int:
    return request.app[config_key].port


def _params(params) -> dict:
    """The node's PoCParamsV2 as the /api/v1/pow service takes it: k_dim filled, the prefill scheme only."""
    if not isinstance(params, dict):
        raise InputError("params must be a JSON object", "params")
    p = dict(params)
    decode = p.pop("decode", False)
    max_tokens = p.pop("max_tokens", None)
    if decode not in (False, None):
        raise InputError("params.decode: the decode scheme is not served here (prefill only)", "params.decode")
    if max_tokens not in (None, 0):
        raise InputError("params.max_tokens belongs to the decode scheme, which is not served here",
                         "params.max_tokens")
    if p.get("k_dim") is None:
        p["k_dim"] = MLNODE_K_DIM
    return p


def _v2_body(body: dict) -> dict:
    out = dict(body)
    if "params" in out:
        out["params"] = _params(out["params"])
    if out.get("batch_size") is None:  # the node sends none: the served model's batch (EngineBase.default_v2_batch)
        out.pop("batch_size", None)
    for k in ("url", "poc_stronger_rng", "wait", "validation", "stat_test"):
        if k in out and out[k] is None:
            del out[k]  # Go's omitted pointer / zero value
    return out


@routes.post(f"{V2}/init/generate")
async def init_generate(request: web.Request) -> web.Response:
    app = request.app
    body = await fields.read_json(request, app[config_key].max_body_bytes)
    b = _v2_body(body)
    for k in ("group_id", "n_groups"):
        if k in b:
            raise InputError(f"{k} is set by the MLNode, not by its caller: this server is its one backend", k)
    b["group_id"], b["n_groups"] = 0, 1
    if "params" not in b or not isinstance(b["params"], dict) or "dim" in b["params"]:
        raise InputError("/api/v1/inference/pow is PoC v2: params must be {model, seq_len[, k_dim]}", "params")
    await app[pow_key].init_generate(b)
    return web.json_response({"status": "OK", "backends": 1, "n_groups": 1,
                              "results": [{"port": _port(request), "status": "OK"}], "errors": None})


@routes.post(f"{V2}/generate")
async def generate(request: web.Request) -> web.Response:
    """The node's stat_test {dist_threshold, p_mismatch, p_value_threshold} is read as the MLNode reads it: its
    StatTestModel has no p_value_threshold, so the key is dropped and fraud_threshold (0.01 unless given) decides.
    Every deployed validator so decides at 0.01; applying the node's p_value_threshold (0.05 by default) would give
    verdicts the network does not."""
    app = request.app
    body = await fields.read_json(request, app[config_key].max_body_bytes)
    b = _v2_body(body)
    st = b.get("stat_test")
    if isinstance(st, dict) and "p_value_threshold" in st:
        b["stat_test"] = {k: v for k, v in st.items() if k != "p_value_threshold"}
    return web.json_response(await app[pow_key].generate(b), dumps=json_text)


@routes.get(f"{V2}/generate/{{request_id:.+}}")
async def generate_result(request: web.Request) -> web.Response:
    """The /api/v1/pow result, under the id the caller used (ours, or the MLNode's "<port>:<id>")."""
    app = request.app
    rid = request.match_info["request_id"]
    head, sep, tail = rid.partition(":")
    own = tail if sep and head.isdigit() else rid
    return web.json_response({**app[pow_key].result(own, named=rid), "request_id": rid})


def _aggregate(pow_state: str) -> str:
    """The MLNode's word over its backends (here one): GENERATING, IDLE, else MIXED."""
    return pow_state if pow_state in ("GENERATING", "IDLE") else "MIXED"


@routes.get(f"{V2}/status")
async def status(request: web.Request) -> web.Response:
    app = request.app
    engine = app[engine_key]
    if engine.state in ("loading", "broken"):  # the MLNode has no healthy backend then
        return web.json_response({"status": "NO_BACKENDS", "backends": []})
    backend = {"port": _port(request), **app[pow_key].status()}
    return web.json_response({"status": _aggregate(backend.get("status", "")), "backends": [backend]},
                             dumps=json_text)


@routes.post(f"{V2}/stop")
async def stop_v2(request: web.Request) -> web.Response:
    """The MLNode's PoC stop: here the device has one owner at a time, so it ends every job and session (as
    /api/v1/stop), a /pooled or /warmup session that holds or waits for the device included."""
    await stop_every_job(request.app, f"POST {V2}/stop")
    return web.json_response({"status": "OK", "results": [{"port": _port(request), "status": "stopped"}],
                              "errors": None})
