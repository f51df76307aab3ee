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
    # large bodies on /generate too (its own limit is 64 KiB by default): these tests are about what a body holds
    c = await aiohttp_client(create_app(server_config(max_body_bytes=4 << 20, max_small_body_bytes=4 << 20)))
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


async def test_a_disconnect_during_a_v1_build_frees_the_device_within_a_second(client, capsys, caplog, monkeypatch):
    """The build checks its stop event at every drawn chunk of the pool: slowed to 50 ms a chunk (seconds for this
    model's pool), it is surely under way when the client leaves, and it must give up, not finish."""
    from poc.protocol import pool

    commit = pool.ArrayWriter.commit

    def slow_commit(self, at, n):
        time.sleep(0.05)
        return commit(self, at, n)

    monkeypatch.setattr(pool.ArrayWriter, "commit", slow_commit)
    caplog.set_level("INFO", logger="poc")
    big = dict(SET_A["params"], dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, vocab_size=4096)
    body = json.dumps(v1_request(params=big, batch_size=4, max_nonces=8)).encode()
    r, w = await raw(client, POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    t0 = time.monotonic()
    while (await (await client.get("/health")).json())["state"] != "busy":
        assert time.monotonic() - t0 < 30
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)  # the build is under way
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
    assert any("v1 model build stopped" in r.getMessage() for r in caplog.records), "the build ran to its end"
    assert freed < 1.0 + 0.5, freed  # the client watch's 0.2 s and a chunk, plus slack for a loaded machine


async def test_a_large_body_is_parsed_off_the_event_loop_in_steps(client, monkeypatch):
    """A small body is parsed by json.loads on the loop; a large one by bigjson.loads on its thread (json's C parser
    would hold the GIL, and so the loop, for the whole body), within the values a real request can hold."""
    import threading

    from poc.server import bigjson, fields

    seen = []
    loads, steps = json.loads, bigjson.loads

    def spy(name, f):
        def call(*a, **kw):
            seen.append((name, threading.current_thread() is threading.main_thread()))
            return f(*a, **kw)
        return call

    monkeypatch.setattr(fields.json, "loads", spy("json", loads))
    monkeypatch.setattr(bigjson, "loads", spy("steps", steps))
    small = v1_request(max_nonces=4, batch_size=4)
    r = await client.post("/generate", json=small)
    await r.read()
    big = v1_request(max_nonces=4, batch_size=4, pad="x" * (fields.OFF_LOOP_BYTES + 1))  # refused, after parsing
    r = await client.post("/generate", data=io.BytesIO(json.dumps(big).encode()),
                          headers={"Content-Type": "application/json"})
    assert r.status == 400 and (await r.json())["field"] == "pad"
    assert seen == [("json", True), ("steps", False)]  # the small body on the loop's thread, the large one elsewhere
    many = {**small, "pad": [0] * (500_000)}  # more values than 100,000 nonces and their artifacts can be
    r = await client.post("/generate", data=io.BytesIO(json.dumps(many).encode()),
                          headers={"Content-Type": "application/json"})
    assert r.status == 400 and "more than 404096 JSON values" in (await r.json())["error"]
    assert (await client.get("/health")).status == 200


def test_the_stepwise_parser_equals_json_loads():
    """bigjson.loads against json.loads: random documents in every layout and encoding, and the malformed ones."""
    import random

    from poc.server import bigjson

    rng = random.Random(29)

    def doc(depth=0):
        r = rng.random()
        if depth > 5 or r < 0.4:
            return rng.choice([rng.randint(-10**20, 10**20), rng.random() * 1e5, f"s\u00e9\"\\\n{rng.random()}", True,
                               False, None, ""])
        if r < 0.7:
            return [doc(depth + 1) for _ in range(rng.randint(0, 4))]
        return {str(rng.random())[:5]: doc(depth + 1) for _ in range(rng.randint(0, 4))}

    for _ in range(200):
        d = doc()
        for text in (json.dumps(d), json.dumps(d, indent=2), json.dumps(d, separators=(",", ":")),
                     json.dumps(d, ensure_ascii=False)):
            assert bigjson.loads(text) == json.loads(text)
            for enc in ("utf-8", "utf-16", "utf-32"):
                assert bigjson.loads(text.encode(enc)) == json.loads(text.encode(enc))

    def no_constant(name):
        raise ValueError(name)

    for bad in ("", " ", "[", "{", "[1,]", '{"a":1,}', "[1 2]", '{"a" 1}', "{1:2}", '{"a":}', "[1]x", "[-]", "[01]",
                "[NaN]", "[Infinity]", '"\\x"', "tru", "[1,,2]"):
        with pytest.raises(ValueError):
            json.loads(bad, parse_constant=no_constant)
        with pytest.raises(ValueError):
            bigjson.loads(bad, parse_constant=no_constant)
    with pytest.raises(RecursionError):
        bigjson.loads("[" * 1001 + "]" * 1001)
    assert bigjson.loads("[" * 500 + "]" * 500) == json.loads("[" * 500 + "]" * 500)
    with pytest.raises(ValueError, match="more than 3 JSON objects"):
        bigjson.loads("[[], [], [], 1]", max_containers=3)
    assert bigjson.loads("[[], [], 1]", max_values=4, max_containers=3) == [[], [], 1]
