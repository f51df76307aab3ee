"""A Gonka network node drives the server with nothing in between (issue 15).

Every request here is built as the node's Go client builds it (github.com/gonka-ai/gonka, decentralized-api):
the body is Go's encoding/json of the client's struct, fields in struct order, `omitempty` fields left out when
zero, nil slices as `null`, float64 written as Go writes it (1 not 1.0, 1e-05), and it goes out as
decentralized-api/utils/http.go sends it: no Content-Type header, and no body at all for a nil payload.
Each answer is then checked the way Go's json.Unmarshal would read it into the struct the client decodes into
(a number with a fraction into an int field, a string into a number, ... fail) plus the fields the node relies on.

Replayed files:
  decentralized-api/mlnodeclient/client.go          NodeState (GET /api/v1/state, StateResponse), Stop (POST
                                                    /api/v1/stop, nil payload), GetPowStatus (PowStatusResponse)
  decentralized-api/mlnodeclient/poc.go             InitDto, Params (POST /api/v1/pow/init/generate, v1)
  decentralized-api/mlnodeclient/poc_v2_requests.go PoCInitGenerateRequestV2, PoCGenerateRequestV2, ValidationV2,
                                                    StatTestParamsV2 (+ DefaultStatTestParamsV2), and the responses
                                                    PoCInitGenerateResponseV2, PoCGenerateResponseV2,
                                                    PoCStatusResponseV2, PoCStopResponseV2 (StopPowV2 sends struct{}{})
  decentralized-api/mlnodeclient/poc_v2.go          ArtifactV2, GeneratedArtifactBatchV2, ValidatedResultV2 (the
                                                    callbacks the node's receiver binds)
  decentralized-api/broker/node_worker_commands*.go StartPoCNodeCommandV1/V2: the state checks the node makes
  mlnode/packages/api/src/api/inference/pow_v2_routes.py  the MLNode's defaults and response shapes
  mlnode/packages/api/src/api/routes.py                   the MLNode's /api/v1/state and /stop
"""

import asyncio
import json
import math

from aiohttp import web

from poc.protocol import v2
from poc.server.app import create_app
from poc.server.pow import pow_key

from .fakes import wait_until
from .golden import V1_GOLDEN as G1, V2_GOLDEN as G2
from .servers import QWEN3, server_config, wait_status

P2 = G2["parameters"]
NODE_STATES = {"POW", "INFERENCE", "TRAIN", "STOPPED"}  # client.go MLNodeState


# --------------------------------------------------------------------------------------------------
# Go's side of the wire


class OMIT:
    """An `omitempty` field: left out when zero."""

    def __init__(self, v):
        self.v = v


def go_float(x: float) -> str:
    """float64 as encoding/json writes it: no ".0" on whole numbers, exponents as 1e-05 / 1e+21."""
    if x == int(x) and abs(x) < 1e21:
        return str(int(x))
    return repr(float(x))


