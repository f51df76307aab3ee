"""A Gonka network node drives the server with nothing in between (issues 15 and 25: gonka v0.2.14).

Every request here is built as the node's Go client builds it (github.com/gonka-ai/gonka, decentralized-api):
the body is Go's encoding/json of the client's struct, fields in struct order, `omitempty` fields left out when
zero, nil slices as `null`, float64 written as Go writes it (1 not 1.0, 1e-05), and it goes out as
decentralized-api/utils/http.go sends it: no Content-Type header, and no body at all for a nil payload.
Each answer is then checked the way Go's json.Unmarshal would read it into the struct the client decodes into
(a number with a fraction into an int field, a string into a number, ... fail) plus the fields the node relies on.

Replayed files:
  decentralized-api/mlnodeclient/client.go          NodeState (GET /api/v1/state, StateResponse), Stop (POST
                                                    /api/v1/stop, nil payload), GetPowStatus (PowStatusResponse),
                                                    InferenceHealth (GET /health), GetLoadedModels (GET /v1/models),
                                                    InferenceUp (POST /api/v1/inference/up; tests/test_inference_up.py)
  decentralized-api/mlnodeclient/gpu.go, models.go, types.go  GetGPUDevices, GetGPUDriver, CheckModelStatus,
                                                    ListModels, DownloadModel and their structs
  decentralized-api/broker/broker.go                queryNodeStatus: the checks before the broker trusts a node
  decentralized-api/internal/server/mlnode/post_generated_artifacts_v2_handler.go  what a /generated POST must be
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
  mlnode/packages/api/src/api/gpu, models, health.py      the GPU and model routes, /readyz
  gonka-ai/gonka-vllm-plugins gonka_poc/poc/validation.py  validation as plugin 0.1.3 scores it
"""

import asyncio
import json
import math

from aiohttp import web

from poc.protocol import v2
from poc.server.app import create_app
from poc.server.pow_service import pow_key

from poc.server.context import sender_key

from .fakes import wait_until
from .golden import GOLDEN, V2_GOLDEN as G2
from .gonka_client import (DownloadStartResponse, DriverInfo, GPUDevicesResponse, GeneratedArtifactBatchV2,
                           ModelListResponse, ModelStatusResponse, NodeReceiver, OMIT, PoCGenerateResponseV2,
                           PoCInitGenerateResponseV2, PoCStatusResponseV2, PoCStopResponseV2, PowStatusResponse,
                           StateResponseGo, TINY, ValidatedResultV2, broker_status, default_stat_test, generate_v2,
                           go_check, go_decode, go_get, go_marshal, go_post, init_dto_v1, init_generate_v2, model_go,
                           node_state, params_v2)
from .servers import QWEN3, server_config, wait_status

V2_TINY = GOLDEN / "v2_tiny"

P2 = G2["parameters"]

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
    for i in range(3):
        bad[i][1] = ("vector_b64", v2.encode(-v2.decode(arts[i]["vector_b64"])))
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2(nonces, url=f"{base}/qwen3", artifacts=bad, stat_test=default_stat_test()))
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
    # three mismatches of 8 at p_mismatch 0.1: p-value P[Bin(8, 0.1) >= 3] = 0.038. The node's p_value_threshold
    # (0.05) would call that fraud; the MLNode drops that key and applies fraud_threshold 0.01: honest, the verdict
    # every deployed validator gives
    p = 1 - sum(math.comb(8, k) * 0.1 ** k * 0.9 ** (8 - k) for k in range(3))
    assert (res["n_mismatch"], res["mismatch_nonces"]) == (3, nonces[:3])
    assert abs(res["p_value"] - p) < 1e-9 and 0.01 < p < 0.05 and res["fraud_detected"] is False
    assert (res["n_total"], res["n_excluded"], res["excluded_nonces"]) == (8, 0, [])
    assert [x["mismatch"] for x in res["per_nonce"]] == [True] * 3 + [False] * 5
    # the MLNode's composite "<port>:<id>" reads the same result
    r = await go_get(client, f"/api/v1/inference/pow/generate/18000:{q['request_id']}")
    assert r.status == 200 and json.loads(await r.text())["n_mismatch"] == 3
    await wait_until(lambda: rx.got["validated"], 10, "the /validated callback")
    cb = rx.got["validated"][0]
    assert cb["request_id"] == q["request_id"] and cb["fraud_detected"] is False and cb["n_total"] == 8
    assert cb["n_mismatch"] == 3 and cb["block_height"] == 3 and "per_nonce" not in cb
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
    # a node id whose lattice starts past int32 (the node stores nonces as int32): refused at init
    r = await go_post(client, "/api/v1/inference/pow/init/generate",
                      init_generate_v2("http://127.0.0.1:9/poc/qwen3", node_id=1 << 31, node_count=(1 << 31) + 1))
    assert r.status == 400 and json.loads(await r.text())["field"] == "node_id"
    assert "int32" in json.loads(await r.text())["error"]
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


