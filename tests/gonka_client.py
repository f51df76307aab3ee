"""The Gonka node's Go client as the tests replay it (tests/test_gonka_node.py, tests/test_inference_up.py): bodies as
Go's encoding/json writes them and sends them (no Content-Type, no body for a nil payload), answers checked as
json.Unmarshal reads them into the client's structs, the node's callback receiver and the broker's status checks.
Read from gonka v0.2.14's decentralized-api (the files test_gonka_node.py's docstring lists)."""

import json
import math

from aiohttp import web

from .golden import V1_GOLDEN as G1, V2_GOLDEN as G2

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


StateResponseGo = {"state": "string", "version": "string", "poc_validation_inference": "bool"}  # client.go
VLLMModelsResponse = {"data": [{"id": "string"}]}  # client.go GetLoadedModels
GPUDevice = {"index": "int", "name": "string", "total_memory_mb": "int", "free_memory_mb": "int",
             "used_memory_mb": "int", "utilization_percent": "int", "temperature_c": "int", "is_available": "bool",
             "error_message": "string"}  # types.go (the *int fields: null or an int)
GPUDevicesResponse = {"devices": [GPUDevice], "count": "int"}
DriverInfo = {"driver_version": "string", "cuda_driver_version": "string", "nvml_version": "string"}
ModelGo = {"hf_repo": "string", "hf_commit": "string"}
ModelStatusResponse = {"model": ModelGo, "status": "string", "error_message": "string",
                       "progress": {"start_time": "float64", "elapsed_seconds": "float64"}}
ModelListResponse = {"models": [{"model": ModelGo, "status": "string"}]}
DownloadStartResponse = {"task_id": "string", "status": "string", "model": ModelGo}
MODEL_STATUSES = {"DOWNLOADED", "DOWNLOADING", "NOT_FOUND", "PARTIAL"}


def model_go(repo: str, commit=None) -> list:
    """mlnodeclient.Model: HfCommit is a *string (nil -> null)."""
    return [("hf_repo", repo), ("hf_commit", commit)]


async def broker_status(client, expected_model: str | None) -> str:
    """queryNodeStatus against this server: the HardwareNodeStatus the broker records (FAILED makes it redeploy)."""
    r = await go_get(client, "/api/v1/state")
    if r.status != 200:
        return "FAILED"
    st = go_decode(await r.text(), StateResponseGo, ["state", "version"])
    status = {"POW": "POC", "INFERENCE": "INFERENCE", "STOPPED": "STOPPED"}.get(st["state"], "UNKNOWN")
    if status != "INFERENCE":
        return status
    r = await go_get(client, "/api/v1/inference/pow/status")
    if r.status == 200 and go_decode(await r.text(), PoCStatusResponseV2)["status"] in ("GENERATING", "VALIDATING"):
        return "POC"
    if (await go_get(client, "/health")).status != 200:  # InferenceHealth
        return "FAILED"
    if expected_model:
        r = await go_get(client, "/v1/models")
        if r.status == 200:
            ids = [m["id"] for m in go_decode(await r.text(), VLLMModelsResponse)["data"] or []]
            if ids and ids[0] != expected_model:
                return "FAILED"
    return "INFERENCE"