def go_marshal(v) -> str:
    """encoding/json of an ordered struct (a list of (name, value) pairs), a slice (list or None), or a scalar."""
    if isinstance(v, list) and v and isinstance(v[0], tuple) and len(v[0]) == 2 and isinstance(v[0][0], str):
        parts = []
        for name, val in v:
            if isinstance(val, OMIT):
                if val.v in (None, 0, False, "", [], ()):  # Go's zero values: omitted
                    continue
                val = val.v
            parts.append(f"{json.dumps(name)}:{go_marshal(val)}")
        return "{" + ",".join(parts) + "}"
    if v is None:
        return "null"  # a nil slice or pointer
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return go_float(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ",".join(go_marshal(x) for x in v) + "]"
    raise TypeError(v)


async def go_post(client, path: str, payload=None):
    """utils.SendPostJsonRequest: json.Marshal(payload), or no body for a nil payload; no Content-Type."""
    data = b"" if payload is None else go_marshal(payload).encode()
    return await client.post(path, data=data, skip_auto_headers={"Content-Type"})


async def go_get(client, path: str):
    return await client.get(path, skip_auto_headers={"Content-Type"})


# what json.Unmarshal accepts for a field of each Go type (null leaves the zero value, for any type)
def go_check(value, spec, path: str = "$") -> None:
    if value is None:
        return
    if spec == "string":
        assert isinstance(value, str), f"{path}: {value!r} does not decode into a Go string"
    elif spec in ("int", "int64"):
        assert isinstance(value, int) and not isinstance(value, bool), f"{path}: {value!r} is not a Go {spec}"
        assert -(1 << 63) <= value < (1 << 63), f"{path}: {value} overflows int64"
    elif spec == "float64":
        assert isinstance(value, (int, float)) and not isinstance(value, bool), f"{path}: {value!r} is not a float64"
        assert math.isfinite(value), f"{path}: {value!r}"
    elif spec == "bool":
        assert isinstance(value, bool), f"{path}: {value!r} is not a Go bool"
    elif isinstance(spec, list):  # a slice
        assert isinstance(value, list), f"{path}: {value!r} is not a JSON array"
        for i, x in enumerate(value):
            go_check(x, spec[0], f"{path}[{i}]")
    elif isinstance(spec, dict):  # a struct: unknown keys are ignored by encoding/json
        assert isinstance(value, dict), f"{path}: {value!r} is not a JSON object"
        for k, sub in spec.items():
            if k in value:
                go_check(value[k], sub, f"{path}.{k}")
    else:
        raise AssertionError(spec)


def go_decode(text: str, spec: dict, required=()) -> dict:
    obj = json.loads(text)
    go_check(obj, spec)
    for k in required:
        assert obj.get(k) not in (None, ""), f"{k} is missing: the node reads it ({obj})"
    return obj


# the structs (their JSON names and Go types)
StateResponse = {"state": "string"}  # client.go; MLNodeState is a string type
PowStatusResponse = {"status": "string", "is_model_initialized": "bool"}  # client.go
BackendResult = {"port": "int", "status": "string"}  # poc_v2_requests.go
BackendError = {"port": "int", "error": "string"}
PoCInitGenerateResponseV2 = {"status": "string", "backends": "int", "n_groups": "int", "results": [BackendResult],
                             "errors": [BackendError]}
PoCGenerateResponseV2 = {"status": "string", "request_id": "string"}
PoCStatusResponseV2 = {"status": "string", "backends": [{"port": "int", "status": "string"}]}
PoCStopResponseV2 = {"status": "string", "results": [BackendResult], "errors": [BackendError]}
ArtifactV2 = {"nonce": "int64", "vector_b64": "string", "k_points_steps": ["int"]}  # poc_v2.go
GeneratedArtifactBatchV2 = {"block_hash": "string", "block_height": "int64", "public_key": "string", "node_id": "int",
                            "artifacts": [ArtifactV2],
                            "encoding": {"dtype": "string", "k_dim": "int", "endian": "string"},
                            "request_id": "string"}
ValidatedResultV2 = {"request_id": "string", "block_hash": "string", "block_height": "int64", "public_key": "string",
                     "node_id": "int", "n_total": "int64", "n_mismatch": "int64", "mismatch_nonces": ["int64"],
                     "p_value": "float64", "fraud_detected": "bool"}


def params_v2(model="qwen3", seq_len=None) -> list:
    # PoCParamsV2: k_dim intentionally omitted; decode/max_tokens omitempty (prefill scheme)
    return [("model", model), ("seq_len", P2["seq_len"] if seq_len is None else seq_len),
            ("decode", OMIT(False)), ("max_tokens", OMIT(0))]


def init_generate_v2(url: str, node_id=0, node_count=1) -> list:
    """PoCInitGenerateRequestV2 as StartPoCNodeCommandV2 fills it (URL = callback base + "/" + model id)."""
    return [("block_hash", P2["block_hash"]), ("block_height", 3), ("public_key", P2["public_key"]),
            ("node_id", node_id), ("node_count", node_count), ("params", params_v2()), ("url", OMIT(url)),
            ("poc_stronger_rng", OMIT(False))]


def generate_v2(nonces, *, wait=False, url="", artifacts=None, stat_test=None) -> list:
    """PoCGenerateRequestV2: Validation and StatTest are pointers (omitempty), Nonces a slice (nil -> null)."""
    validation = None if artifacts is None else [("artifacts", artifacts)]
    return [("block_hash", P2["block_hash"]), ("block_height", 3), ("public_key", P2["public_key"]),
            ("node_id", 0), ("node_count", 1), ("nonces", nonces), ("params", params_v2()), ("wait", OMIT(wait)),
            ("url", OMIT(url)), ("validation", OMIT(validation)), ("stat_test", OMIT(stat_test)),
            ("poc_stronger_rng", OMIT(False))]


def default_stat_test(**kw) -> list:
    """DefaultStatTestParamsV2 (0.4, 0.1, 0.05), as StatTestParamsFromChain falls back to."""
    d = {"dist_threshold": 0.4, "p_mismatch": 0.1, "p_value_threshold": 0.05, **kw}
    return [(k, OMIT(d[k])) for k in ("dist_threshold", "p_mismatch", "p_value_threshold")]


class NodeReceiver:
    """The node's callback server: {base}/{model}/generated and /validated (postGeneratedArtifactsV2 binds the body
    into GeneratedArtifactBatchV2; the validated one into ValidatedResultV2)."""

    def __init__(self):
        self.got: dict[str, list] = {"generated": [], "validated": []}
        self.app = web.Application()
        self.app.router.add_post("/poc/{model}/{kind}", self.handle)

    async def handle(self, request):
        kind = request.match_info["kind"]
        text = await request.text()
        spec = GeneratedArtifactBatchV2 if kind == "generated" else ValidatedResultV2
        self.got[kind].append(go_decode(text, spec))
        return web.json_response({"status": "OK"})


async def node_state(client) -> str:
    r = await go_get(client, "/api/v1/state")
    assert r.status == 200  # NodeState: anything else is an error
    s = go_decode(await r.text(), StateResponse, ["state"])["state"]
    assert s in NODE_STATES
    return s


# --------------------------------------------------------------------------------------------------
# v1: state, init, stop


TINY = [("dim", 64), ("n_layers", 2), ("n_heads", 4), ("n_kv_heads", 2), ("vocab_size", 256),
        ("ffn_dim_multiplier", 1.0), ("multiple_of", 32), ("norm_eps", 1e-05), ("rope_theta", 10000),
        ("use_scaled_rope", False), ("seq_len", 8)]  # poc.go Params: rope_theta is an int, the multiplier a float64


def init_dto_v1(url: str) -> list:
    """poc.go InitDto (BuildInitDto's defaults: r_target 1.3971164020989417, fraud_threshold 1e-7)."""
    return [("block_hash", G1["block_hash"]), ("block_height", 5), ("public_key", G1["public_key"]),
            ("batch_size", 100), ("r_target", 1.3971164020989417), ("fraud_threshold", 1e-07),
            ("params", TINY), ("node_id", 0), ("node_count", 1), ("url", url)]


async def test_v1_state_and_stop_as_the_node_calls_them(aiohttp_client, aiohttp_server):
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config()))
    await wait_status(client)
    # StartPoCNodeCommandV1: NodeState first; STOPPED means no Stop() is needed
    assert await node_state(client) == "STOPPED"
    body = go_marshal(init_dto_v1(str(srv.make_url("/poc/v1"))))
    assert '"ffn_dim_multiplier":1,' in body and '"fraud_threshold":1e-07,' in body  # Go's encodings
    r = await go_post(client, "/api/v1/pow/init/generate", init_dto_v1(str(srv.make_url("/poc/v1"))))
    assert r.status == 200, await r.text()
    # now POW and GENERATING: the node's next StartPoCNodeCommandV1 skips the restart
    assert await node_state(client) == "POW"
    r = await go_get(client, "/api/v1/pow/status")
    assert r.status == 200
    st = go_decode(await r.text(), PowStatusResponse, ["status"])
    assert st["status"] == "GENERATING" and st["is_model_initialized"] is True
    st = json.loads(await (await go_get(client, "/api/v1/state")).text())
    assert st["poc_validation_inference"] is False and st["version"]
    # Stop(): nil payload (no body, no Content-Type), the answer is not even read: it must really stop
    gen = client.app[pow_key].gen
    r = await go_post(client, "/api/v1/stop", None)
    assert r.status == 200 and json.loads(await r.text()) == {"status": "OK"}
    assert not gen.active and client.app[pow_key].v1_init is None
    assert await node_state(client) == "STOPPED"
    st = go_decode(await (await go_get(client, "/api/v1/pow/status")).text(), PowStatusResponse, ["status"])
    assert st["status"] == "IDLE"
    # a second Stop() with nothing running: still 200
    assert (await go_post(client, "/api/v1/stop", None)).status == 200


