"""POST /api/v1/inference/up as a Gonka node sends it (mlnodeclient/client.go InferenceUp: {model, dtype "auto",
additional_args}, after Stop()): the served model is a no-op, another model comes only from the local Hugging Face
cache (a tmp dir here, laid out as huggingface_hub writes it), a failed load leaves no half state."""

import asyncio
import json
import threading

import numpy as np
import pytest

from poc.protocol import v2
from poc.server.app import create_app
from poc.server.context import engine_key
from poc.server.pow_service import pow_key

from .fakes import wait_until
from .golden import GOLDEN, V2_GOLDEN as G2
from .servers import QWEN3, hub_cache, server_config, wait_status
from .gonka_client import (NodeReceiver, StateResponseGo, VLLMModelsResponse, broker_status, generate_v2, go_decode,
                              go_get, go_post, init_generate_v2, params_v2)

LLAMA = GOLDEN / "v2_tiny" / "llama"
P2 = G2["parameters"]


def up(model, dtype="auto", args=None) -> list:
    """inferenceUpDto: Model, Dtype, Args (a nil slice: null)."""
    return [("model", model), ("dtype", dtype), ("additional_args", args)]


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache with the tiny llama as Org/Tiny-Llama, one missing its weights, one whose weights do not
    load; HF_HUB_CACHE points at it."""
    root = tmp_path / "hub"
    hub_cache(root, "Org/Tiny-Llama", LLAMA)
    hub_cache(root, "Org/Half", LLAMA, skip={"model.safetensors"})
    snap = hub_cache(root, "Org/Broken", LLAMA, skip={"model.safetensors"})
    (snap / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


async def served_ids(client) -> list[str]:
    r = await go_get(client, "/v1/models")
    assert r.status == 200, await r.text()
    return [m["id"] for m in go_decode(await r.text(), VLLMModelsResponse)["data"]]


async def test_inference_up_serves_a_second_checkpoint_from_the_hugging_face_cache(aiohttp_client, aiohttp_server,
                                                                                   hub):
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config(model=QWEN3, served_model_name=("Org/Tiny-Qwen3",))))
    await wait_status(client)
    engine = client.app[engine_key]
    qwen = engine.v2
    # the served model: a no-op
    r = await go_post(client, "/api/v1/inference/up", up("Org/Tiny-Qwen3"))
    assert r.status == 200 and json.loads(await r.text())["loaded"] is False and engine.v2 is qwen
    # not a Hub repo id: 400, nothing loaded; not in the cache, or only partly: 409 naming the cache
    for bad in ("../llama", str(LLAMA), "file:///x/y", "http://example.com/Org/Tiny-Llama", "Org/Tiny-Llama/..",
                "Org/..", "", None, 7):
        r = await go_post(client, "/api/v1/inference/up", up(bad))
        assert r.status == 400 and json.loads(await r.text())["field"] == "model", bad
    for absent in ("Org/Absent", "Org/Half"):
        r = await go_post(client, "/api/v1/inference/up", up(absent))
        d = json.loads(await r.text())
        # the cache named, not its path on this machine (a remote caller reads it)
        assert r.status == 409 and "HF_HUB_CACHE" in d["error"] and str(hub) not in d["error"], d
        assert absent in d["error"]
    r = await go_post(client, "/api/v1/inference/up", up("Org/Tiny-Llama", dtype="int4"))
    assert r.status == 400 and json.loads(await r.text())["field"] == "dtype"
    assert engine.v2 is qwen and await served_ids(client) == ["Org/Tiny-Qwen3"]

    # generation runs when the redeploy comes: it is stopped and what it computed delivered
    r = await go_post(client, "/api/v1/inference/pow/init/generate", init_generate_v2(str(srv.make_url("/poc/q"))))
    assert r.status == 200
    gen = client.app[pow_key].gen
    await wait_until(lambda: gen.runner.stats.computed > 0, 20, "generation")
    # the load held at its start, to look at the server meanwhile
    gate, orig = threading.Event(), engine._load
    engine._load = lambda: (gate.wait(20), orig())
    task = asyncio.create_task(go_post(client, "/api/v1/inference/up", up("Org/Tiny-Llama", args=["--tp", "1"])))
    h = await wait_status(client, want=("loading",))
    assert h["status"] == "loading" and not gen.active
    assert rx.got["generated"]  # delivered before the old model went
    assert (await go_get(client, "/v1/models")).status == 503
    assert (await go_get(client, "/readyz")).status == 503
    r = await go_post(client, "/api/v1/inference/up", up("Org/Tiny-Qwen3"))
    assert r.status == 409  # one load at a time
    r = await go_post(client, "/api/v1/inference/pow/generate", generate_v2([0], wait=True))
    assert r.status == 503
    gate.set()
    r = await task
    assert r.status == 200, await r.text()
    assert json.loads(await r.text()) == {"status": "OK", "model": "Org/Tiny-Llama", "loaded": True}
    del engine._load
    h = await wait_status(client)
    assert h["model"] == "Org/Tiny-Llama", h  # as /v1/models and /api/v1/state name it, not the snapshot hash

    # now the broker sees the new model, and the node's PoC runs on it: the golden llama artifacts
    assert await served_ids(client) == ["Org/Tiny-Llama"]
    st = go_decode(await (await go_get(client, "/api/v1/state")).text(), StateResponseGo)
    assert st["state"] == "INFERENCE" and await broker_status(client, "Org/Tiny-Llama") == "INFERENCE"
    body = generate_v2(P2["nonces"], wait=True)
    body[6] = ("params", params_v2(model="Org/Tiny-Llama"))
    r = await go_post(client, "/api/v1/inference/pow/generate", body)
    assert r.status == 200, await r.text()
    arts = json.loads(await r.text())["artifacts"]
    want = G2["models"]["llama"]["artifacts"]
    assert [a["nonce"] for a in arts] == [w["nonce"] for w in want]
    for a, w in zip(arts, want):
        assert np.linalg.norm(v2.decode(a["vector_b64"]) - np.array(w["vector_f32_from_f16"])) < 1e-3
    body[6] = ("params", params_v2(model="Org/Tiny-Qwen3"))  # the old one is gone
    assert (await go_post(client, "/api/v1/inference/pow/generate", body)).status == 409
    r = await go_post(client, "/api/v1/inference/up", up("Org/Tiny-Llama"))
    assert r.status == 200 and json.loads(await r.text())["loaded"] is False


async def test_a_failed_load_answers_503_and_leaves_no_half_state(aiohttp_client, hub):
    """The old model is unloaded before the new one loads: when that load fails the server serves no model and says
    why everywhere (503s, /health broken with the reason), until another /api/v1/inference/up loads one."""
    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    r = await go_post(client, "/api/v1/inference/up", up("Org/Broken"))
    d = json.loads(await r.text())
    assert r.status == 503 and "Org/Broken failed to load" in d["error"], d
    h = await (await client.get("/health")).json()
    assert h["state"] == "broken" and h["reason"].startswith("model load failed")
    assert h["model"] is None, h  # nothing is loaded: no name, least of all the checkpoint that failed
    assert str(hub) not in json.dumps(d) + json.dumps(h), (d, h)
    engine = client.app[engine_key]
    assert engine.v2 is None
    st = go_decode(await (await go_get(client, "/api/v1/state")).text(), StateResponseGo)
    assert st["state"] == "STOPPED"
    r = await go_get(client, "/v1/models")
    assert r.status == 503 and "model load failed" in json.loads(await r.text())["error"]
    r = await go_post(client, "/api/v1/inference/pow/generate", generate_v2([0], wait=True))
    assert r.status == 503 and "broken" in json.loads(await r.text())["error"]
    r = await go_post(client, "/api/v1/inference/up", up("Org/Tiny-Llama"))
    assert r.status == 200, await r.text()
    assert (await wait_status(client))["state"] == "ready" and await served_ids(client) == ["Org/Tiny-Llama"]
