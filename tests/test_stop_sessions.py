"""Stop means stop: /api/v1/stop, /api/v1/inference/pow/stop, /api/v1/inference/up and shutdown end every session
that holds or waits for the device, a /pooled or /warmup session included, and what it computed is still delivered.

- a /pooled session whose orchestrator answers connect with {"status": "wait"} (then its client goes away) holds no
  device while it waits (/health ready, other jobs run), and each kind of stop ends it within a second (the
  orchestrator gets its /shutdown); an inference/up right after it loads the model at once;
- a computing /pooled session ends at /api/v1/stop (it used to start its job again), every streamed result
  acknowledged by the orchestrator;
- a /warmup waiting for its params ends at /api/v1/stop with {"status": "stopped"}.
v1 set A params (dim 64, 2 layers, vocab 256, seq_len 8) on the CPU; the tiny llama from a tmp Hugging Face cache.
"""

import asyncio
import json
import time

import aiohttp
import pytest

from poc.server.app import create_app
from poc.server.context import engine_key
from poc.server.pooled import sessions_key

from .fakes import FakeController, FakeOrchestrator, LoopbackApp, Lines, is_result, status, wait_until
from .golden import GOLDEN, V1_GOLDEN as G1
from .servers import PARAMS_A, hub_cache, pooled_config, v1_request, wait_status

LLAMA = GOLDEN / "v2_tiny" / "llama"
BH = G1["block_hash"]
STOPS = {"api/v1/stop": "/api/v1/stop", "inference/pow/stop": "/api/v1/inference/pow/stop"}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    hub_cache(root, "Org/Tiny-Llama", LLAMA)
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


async def _shutdown_seen(orch: FakeOrchestrator) -> float:
    while not orch.shutdowns:
        await asyncio.sleep(0.005)
    return time.monotonic()


@pytest.mark.parametrize("kind", ["api/v1/stop", "inference/pow/stop", "inference/up", "shutdown"])
async def test_a_pooled_session_waiting_for_its_block_hash_holds_no_device_and_every_stop_ends_it(tmp_path, hub,
                                                                                                 kind):
    """As model_server.py serves (web.run_app: a gone client does not cancel the handler, so the session lives on
    for its orchestrator); aiohttp's TestServer would cancel it with the connection."""
    orch = await FakeOrchestrator().start()  # connect answers {"status": "wait"}; config never has a block hash
    srv = await LoopbackApp(create_app(pooled_config(tmp_path, pooled_wait_timeout=600.0))).start()
    try:
        async with aiohttp.ClientSession(srv.url) as http:
            await wait_until(lambda: srv.app[engine_key].state == "ready", 10.0, "the server to be ready")
            resp = await http.post("/pooled", json={"orchestrator_url": orch.url})
            assert resp.status == 200
            lines = Lines(resp)
            await lines.wait(status("waiting_block_hash"))
            resp.close()  # the client goes away, as a caller that only wanted to tie the device up
            await lines.finish()
            # waiting, the session holds nothing: /health says ready and another job runs
            h = await (await http.get("/health")).json()
            assert h["state"] == "ready" and h["job"] is None, h
            async with http.post("/generate", json=v1_request(max_nonces=5)) as r:
                assert r.status == 200 and json.loads((await r.text()).splitlines()[-1])["status"] == "done"
            assert len(srv.app[sessions_key]) == 1 and not orch.shutdowns

            seen = asyncio.create_task(_shutdown_seen(orch))
            t0 = time.monotonic()
            if kind == "shutdown":
                await srv.stop()  # SIGTERM's path: on_shutdown, then aiohttp waits for the open handlers
            elif kind == "inference/up":
                async with http.post("/api/v1/inference/up", json={"model": "Org/Tiny-Llama", "dtype": "auto"}) as r:
                    assert r.status == 200, await r.text()
                    assert (await r.json())["loaded"] is True
            else:
                async with http.post(STOPS[kind]) as r:
                    assert r.status == 200, await r.text()
            ended = await asyncio.wait_for(seen, 5.0)
            assert ended - t0 < 1.0, f"{kind}: the session ended {ended - t0:.2f} s after the stop"
            await wait_until(lambda: not srv.app[sessions_key], 1.0, "the session to leave the registry")
            assert orch.shutdowns[0]["stats"]["reason"] == ("server_shutdown" if kind == "shutdown" else "stopped")
            if kind in STOPS:  # the device is free: a redeploy right after the stop loads at once
                t1 = time.monotonic()
                async with http.post("/api/v1/inference/up", json={"model": "Org/Tiny-Llama", "dtype": "auto"}) as r:
                    assert r.status == 200, await r.text()
                assert time.monotonic() - t1 < 30.0
                h = await (await http.get("/health")).json()
                assert h["state"] == "ready", h
    finally:
        await srv.stop()
        await orch.stop()


async def test_a_computing_pooled_session_ends_at_api_stop_and_its_results_are_delivered(aiohttp_client, tmp_path,
                                                                                          orch):
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 10**9, "r_target": 2.0}
    client = await aiohttp_client(create_app(pooled_config(tmp_path)))
    await wait_status(client)
    resp = await client.post("/pooled", json={"orchestrator_url": orch.url, "batch_size": 20})
    assert resp.status == 200
    lines = Lines(resp)
    await lines.wait(is_result)
    t0 = time.monotonic()
    r = await client.post("/api/v1/stop")
    assert r.status == 200
    out = await lines.finish(10.0)
    stopping = [d for d in out if d.get("status") == "stopping"]
    assert stopping == [{"status": "stopping", "reason": "stopped"}], out[-5:]
    assert out[-1]["status"] == "shutdown" and "pending_results" not in out[-1]
    streamed = {d["idempotency_id"] for d in out if is_result(d)}
    assert streamed and streamed <= set(orch.accepted)  # every computed batch reached the orchestrator
    assert orch.shutdowns and orch.shutdowns[-1]["stats"]["reason"] == "stopped"
    h = await wait_status(client, timeout=1.0)
    assert h["job"] is None and time.monotonic() - t0 < 5.0


async def test_a_warmup_waiting_for_its_params_ends_at_api_stop(aiohttp_client, tmp_path):
    ctl = await FakeController(params=None).start()  # never ready
    try:
        client = await aiohttp_client(create_app(pooled_config(tmp_path, warmup_poll_interval=5.0)))
        await wait_status(client)
        resp = await client.post("/warmup", json={"callback_url": ctl.url, "job_id": "w1"})
        lines = Lines(resp)
        await lines.wait(status("warmup_waiting"))
        t0 = time.monotonic()
        assert (await client.post("/api/v1/stop")).status == 200
        t, d, _ = await lines.wait(status("stopped"), timeout=5.0)
        assert t - t0 < 1.0
        await lines.finish(5.0)
    finally:
        await ctl.stop()