async def test_stop_ends_every_job_on_the_device(aiohttp_client):
    """The MLNode's /stop stops all its work: here a /generate stream too (its done line says stopped)."""
    client = await aiohttp_client(create_app(server_config()))
    await wait_status(client)
    body = {"block_hash": "h", "block_height": 1, "public_key": "k", "r_target": 1.4, "batch_size": 4,
            "start_nonce": 0, "max_nonces": 10 ** 9, "params": dict(TINY)}
    resp = await client.post("/generate", json=body)
    assert resp.status == 200
    await resp.content.readline()
    assert (await go_post(client, "/api/v1/stop", None)).status == 200
    lines = [json.loads(x) for x in (await asyncio.wait_for(resp.read(), 30)).decode().splitlines() if x.strip()]
    assert lines[-1]["status"] == "done" and lines[-1]["reason"] == "stopped"


# --------------------------------------------------------------------------------------------------
# v2: /api/v1/inference/pow/*


async def test_the_v2_cycle_as_the_node_drives_it(aiohttp_client, aiohttp_server):
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    base = str(srv.make_url("/poc"))
    client = await aiohttp_client(create_app(server_config(model=QWEN3, callback_interval=0.1)))
    await wait_status(client)
    assert await node_state(client) == "INFERENCE"  # the MLNode's state while its vLLM (PoC v2) is up
    # GetPowStatusV2 before: IDLE
    r = await go_get(client, "/api/v1/inference/pow/status")
    st = go_decode(await r.text(), PoCStatusResponseV2, ["status"])
    assert r.status == 200 and st["status"] == "IDLE" and len(st["backends"]) == 1
    # InitGenerateV2
    req = init_generate_v2(f"{base}/qwen3")
    assert '"k_dim"' not in go_marshal(req) and '"batch_size"' not in go_marshal(req)  # left to the MLNode
    r = await go_post(client, "/api/v1/inference/pow/init/generate", req)
    assert r.status == 200, await r.text()
    d = go_decode(await r.text(), PoCInitGenerateResponseV2, ["status"])
    assert d["status"] == "OK" and d["backends"] == 1 and d["n_groups"] == 1
    assert [x["status"] for x in d["results"]] == ["OK"] and not d["errors"]
    gen = client.app[pow_key].gen
    # k_dim as the MLNode fills it; batch_size the served model's (default_v2_batch: 32 on the CPU, as the MLNode)
    assert (gen.init.batch_size, gen.init.k_dim, gen.init.group_id, gen.init.n_groups) == (32, 12, 0, 1)
    # GetPowStatusV2 while generating: StartPoCNodeCommandV2 skips a restart on "GENERATING"
    st = go_decode(await (await go_get(client, "/api/v1/inference/pow/status")).text(), PoCStatusResponseV2,
                   ["status"])
    assert st["status"] == "GENERATING" and st["backends"][0]["status"] == "GENERATING"
    await wait_until(lambda: rx.got["generated"], 30, "a /generated callback")
    # StopPowV2: body {} (struct{}{})
    assert go_marshal([("x", OMIT(0))]) == "{}"  # struct{}{} as Go marshals it
    r = await client.post("/api/v1/inference/pow/stop", data=b"{}", skip_auto_headers={"Content-Type"})
    assert r.status == 200
    d = go_decode(await r.text(), PoCStopResponseV2, ["status"])
    assert d["status"] == "OK" and [x["status"] for x in d["results"]] == ["stopped"]
    assert not gen.active
    st = go_decode(await (await go_get(client, "/api/v1/inference/pow/status")).text(), PoCStatusResponseV2)
    assert st["status"] == "IDLE"
    batch = rx.got["generated"][0]
    assert batch["public_key"] == P2["public_key"] and batch["block_height"] == 3 and batch["artifacts"]
    assert batch["encoding"] == {"dtype": "f16", "k_dim": 12, "endian": "le"}
    arts = [a for b in rx.got["generated"] for a in b["artifacts"]][:8]
    nonces = [a["nonce"] for a in arts]

    # the validator's GenerateV2, with validation and wait (artifacts as ArtifactV2, stat_test the defaults)
    val = [[("nonce", a["nonce"]), ("vector_b64", a["vector_b64"]), ("k_points_steps", OMIT(None))] for a in arts]
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2(nonces, wait=True, artifacts=val, stat_test=default_stat_test()))
    assert r.status == 200, await r.text()
    d = go_decode(await r.text(), {**PoCGenerateResponseV2, **ValidatedResultV2}, ["status", "request_id"])
    assert d["status"] == "completed" and (d["n_total"], d["n_mismatch"], d["fraud_detected"]) == (8, 0, False)

    # queued, with a callback: the request_id the node reads back is the one in the callback
    bad = [list(x) for x in val]
    bad[0][1] = ("vector_b64", v2.encode(-v2.decode(arts[0]["vector_b64"])))
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2(nonces, url=f"{base}/qwen3", artifacts=bad,
                                  stat_test=default_stat_test(p_value_threshold=0.6)))
    assert r.status == 200, await r.text()
    q = go_decode(await r.text(), PoCGenerateResponseV2, ["status", "request_id"])
    assert q["status"] == "queued"
    for _ in range(400):
        r = await go_get(client, f"/api/v1/inference/pow/generate/{q['request_id']}")
        res = json.loads(await r.text())
        if res["status"] not in ("queued", "running"):
            break
        await asyncio.sleep(0.05)
    assert res["status"] == "completed" and res["request_id"] == q["request_id"]
    go_check(res, ValidatedResultV2)
    # one mismatch of 8 at p_mismatch 0.1: p-value 1 - 0.9**8 = 0.57; fraud under the node's threshold 0.6
    # (p_value_threshold mapped), where the MLNode's default fraud_threshold 0.01 would have said honest
    assert (res["n_mismatch"], res["mismatch_nonces"]) == (1, [nonces[0]])
    assert abs(res["p_value"] - (1 - 0.9 ** 8)) < 1e-9 and res["fraud_detected"] is True
    # the MLNode's composite "<port>:<id>" reads the same result
    r = await go_get(client, f"/api/v1/inference/pow/generate/18000:{q['request_id']}")
    assert r.status == 200 and json.loads(await r.text())["n_mismatch"] == 1
    await wait_until(lambda: rx.got["validated"], 10, "the /validated callback")
    cb = rx.got["validated"][0]
    assert cb["request_id"] == q["request_id"] and cb["fraud_detected"] is True and cb["n_total"] == 8
    assert (await go_get(client, "/api/v1/inference/pow/generate/nope")).status == 404