# --------------------------------------------------------------------------------------------------
# what the broker checks before it trusts the server (broker.go queryNodeStatus, node_worker_commands.go)



async def test_the_broker_trusts_the_server_and_reads_the_served_model_first(aiohttp_client, aiohttp_server):
    """/api/v1/state, /health and /v1/models as queryNodeStatus reads them: INFERENCE for the epoch's model (the
    --served-model-name, first in the list), FAILED for another (the node would redeploy), POC while generating."""
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config(model=QWEN3, served_model_name=("Org/Tiny-Qwen3", "tq"))))
    await wait_status(client)
    r = await go_get(client, "/api/v1/state")
    st = go_decode(await r.text(), StateResponseGo, ["state", "version"])
    assert (st["state"], st["poc_validation_inference"]) == ("INFERENCE", False)
    d = json.loads(await (await go_get(client, "/v1/models")).text())
    assert d["object"] == "list" and [m["id"] for m in d["data"]] == ["Org/Tiny-Qwen3", "tq"]
    assert d["data"][0]["max_model_len"] == 4096 and d["data"][0]["object"] == "model"
    r = await go_get(client, "/readyz")
    assert r.status == 200 and json.loads(await r.text()) == {"ready": True}
    assert await broker_status(client, "Org/Tiny-Qwen3") == "INFERENCE"
    assert await broker_status(client, "Org/Other") == "FAILED"
    assert json.loads(await (await go_get(client, "/api/v1/state")).text())["loaded_model"] == "Org/Tiny-Qwen3"
    r = await go_post(client, "/api/v1/inference/pow/init/generate", init_generate_v2(str(srv.make_url("/poc/x"))))
    assert r.status == 200, await r.text()
    assert await broker_status(client, "Org/Tiny-Qwen3") == "POC"
    assert (await go_post(client, "/api/v1/stop", None)).status == 200
    # InferenceUpNodeCommand's redeploy: Stop(), then InferenceUp(model, "auto", nil args) for the served model:
    # a no-op that answers as the MLNode does once the model is up
    up = [("model", "Org/Tiny-Qwen3"), ("dtype", "auto"), ("additional_args", None)]
    assert go_marshal(up).endswith('"additional_args":null}')
    r = await go_post(client, "/api/v1/inference/up", up)
    assert r.status == 200 and json.loads(await r.text())["status"] == "OK"
    assert await broker_status(client, "Org/Tiny-Qwen3") == "INFERENCE"
    # without --served-model-name the id is the --model as given (vLLM's default); PoC v1 only: no model at all
    c2 = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(c2)
    assert [m["id"] for m in json.loads(await (await go_get(c2, "/v1/models")).text())["data"]] == [QWEN3]
    c3 = await aiohttp_client(create_app(server_config()))
    await wait_status(c3)
    assert json.loads(await (await go_get(c3, "/v1/models")).text())["data"] == []
    assert await broker_status(c3, "Org/Tiny-Qwen3") == "STOPPED"


class FakeNvml:
    """pynvml as nvidia-ml-py exposes it, for one healthy H100 and one that fails to answer."""

    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        import types
        self.module = types.ModuleType("pynvml")
        for name in dir(self):
            if name.startswith("nvml") or name.startswith("NVML"):
                setattr(self.module, name, getattr(self, name))

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        if i == 1:
            raise RuntimeError("GPU is lost")
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetMemoryInfo(self, h):
        import types
        return types.SimpleNamespace(total=81559 << 20, free=80000 << 20, used=1559 << 20)

    def nvmlDeviceGetUtilizationRates(self, h):
        raise RuntimeError("not supported")

    def nvmlDeviceGetTemperature(self, h, sensor):
        return 31

    def nvmlSystemGetDriverVersion(self):
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self):
        return 12040

    def nvmlSystemGetNVMLVersion(self):
        return "12.550.54.15"


