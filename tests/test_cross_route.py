"""One device, one GPU job: every route that wants the device, tried while another route's job runs.

A long root /generate first, then a /api/v1/pow generation first: each other route gets a 409 with a message
(/warmup, whose stream is already open when its params arrive, gets that as a line), or is queued where the API
says so (/api/v1/pow/generate without wait, v1 /api/v1/pow/validate), and the running job goes on unaffected.
/api/v1/pow/stop stops pow work only, never a root /generate.
"""

import asyncio
import time

from .fakes import FakeController, FakeOrchestrator, Lines
from .servers import (PARAMS_A, POW, SET_A, first_batch_line, gen_body, v1_request, v2_request, validate_request,
                      wait_job, wait_status)

BUSY = {"error": "busy: a job is already running", "field": None}


def _pow_v1_init(**kw):
    b = {"block_hash": v1_request()["block_hash"], "block_height": 3, "public_key": "pk", "r_target": 2.0,
         "params": dict(PARAMS_A), "node_id": 0, "node_count": 1, "batch_size": 2}
    b.update(kw)
    return b


async def _others_are_refused(client, ctl, orch, *, generating: bool) -> None:
    """Every other device route, while a job holds the device: a clear busy answer, at once."""
    t0 = time.monotonic()
    r = await client.post("/pooled", json={"orchestrator_url": orch.url})
    assert r.status == 409 and await r.json() == BUSY
    r = await client.post("/validate", json=validate_request(SET_A["runs"]["float16"]))
    assert r.status == 409 and await r.json() == BUSY
    r = await client.post(f"{POW}/generate", json=gen_body([0, 1], wait=True))
    assert r.status == 409 and "error" in await r.json()
    v2_init = {**{k: v for k, v in gen_body([]).items() if k != "nonces"}, "batch_size": 2}
    r = await client.post(f"{POW}/init/generate", json=v2_init)
    assert r.status == 409 and "error" in await r.json()
    r = await client.post(f"{POW}/init/generate", json=_pow_v1_init())
    assert r.status == 409 and "error" in await r.json()
    if not generating:
        r = await client.post(f"{POW}/init", json=_pow_v1_init())  # no device needed: accepted
        assert r.status == 200
        r = await client.post(f"{POW}/phase/generate")
        assert r.status == 409 and await r.json() == BUSY
    assert time.monotonic() - t0 < 3.0  # none of them waited for the device
    # /warmup: parked, it does not take the controller's params while the device is busy (they would only meet a
    # busy refusal and the controller's job would be lost); its poll line says so, and no job starts
    r = await client.post("/warmup", json={"callback_url": ctl.url, "job_id": "w"})
    lines = Lines(r)
    _, waiting, _ = await lines.wait(lambda d: d.get("status") == "warmup_waiting", 10)
    assert waiting["detail"] == "device busy" and ctl.polls == []
    r.close()


async def test_a_root_generate_keeps_the_device_against_every_other_route(client):
    ctl, orch = FakeController(params=v1_request(), ready_after=0), FakeOrchestrator()
    await ctl.start()
    await orch.start()
    try:
        r = await client.post("/generate", json=v1_request(batch_size=1, max_nonces=None, max_duration=60))
        first = await first_batch_line(r)
        gen = Lines(r)
        await _others_are_refused(client, ctl, orch, generating=False)
        # queued pow work is accepted and waits: it does not run beside /generate
        r2 = await client.post(f"{POW}/generate", json=gen_body([0, 1, 2]))
        assert r2.status == 200 and (await r2.json())["status"] == "queued"
        rid = (await r2.json())["request_id"]
        n0 = sum(1 for d in gen.lines() if "nonces" in d)
        await wait_status(client, ("busy",))
        assert (await (await client.get(f"{POW}/generate/{rid}")).json())["status"] == "queued"
        # /api/v1/pow/stop stops pow work, never the root /generate
        r3 = await client.post(f"{POW}/stop")
        assert r3.status == 200
        assert (await (await client.get(f"{POW}/generate/{rid}")).json())["status"] == "cancelled"
        t0 = time.monotonic()
        while sum(1 for d in gen.lines() if "nonces" in d) < n0 + 3:  # still streaming batches after the stop
            assert not gen.ended and time.monotonic() - t0 < 20, gen.lines()[-3:]
            await asyncio.sleep(0.02)
        h = await wait_status(client, ("busy",))
        assert h["job"]["label"].startswith("v1 /generate")
        assert "worker_id" in first and not any(d.get("status") == "done" for d in gen.lines())
        # a queued job taken while /generate runs runs once the device is free, and completes
        r4 = await client.post(f"{POW}/generate", json=gen_body([0, 1, 2]))
        rid4 = (await r4.json())["request_id"]
        assert (await (await client.get(f"{POW}/generate/{rid4}")).json())["status"] == "queued"
        r.close()
        d = await wait_job(client, rid4, "completed", timeout=30)
        assert [a["nonce"] for a in d["artifacts"]] == [0, 1, 2]
    finally:
        await ctl.stop()
        await orch.stop()


async def test_a_pow_generation_keeps_the_device_against_every_other_route(client, sink):
    ctl, orch = FakeController(params=v1_request(), ready_after=0), FakeOrchestrator()
    await ctl.start()
    await orch.start()
    try:
        body = {**{k: v for k, v in gen_body([]).items() if k != "nonces"}, "batch_size": 2, "url": sink.url}
        r = await client.post(f"{POW}/init/generate", json=body)
        assert r.status == 200
        await sink.wait("generated", 1)
        r = await client.post("/generate", json=v1_request())
        assert r.status == 409 and await r.json() == BUSY
        r = await client.post("/generate", json=v2_request())
        assert r.status == 409 and await r.json() == BUSY
        await _others_are_refused(client, ctl, orch, generating=True)
        st = await (await client.get(f"{POW}/status")).json()
        assert st["status"] == "GENERATING"
        r = await client.post(f"{POW}/stop")
        assert r.status == 200
        await wait_status(client)
        nonces = [a["nonce"] for p in sink.got["generated"] for a in p["artifacts"]]
        assert nonces == list(range(len(nonces)))  # the generation was not disturbed: every nonce once, in order
    finally:
        await ctl.stop()
        await orch.stop()


async def test_a_pooled_session_keeps_the_device(client, tmp_path):
    orch = FakeOrchestrator()
    orch.connect_reply = {"status": "ok", "block_hash": v1_request()["block_hash"], "block_height": 7,
                          "params": PARAMS_A, "r_target": 2.0}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 10 ** 7}
    ctl = FakeController(params=v1_request(), ready_after=0)
    await orch.start()
    await ctl.start()
    try:
        r = await client.post("/pooled", json={"orchestrator_url": orch.url, "batch_size": 5})
        assert r.status == 200
        lines = Lines(r)
        await lines.wait(lambda d: "idempotency_id" in d, 20)
        r2 = await client.post("/generate", json=v1_request())
        assert r2.status == 409 and await r2.json() == BUSY
        await _others_are_refused(client, ctl, orch, generating=False)
        n = len(lines.lines())
        await lines.wait(lambda d: "idempotency_id" in d, 20, start=n)  # the session goes on
        r.close()
    finally:
        await ctl.stop()
        await orch.stop()