async def test_v2_requests_the_server_cannot_take_are_refused_clearly_and_change_nothing(aiohttp_client):
    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    svc = client.app[pow_key]
    # a nil Nonces slice: Go writes null
    r = await go_post(client, "/api/v1/inference/pow/generate", generate_v2(None, wait=True))
    assert r.status == 400 and json.loads(await r.text())["field"] == "nonces"
    # validation.artifacts nil
    req = [(k, [("artifacts", None)]) if k == "validation" else (k, v) for k, v in generate_v2([1, 2], wait=True)]
    assert '"validation":{"artifacts":null}' in go_marshal(req)
    r = await go_post(client, "/api/v1/inference/pow/generate", req)
    assert r.status == 400 and json.loads(await r.text())["field"] == "validation.artifacts"
    # the decode scheme (params.decode true, max_tokens) is not served
    req = init_generate_v2("http://127.0.0.1:9/poc/qwen3")
    req[5] = ("params", [("model", "qwen3"), ("seq_len", 16), ("decode", True), ("max_tokens", 8)])
    r = await go_post(client, "/api/v1/inference/pow/init/generate", req)
    assert r.status == 400 and json.loads(await r.text())["field"] == "params.decode"
    # both names of the one threshold, disagreeing
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2([1], wait=True, stat_test=[("p_value_threshold", 0.05), ("fraud_threshold", 0.01)]))
    assert r.status == 400 and "p_value_threshold" in json.loads(await r.text())["error"]
    # a model not served: 409 as on /api/v1/pow
    req = init_generate_v2("http://127.0.0.1:9/poc/x")
    req[5] = ("params", params_v2(model="Qwen/Other"))
    r = await go_post(client, "/api/v1/inference/pow/init/generate", req)
    assert r.status == 409
    assert svc.gen is None and not svc.queue and not svc.jobs


async def test_the_versions_probe_answers(aiohttp_client):
    """The MLNode's capability probe GETs /api/v1/pow/versions from its backend (vllm_version,
    poc_validation_inference) and serves /api/v1/versions; unknown or failing reads fail closed."""
    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    for path in ("/api/v1/pow/versions", "/api/v1/versions"):
        r = await go_get(client, path)
        assert r.status == 200
        d = json.loads(await r.text())
        assert d["version"] and d["vllm_version"] and d["poc_validation_inference"] is False
        assert d["protocols"] == ["v1", "v2"] and d["model"]