async def test_gpu_and_model_routes_answer_in_the_mlnode_shapes(aiohttp_client, tmp_path, monkeypatch):
    """GetGPUDevices/GetGPUDriver (gpu.go) and CheckModelStatus/ListModels/DownloadModel (models.go), decoded as the
    node's structs: a CPU machine lists no GPU and has no driver (503, as the MLNode without NVML); NVML's devices
    keep a device that fails as unavailable; the model routes read the local Hugging Face cache only."""
    import sys

    from .servers import hub_cache

    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    r = await go_get(client, "/api/v1/gpu/devices")
    assert r.status == 200 and go_decode(await r.text(), GPUDevicesResponse) == {"devices": [], "count": 0}
    r = await go_get(client, "/api/v1/gpu/driver")
    assert r.status == 503 and "NVML" in json.loads(await r.text())["error"]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module)
    d = go_decode(await (await go_get(client, "/api/v1/gpu/devices")).text(), GPUDevicesResponse)
    assert d["count"] == 2 and d["devices"][0] == {
        "index": 0, "name": "NVIDIA H100 80GB HBM3", "total_memory_mb": 81559, "free_memory_mb": 80000,
        "used_memory_mb": 1559, "utilization_percent": None, "temperature_c": 31, "is_available": True,
        "error_message": None}
    assert d["devices"][1]["is_available"] is False and d["devices"][1]["error_message"] == "GPU is lost"
    r = await go_get(client, "/api/v1/gpu/driver")
    assert go_decode(await r.text(), DriverInfo) == {"driver_version": "550.54.15", "cuda_driver_version": "12.4",
                                                     "nvml_version": "12.550.54.15"}

    hub = tmp_path / "hub"
    snap = hub_cache(hub, "Org/Tiny-Llama", V2_TINY / "llama")
    hub_cache(hub, "Org/Half", V2_TINY / "llama", skip={"model.safetensors"})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    want = {"Org/Tiny-Llama": "DOWNLOADED", "Org/Half": "PARTIAL", "Org/Absent": "NOT_FOUND"}
    for repo, status in want.items():
        r = await go_post(client, "/api/v1/models/status", model_go(repo))
        assert r.status == 200, await r.text()
        m = go_decode(await r.text(), ModelStatusResponse, ["status"])
        assert m["status"] == status and m["model"] == {"hf_repo": repo, "hf_commit": None}
    r = await go_post(client, "/api/v1/models/status", model_go("Org/Tiny-Llama", snap.name))
    assert go_decode(await r.text(), ModelStatusResponse)["status"] == "DOWNLOADED"
    r = await go_post(client, "/api/v1/models/status", model_go("Org/Tiny-Llama", "f" * 40))
    assert go_decode(await r.text(), ModelStatusResponse)["status"] == "PARTIAL"  # the repo, not that revision
    r = await go_get(client, "/api/v1/models/status?hf_repo=Org/Tiny-Llama")
    assert go_decode(await r.text(), ModelStatusResponse)["status"] == "DOWNLOADED"
    listed = go_decode(await (await go_get(client, "/api/v1/models/list")).text(), ModelListResponse)["models"]
    assert [(m["model"]["hf_repo"], m["model"]["hf_commit"], m["status"]) for m in listed] == [
        ("Org/Half", snap.name, "PARTIAL"), ("Org/Tiny-Llama", snap.name, "DOWNLOADED")]
    r = await go_post(client, "/api/v1/models/download", model_go("Org/Absent"))
    assert r.status == 202  # nothing is downloaded at run time: the MLNode's offline answer
    assert go_decode(await r.text(), DownloadStartResponse)["status"] == "IGNORED"
    for bad in ("../x", "/abs/dir", "http://h/x", "Org/../x"):
        r = await go_post(client, "/api/v1/models/status", model_go(bad))
        assert r.status == 400 and json.loads(await r.text())["field"] == "hf_repo", bad


# --------------------------------------------------------------------------------------------------
# callbacks as postGeneratedArtifactsV2 accepts them


