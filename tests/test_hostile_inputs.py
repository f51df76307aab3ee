"""Small hostile inputs: strings that cannot be encoded, NaN distances, huge values echoed back, a client that
leaves while a v1 model is being built."""

from __future__ import annotations

import asyncio
import io
import json
import math
import time

import numpy as np
import pytest

from poc.engine.compute import V1Compute
from poc.protocol import v1
from poc.server.app import create_app
from poc.server.stream import json_text

from .servers import POST, SET_A, metric, raw, server_config, v1_request, validate_request, wait_status



@pytest.fixture
async def client(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(max_body_bytes=4 << 20)))
    await wait_status(c)
    return c


async def test_a_lone_surrogate_is_a_400_at_validation(client):
    run = SET_A["runs"]["float16"]
    for path, body, field in (("/generate", v1_request(block_hash="a\ud800b"), "block_hash"),
                              ("/generate", v1_request(public_key="\udfff"), "public_key"),
                              ("/validate", validate_request(run, public_key="\ud800"), "public_key")):
        r = await client.post(path, data=json.dumps(body), headers={"Content-Type": "application/json"})
        ans = await r.json()
        assert r.status == 400 and ans["field"] == field and "surrogate" in ans["error"], (path, ans)
    assert (await (await client.get("/health")).json())["state"] == "ready"


async def test_a_huge_bad_value_is_echoed_as_a_short_prefix(client):
    huge = "x" * (3 << 20)
    for body in (v1_request(block_height=huge), v1_request(batch_size=[huge]), v1_request(dtype=huge)):
        r = await client.post("/generate", data=io.BytesIO(json.dumps(body).encode()),
                              headers={"Content-Type": "application/json"})
        text = await r.text()
        assert r.status == 400 and len(text) < 1000, text[:200]


def test_nan_or_infinite_recomputed_distances_are_invalid():
    batch = v1.ProofBatch(public_key="pk", block_hash="bh", block_height=1, nonces=[1, 2, 3], dist=[0.5, 0.5, 0.5],
                          node_id=0)
    vb = v1.validate_batch(batch, [0.5, math.nan, math.inf], 1.0, 1e-7)
    assert vb.n_invalid == 2 and vb.probability_honest < 1e-6
    text = json_text(vb.to_json())
    json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in {text}"))
    assert json.loads(text)["dist"] == [0.5, None, None]


async def test_validate_with_nan_distances_answers_strict_json_and_fails_them(client, monkeypatch):
    collect = V1Compute.collect

    def nan_collect(self, h):  # as params whose forward overflows would make them
        out = collect(self, h)
        out["dist"] = np.full_like(out["dist"], np.nan)
        return out

    monkeypatch.setattr(V1Compute, "collect", nan_collect)
    run = SET_A["runs"]["float16"]
    r = await client.post("/validate", json=validate_request(run))
    text = await r.text()
    assert r.status == 200
    vb = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the answer"))
    assert vb["n_invalid"] == len(vb["nonces"]) > 0 and vb["fraud_detected"] and vb["probability_honest"] < 1.0
    assert all(d is None for d in vb["dist"])


async def test_a_disconnect_during_a_v1_build_frees_the_device_within_a_second(client, capsys):
    big = dict(SET_A["params"], dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, vocab_size=4096)
    body = json.dumps(v1_request(params=big, batch_size=4, max_nonces=8)).encode()
    r, w = await raw(client, POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    t0 = time.monotonic()
    while (await (await client.get("/health")).json())["state"] != "busy":
        assert time.monotonic() - t0 < 30
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the build is under way (it takes several seconds on a CPU)
    w.close()
    t_close = time.monotonic()
    while (await (await client.get("/health")).json())["state"] != "ready":
        assert time.monotonic() - t_close < 10, "the build was not stopped"
        await asyncio.sleep(0.05)
    freed = time.monotonic() - t_close
    with capsys.disabled():
        print(f"\n[build] device free {freed:.2f} s after the client closed mid-build")
    m = await (await client.get("/metrics")).text()
    assert metric(m, 'poc_jobs_total{protocol="v1",reason="disconnect"}') == 1
    assert metric(m, 'poc_nonces_computed_total{protocol="v1"}') == 0  # it never got past the build
    assert freed < 1.0 + 0.5, freed  # a second, plus slack for a loaded machine


async def test_a_large_body_is_parsed_off_the_event_loop(client, monkeypatch):
    import threading

    from poc.server import schemas

    threads = []
    loads = json.loads

    def spy(raw, **kw):
        threads.append(threading.current_thread() is threading.main_thread())
        return loads(raw, **kw)

    monkeypatch.setattr(schemas.json, "loads", spy)
    small = v1_request(max_nonces=4, batch_size=4)
    r = await client.post("/generate", json=small)
    await r.read()
    big = v1_request(max_nonces=4, batch_size=4, pad="x" * (schemas.OFF_LOOP_BYTES + 1))  # refused, after parsing
    r = await client.post("/generate", data=io.BytesIO(json.dumps(big).encode()),
                          headers={"Content-Type": "application/json"})
    assert r.status == 400 and (await r.json())["field"] == "pad"
    assert threads == [True, False]  # the small body on the loop's thread, the large one elsewhere