class StrictNodeReceiver(NodeReceiver):
    """postGeneratedArtifactsV2's checks: block_height the active stage, node_id a known node number, every vector
    standard base64 and not empty (one bad vector refuses the batch: 400), nonces stored as int32."""

    def __init__(self, block_height: int, node_id: int, k_dim: int = 12):
        super().__init__()
        self.block_height, self.node_id, self.k_dim = block_height, node_id, k_dim
        self.refused: list[str] = []
        self.times: list[float] = []

    async def handle(self, request):
        import base64
        import time

        import numpy as np

        kind = request.match_info["kind"]
        if kind != "generated":
            return await super().handle(request)
        b = go_decode(await request.text(), GeneratedArtifactBatchV2)
        why = None
        if b["block_height"] != self.block_height:
            why = f"block_height {b['block_height']} is not the active PoC stage"
        elif b["node_id"] != self.node_id:
            why = f"unknown node_num {b['node_id']}"
        for a in b["artifacts"] or []:
            try:
                raw = base64.b64decode(a["vector_b64"], validate=True)
            except ValueError:
                raw = None
            if not raw:
                why = f"nonce {a['nonce']}: invalid or empty artifact vector"
            elif len(raw) != 2 * self.k_dim or not np.isfinite(np.frombuffer(raw, "<f2")).all():
                why = f"nonce {a['nonce']}: a vector the validators cannot match"
            elif not -(1 << 31) <= a["nonce"] < (1 << 31):
                why = f"nonce {a['nonce']} wraps in int32"
        if why:
            self.refused.append(why)
            return web.json_response({"error": why}, status=400)
        self.times.append(time.monotonic())
        self.got["generated"].append(b)
        return web.Response(status=200)


async def test_callbacks_carry_the_init_header_int32_nonces_and_never_a_bad_vector(aiohttp_client, aiohttp_server,
                                                                                  monkeypatch):
    """Under faults (NaN and Inf vectors, a whole batch of them), every POST the node gets is one its handler takes:
    block_height and node_id as the init sent them, every vector finite and k_dim long, no nonce twice; the bad
    nonces are dropped (reported as dropped_nonces, not sent as vectors)."""
    orig = v2.artifacts
    lattice = [5 + 7 * k for k in range(32 * 40)]  # node 5 of 7; batches of 32 (the MLNode's default)
    faults = set(lattice[::5]) | set(lattice[64:96])  # every fifth nonce, and the whole third batch

    def faulty(nonces, vecs):  # the engine's result rows, some turned NaN/Inf before encoding
        vecs = vecs.clone()
        for i, n in enumerate(nonces):
            if n in faults:
                vecs[i] = float("nan") if n % 2 else float("inf")
        return orig(nonces, vecs)

    monkeypatch.setattr(v2, "artifacts", faulty)
    rx = StrictNodeReceiver(block_height=123456, node_id=5)
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config(model=QWEN3, callback_interval=0.05)))
    await wait_status(client)
    req = init_generate_v2(str(srv.make_url("/poc/qwen3")), node_id=5, node_count=7)
    req[1] = ("block_height", 123456)
    req[5] = ("params", params_v2(seq_len=4))
    r = await go_post(client, "/api/v1/inference/pow/init/generate", req)
    assert r.status == 200, await r.text()
    gen = client.app[pow_key].gen
    await wait_until(lambda: gen.runner.stats.computed >= 32 * 5, 60, "5 batches")  # past the all-bad one
    assert (await go_post(client, "/api/v1/stop", None)).status == 200
    await wait_until(lambda: client.app[sender_key].pending == 0, 20, "every callback delivered")
    assert not rx.refused, rx.refused
    computed = set(lattice[:gen.runner.stats.computed])  # one engine: the lattice's first nonces, in order
    sent = [a["nonce"] for b in rx.got["generated"] for a in b["artifacts"] or []]
    assert len(sent) == len(set(sent)) and set(sent) == computed - faults
    dropped = [n for b in rx.got["generated"] for n in b.get("dropped_nonces", [])]
    assert sorted(dropped) == sorted(computed & faults) and len(computed & faults) >= 32 + 20


async def test_the_first_callback_goes_out_with_the_first_batch_and_nonces_end_inside_int32(aiohttp_client,
                                                                                            aiohttp_server):
    """The early-share guard weighs what a node committed early: the first computed batch is POSTed at once, while
    generation goes on, not after callback_interval (30 s here); the rest follow merged. A lattice that reaches the
    int32 end stops there."""
    import time

    rx = StrictNodeReceiver(block_height=3, node_id=0)
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config(model=QWEN3, callback_interval=30.0)))
    await wait_status(client)
    t0 = time.monotonic()
    r = await go_post(client, "/api/v1/inference/pow/init/generate", init_generate_v2(str(srv.make_url("/poc/q"))))
    assert r.status == 200, await r.text()
    gen = client.app[pow_key].gen
    await wait_until(lambda: rx.got["generated"], 20, "the first callback")
    assert gen.active and rx.times[0] - t0 < 20  # still generating, and well inside the 30 s interval
    assert len(rx.got["generated"]) == 1 and rx.got["generated"][0]["artifacts"][0]["nonce"] == 0
    assert (await go_post(client, "/api/v1/stop", None)).status == 200
    await wait_until(lambda: len(rx.got["generated"]) == 2, 20, "the rest, merged, at the stop")

    rx.node_id, rx.got["generated"] = (1 << 31) - 10, []
    r = await go_post(client, "/api/v1/inference/pow/init/generate",
                      init_generate_v2(str(srv.make_url("/poc/q")), node_id=(1 << 31) - 10, node_count=4))
    assert r.status == 200, await r.text()
    gen = client.app[pow_key].gen
    await wait_until(lambda: not gen.active, 20, "the lattice ends at the int32 limit")
    await wait_until(lambda: rx.got["generated"], 20, "its callback")
    assert [a["nonce"] for b in rx.got["generated"] for a in b["artifacts"]] == [
        (1 << 31) - 10, (1 << 31) - 6, (1 << 31) - 2]
    assert not rx.refused


async def test_validation_leaves_out_what_the_validator_cannot_compute_and_past_10_percent_gives_no_verdict(
        aiohttp_client, aiohttp_server, monkeypatch):
    """As plugin 0.1.3 scores: a nonce whose own vector is NaN/Inf leaves the sample (n_total counts the scored ones,
    n_excluded/excluded_nonces say which); two of eight (past 10%) is no verdict: 503 for wait, and a queued request
    fails with no /validated callback (the node gets no vote it would read as fraud)."""
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    r = await go_post(client, "/api/v1/inference/pow/generate", generate_v2(P2["nonces"], wait=True))
    arts = json.loads(await r.text())["artifacts"]
    val = [[("nonce", a["nonce"]), ("vector_b64", a["vector_b64"])] for a in arts]
    orig, bad = v2.artifacts, {3}

    def faulty(nonces, vecs):
        vecs = vecs.clone()
        for i, n in enumerate(nonces):
            if n in bad:
                vecs[i] = float("nan")
        return orig(nonces, vecs)

    monkeypatch.setattr(v2, "artifacts", faulty)
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2(P2["nonces"], wait=True, artifacts=val, stat_test=default_stat_test()))
    d = go_decode(await r.text(), ValidatedResultV2)
    assert r.status == 200 and (d["n_total"], d["n_mismatch"], d["fraud_detected"]) == (7, 0, False)
    assert (d["n_excluded"], d["excluded_nonces"]) == (1, [3]) and 3 not in [x["nonce"] for x in d["per_nonce"]]
    bad = {3, 6}
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2(P2["nonces"], wait=True, artifacts=val, stat_test=default_stat_test()))
    assert r.status == 503 and "no verdict" in json.loads(await r.text())["error"]
    r = await go_post(client, "/api/v1/inference/pow/generate",
                      generate_v2(P2["nonces"], url=str(srv.make_url("/poc/q")), artifacts=val,
                                  stat_test=default_stat_test()))
    rid = json.loads(await r.text())["request_id"]
    for _ in range(400):
        res = json.loads(await (await go_get(client, f"/api/v1/inference/pow/generate/{rid}")).text())
        if res["status"] not in ("queued", "running"):
            break
        await asyncio.sleep(0.05)
    assert res["status"] == "failed" and "2 of 8" in res["error"] and "fraud_detected" not in res
    await asyncio.sleep(0.3)
    assert rx.got["validated"] == []
