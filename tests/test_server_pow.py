"""/api/v1/pow/* in-process: v2 (spec-v2 §e, with §f 7-12 fixed) and v1 (spec-v1 §4.5), callbacks included.

Callbacks go to a small aiohttp app on 127.0.0.1 that records what it receives.
"""

import asyncio
import time

import numpy as np
import pytest

from poc.clients.callbacks import CallbackSender
from poc.errors import InputError
from poc.model.config import PRESETS
from poc.protocol import v2
from poc.server.app import create_app
from poc.server.config import parse_args
from poc.server.context import sender_key
from poc.server.pow_service import pow_key
from poc.server.schemas import ServedModel

from .golden import V1_GOLDEN as G1, V2_GOLDEN as G2
from .servers import (P2, PARAMS_A, POW, QWEN3, SET_A, Sink, gen_body, server_config, validate_request, wait_job,
                      wait_status)

GOLDEN = G2["models"]["qwen3"]["artifacts"]


def golden_validation(corrupt=()) -> dict:
    arts = []
    for a in GOLDEN:
        b64 = a["vector_b64"]
        if a["nonce"] in corrupt:
            b64 = v2.encode(-v2.decode(b64))  # the opposite direction: L2 = 2
        arts.append({"nonce": a["nonce"], "vector_b64": b64})
    return {"artifacts": arts}


async def poll_result(client, rid: str, timeout: float = 20.0) -> dict:
    t0 = time.monotonic()
    while True:
        r = await client.get(f"{POW}/generate/{rid}")
        d = await r.json()
        if d["status"] not in ("queued", "running"):
            return d
        assert time.monotonic() - t0 < timeout, d
        await asyncio.sleep(0.05)


# --------------------------------------------------------------------------------------------------
# v2


async def test_generate_wait_golden_and_validation(client):
    r = await client.post(f"{POW}/generate", json=gen_body(P2["nonces"], wait=True))
    assert r.status == 200
    d = await r.json()
    assert d["status"] == "completed" and d["encoding"] == {"dtype": "f16", "k_dim": 12, "endian": "le"}
    assert [a["nonce"] for a in d["artifacts"]] == P2["nonces"]
    for a, w in zip(d["artifacts"], GOLDEN):
        assert np.linalg.norm(v2.decode(a["vector_b64"]) - np.array(w["vector_f32_from_f16"])) < 1e-3
    assert "dropped_nonces" not in d
    # the golden artifacts validate clean
    r = await client.post(f"{POW}/generate", json=gen_body(P2["nonces"], wait=True, validation=golden_validation()))
    d = await r.json()
    assert (d["n_total"], d["n_mismatch"], d["fraud_detected"]) == (8, 0, False)
    # one flipped vector and one that does not decode: both mismatches, not a 400/500 (spec-v2 §f 8)
    val = golden_validation(corrupt={3})
    val["artifacts"][5]["vector_b64"] = "not base64!"
    r = await client.post(f"{POW}/generate", json=gen_body(P2["nonces"], wait=True, validation=val,
                                                            stat_test={"dist_threshold": 0.02, "p_mismatch": 0.001,
                                                                       "fraud_threshold": 0.01}))
    d = await r.json()
    assert r.status == 200 and d["n_mismatch"] == 2 and sorted(d["mismatch_nonces"]) == [3, 5]
    assert d["fraud_detected"] is True


async def test_results_keep_the_request_order_when_batches_arrive_out_of_order(aiohttp_client, monkeypatch):
    """Replicas deliver batches in completion order: /generate's artifacts and /validate's distances still follow
    the request's nonces (each distance scored against its own nonce's claim)."""
    from poc.engine.engine import Engine
    from poc.engine import factory
    from poc.server import jobs

    from .fakes import ReversedArrivalEngine

    monkeypatch.setattr(factory, "Engine", ReversedArrivalEngine.make(Engine))
    monkeypatch.setattr(jobs, "VALIDATE_BATCH_SIZE", 5)  # 16 nonces: 4 batches
    c = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(c)
    r = await c.post(f"{POW}/generate", json=gen_body(P2["nonces"], wait=True))
    d = await r.json()
    assert [a["nonce"] for a in d["artifacts"]] == P2["nonces"]
    for a, w in zip(d["artifacts"], GOLDEN):
        assert np.linalg.norm(v2.decode(a["vector_b64"]) - np.array(w["vector_f32_from_f16"])) < 1e-3
    run = SET_A["runs"]["float16"]
    r = await c.post("/validate", json=validate_request(run, nonces=run["nonces"], dist=run["dist"]))
    vb = await r.json()
    assert r.status == 200 and vb["nonces"] == run["nonces"]
    assert np.abs(np.array(vb["dist"]) - np.array(run["dist"])).max() < 1e-3
    assert vb["n_invalid"] == len(run["nonces"]) - len(run["nonces_below_r_target"])


async def test_queue_fifo_results_callbacks_and_stop_keeps_results(client, sink):
    r1 = await client.post(f"{POW}/generate", json=gen_body(range(6), url=sink.url))
    r2 = await client.post(f"{POW}/generate", json=gen_body(P2["nonces"], url=sink.url,
                                                             validation=golden_validation()))
    a, b = await r1.json(), await r2.json()
    assert a["status"] == b["status"] == "queued" and a["queued_count"] == 6
    ra = await poll_result(client, a["request_id"])
    rb = await poll_result(client, b["request_id"])
    assert ra["status"] == "completed" and [x["nonce"] for x in ra["artifacts"]] == list(range(6))
    assert rb["status"] == "completed" and rb["n_mismatch"] == 0 and rb["fraud_detected"] is False
    gen = (await sink.wait("generated"))[0]
    assert gen["request_id"] == a["request_id"] and gen["artifacts"] == ra["artifacts"]
    assert {"block_hash", "block_height", "public_key", "node_id", "encoding"} <= set(gen)
    val = (await sink.wait("validated"))[0]
    assert val["request_id"] == b["request_id"] and val["n_mismatch"] == 0
    assert set(sink.keys) == {a["request_id"], b["request_id"]}
    # the queue is bounded (max_queued_nonces=40 here): 429, not unbounded memory
    r = await client.post(f"{POW}/generate", json=gen_body(range(41)))
    assert r.status == 429 and (await r.json())["field"] == "nonces"
    # /stop cancels what is queued or running but keeps completed results readable (spec-v2 §f 12)
    r = await client.post(f"{POW}/generate", json=gen_body(range(100, 130), batch_size=1))
    c = await r.json()
    r = await client.post(f"{POW}/stop")
    assert await r.json() == {"status": "OK", "pow_status": {"status": "STOPPED"}}
    assert (await poll_result(client, c["request_id"]))["status"] == "cancelled"
    assert (await poll_result(client, a["request_id"]))["status"] == "completed"
    r = await client.get(f"{POW}/generate/no-such-id")
    assert r.status == 404 and (await r.json())["field"] == "request_id"
    await wait_status(client)


async def test_a_request_without_batch_size_gets_the_engines_default(client, sink):
    """The node sends no batch_size: /init/generate and /generate (explicit nonces) take the engine's
    default_v2_batch for the request's seq_len (the loaded model on its layout); a given batch_size is kept."""
    from poc.server.context import engine_key

    engine = client.server.app[engine_key]
    asked = []
    engine.default_v2_batch = lambda seq_len, headroom, cap: asked.append((seq_len, headroom, cap)) or 5
    body = {k: v for k, v in gen_body([]).items() if k not in ("nonces", "batch_size")}
    r = await client.post(f"{POW}/init/generate", json={**body, "url": sink.url})
    assert r.status == 200, await r.text()
    app = client.server.app
    assert app[pow_key].gen.init.batch_size == 5 and asked == [(P2["seq_len"], 0.9, 4096)]
    await client.post(f"{POW}/stop")
    await wait_status(client)
    r = await client.post(f"{POW}/generate", json={**gen_body(range(7), wait=True), "batch_size": None})
    assert r.status == 200 and len((await r.json())["artifacts"]) == 7 and len(asked) == 2
    r = await client.post(f"{POW}/generate", json=gen_body(range(7), wait=True))  # batch_size 3: kept
    assert r.status == 200 and len(asked) == 2


async def test_init_generate_status_busy_and_stop_delivers_everything(client, sink):
    body = {k: v for k, v in gen_body([]).items() if k != "nonces"}
    body.update(batch_size=4, url=sink.url)
    r = await client.post(f"{POW}/init/generate", json=body)
    assert await r.json() == {"status": "OK", "pow_status": {"status": "GENERATING"}}
    await sink.wait("generated", 2)
    st = await (await client.get(f"{POW}/status")).json()
    assert st["status"] == "GENERATING" and st["config"]["node_count"] == 1 and st["config"]["k_dim"] == 12
    assert st["stats"]["total_processed"] > 0
    # everything else that wants the device gets 409 at once (no blocking wait: spec-v2 §f 11)
    t0 = time.monotonic()
    r = await client.post(f"{POW}/init/generate", json=body)
    assert r.status == 409 and "Already generating" in (await r.json())["error"]
    r = await client.post(f"{POW}/generate", json=gen_body([0, 1], wait=True))
    assert r.status == 409
    r = await client.post("/generate", json={**{k: v for k, v in body.items() if k != "url"}, "max_nonces": 4})
    assert r.status == 409
    assert time.monotonic() - t0 < 1.0
    r = await client.post(f"{POW}/stop")
    assert (await r.json())["pow_status"]["status"] == "STOPPED"
    st = await (await client.get(f"{POW}/status")).json()
    assert st["status"] == "IDLE"
    # /stop flushed the buffer: every computed nonce was delivered, once, in order
    await wait_status(client)
    sender = client.server.app[sender_key]
    assert await sender.flush(5) == 0
    nonces = [a["nonce"] for p in sink.got["generated"] for a in p["artifacts"]]
    assert nonces == list(range(len(nonces)))
    text = await (await client.get("/metrics")).text()
    assert f'poc_nonces_computed_total{{protocol="v2"}} {float(len(nonces))}' in text


async def test_stat_test_bounds_are_closed_and_unknown_keys_ignored(client):
    """stat_test is a plain object in the reference (extra keys ignored, any float): a threshold of 0 is valid."""
    r = await client.post(f"{POW}/generate", json=gen_body([0, 1], wait=True))
    arts = (await r.json())["artifacts"]
    st = {"dist_threshold": 0.0, "p_mismatch": 0.0, "fraud_threshold": 0.0, "alpha": 0.05}
    r = await client.post(f"{POW}/generate", json=gen_body([0, 1], wait=True, validation={"artifacts": arts},
                                                            stat_test=st))
    assert r.status == 200, await r.text()
    d = await r.json()
    assert (d["n_total"], d["n_mismatch"], d["p_value"], d["fraud_detected"]) == (2, 0, 1.0, False)
    r = await client.post(f"{POW}/generate", json=gen_body([0], wait=True, stat_test={"p_mismatch": 1.5}))
    assert r.status == 400 and (await r.json())["field"] == "stat_test.p_mismatch"


def test_served_names_cover_the_hf_repo_id():
    """check_params_match accepts the model path or a served name (spec-v2 §e); an MLNode sends the repo id."""
    cfg = PRESETS["tiny"]
    snap = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-0.6B/snapshots/0123abcd"
    names = ServedModel.of(snap, cfg).names
    assert "Qwen/Qwen3-0.6B" in names and snap in names
    assert ServedModel.of("/m/qwen3", cfg, ["Org/Tiny", "tiny"]).names[:2] == ["Org/Tiny", "tiny"]
    c = parse_args(["--served-model-name", "Org/A", "B"], {})
    assert c.served_model_name == ("Org/A", "B")
    assert parse_args([], {"POC_SERVED_MODEL_NAME": "Org/A, B"}).served_model_name == ("Org/A", "B")


async def test_served_model_name_is_accepted_as_params_model(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(model=QWEN3, served_model_name=("Org/Tiny-Qwen3",))))
    await wait_status(c)
    body = gen_body([0], wait=True, params={"model": "Org/Tiny-Qwen3", "seq_len": 4})
    r = await c.post(f"{POW}/generate", json=body)
    assert r.status == 200, await r.text()
    r = await c.post(f"{POW}/generate", json={**body, "params": {"model": "Org/Other", "seq_len": 4}})
    assert r.status == 409 and "Org/Tiny-Qwen3" in (await r.json())["deployed"]["model"]


@pytest.fixture
async def big_queue_client(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(c)
    return c


async def test_init_generate_preempts_a_running_queued_job(big_queue_client, sink):
    """The reference's queue waits while /init/generate runs (spec-v2 §e.1, §e.2): generation is not refused
    because a queued /generate holds the device; that job goes back to the head of the queue."""
    client = big_queue_client
    r = await client.post(f"{POW}/generate", json=gen_body(range(5000), batch_size=1))
    rid = (await r.json())["request_id"]
    await wait_job(client, rid, "running")
    body = {k: v for k, v in gen_body([]).items() if k != "nonces"}
    r = await client.post(f"{POW}/init/generate", json={**body, "batch_size": 4, "url": sink.url})
    assert r.status == 200, await r.text()
    assert (await (await client.get(f"{POW}/status")).json())["status"] == "GENERATING"
    assert (await (await client.get(f"{POW}/generate/{rid}")).json())["status"] == "queued"
    await sink.wait("generated")
    r = await client.post(f"{POW}/stop")
    assert (await (await client.get(f"{POW}/generate/{rid}")).json())["status"] == "cancelled"
    assert client.app[pow_key]._running is None  # the queue was emptied before generation freed the device
    # shutdown while a queued job runs: the job stops after its batch and the server closes (no hang)
    r = await client.post(f"{POW}/generate", json=gen_body(range(5000), batch_size=1))
    rid = (await r.json())["request_id"]
    await wait_job(client, rid, "running")
    svc = client.app[pow_key]
    await asyncio.wait_for(client.close(), 30)
    assert svc.jobs[rid].status == "cancelled" and svc._worker.done()


async def test_generate_wait_goes_before_the_queue(big_queue_client):
    """wait=true is served while a queued job runs (the reference interleaves them); the queued job still
    completes, with every nonce."""
    client = big_queue_client
    r = await client.post(f"{POW}/generate", json=gen_body(range(300), batch_size=1))
    rid = (await r.json())["request_id"]
    await wait_job(client, rid, "running")
    r = await client.post(f"{POW}/generate", json=gen_body(P2["nonces"], wait=True))
    assert r.status == 200, await r.text()
    assert [a["nonce"] for a in (await r.json())["artifacts"]] == P2["nonces"]
    d = await wait_job(client, rid, "completed", timeout=60)
    assert [a["nonce"] for a in d["artifacts"]] == list(range(300))


def test_init_generate_takes_any_node_layout_the_reference_takes():
    """The reference's NonceIterator has no node_id < node_count check (spec-v2 §e.1): an MLNode whose node
    numbers have gaps still generates, on the same lattice node_id + group_id*node_count + x*node_count*n_groups."""
    from poc.server.config import ServerConfig
    from poc.engine.jobs import take
    from poc.server.schemas import parse_pow_v2_init

    served = ServedModel(["qwen3"], 4096, 64)
    body = {"block_hash": "b", "block_height": 1, "public_key": "p", "node_id": 3, "node_count": 2, "group_id": 2,
            "n_groups": 2, "params": {"model": "qwen3", "seq_len": 4}}
    init = parse_pow_v2_init(body, ServerConfig(), served)
    assert take(init.job().nonces, 3) == [3 + 2 * 2, 3 + 2 * 2 + 4, 3 + 2 * 2 + 8]
    for bad in ({"node_id": -1}, {"node_count": 0}, {"group_id": -1}, {"n_groups": 0}):
        with pytest.raises(InputError):
            parse_pow_v2_init({**body, **bad}, ServerConfig(), served)


# --------------------------------------------------------------------------------------------------
# v1


async def test_v1_pow_flow(client, sink):
    r = await client.post(f"{POW}/phase/generate")
    assert r.status == 409  # not initialized
    init = {"node_id": 0, "node_count": 1, "block_hash": G1["block_hash"], "block_height": 5,
            "public_key": G1["public_key"], "batch_size": 8, "r_target": 2.0, "fraud_threshold": 1e-7,
            "params": dict(PARAMS_A), "url": sink.url}
    r = await client.post(f"{POW}/init/generate", json=init)
    assert await r.json() == {"status": "OK", "pow_status": {"status": "GENERATING"}}
    got = await sink.wait("generated", 1)
    # the reference's keys in its order; a merged POST adds the ids of the records it carries at the end
    assert [k for k in got[0] if k != "record_ids"] == ["public_key", "block_hash", "block_height", "nonces", "dist",
                                                         "node_id"]
    st = await (await client.get(f"{POW}/status")).json()
    assert st["status"] == "GENERATING" and st["is_model_initialized"] is True
    r = await client.post(f"{POW}/phase/validate")
    assert (await r.json())["pow_status"]["status"] == "VALIDATING"
    assert (await (await client.get(f"{POW}/status")).json())["status"] == "VALIDATING"
    batch = {**got[0], "nonces": got[0]["nonces"][:16], "dist": got[0]["dist"][:16]}  # a validator's sample
    r = await client.post(f"{POW}/validate", json={**batch, "block_hash": "other"})
    assert r.status == 400 and (await r.json())["field"] == "block_hash"
    r = await client.post(f"{POW}/validate", json=batch)
    assert r.status == 200, await r.text()
    rid = (await r.json())["request_id"]
    res = await poll_result(client, rid)
    assert res["status"] == "completed" and res["n_invalid"] == 0 and res["fraud_detected"] is False
    vb = (await sink.wait("validated"))[0]
    assert vb["nonces"] == batch["nonces"] and vb["received_dist"] == batch["dist"] and vb["n_invalid"] == 0
    np.testing.assert_allclose(vb["dist"], batch["dist"], rtol=0, atol=0)  # same dtype, same device
    r = await client.post(f"{POW}/stop")
    assert (await r.json())["pow_status"]["status"] == "STOPPED"
    assert (await (await client.get(f"{POW}/status")).json())["status"] == "IDLE"


# --------------------------------------------------------------------------------------------------
# the callback sender


async def test_callback_sender_retries_with_the_same_key(aiohttp_server):
    s = Sink(fail_first=2)
    srv = await aiohttp_server(s.app)
    sender = CallbackSender(timeout=2, backoff_base=0.05)
    await sender.start()
    try:
        assert sender.submit("generated", str(srv.make_url("/cb")), {"x": 1}, "id-1")
        assert await sender.flush(5) == 0
        assert s.got["generated"] == [{"x": 1}] and s.keys == ["id-1"]
        full = CallbackSender(max_pending=1, backoff_base=10)
        await full.start()
        assert full.submit("validated", "http://127.0.0.1:9/", {}, "a")  # nothing listens there
        assert not full.submit("validated", "http://127.0.0.1:9/", {}, "b")  # bounded: refused, not silent
        await full.close(timeout=0.1)
    finally:
        await sender.close(1)


async def test_an_interval_of_many_small_batches_is_one_merged_post(aiohttp_server):
    # 120 batches held in one interval (small batches on a fast GPU) go out as one POST, not batch_max-sized pieces
    s = Sink()
    srv = await aiohttp_server(s.app)
    url = str(srv.make_url("/cb"))
    sender = CallbackSender(timeout=2, backoff_base=0.05, batch_max=50)
    await sender.start()
    try:
        for i in range(120):
            assert sender.submit("generated", url, {"public_key": "pk", "nonces": [i]}, f"g-{i}", merge="g")
        await asyncio.sleep(0.2)
        sender.release("g", final=True)
        assert await sender.flush(5) == 0
        assert [p["nonces"] for p in s.got["generated"]] == [list(range(120))]
    finally:
        await sender.close(1)


async def test_callback_sender_holds_merge_records_until_released_and_retries_the_merged_post_whole(aiohttp_server):
    s = Sink(fail_first=1)
    srv = await aiohttp_server(s.app)
    url = str(srv.make_url("/cb"))
    sender = CallbackSender(timeout=2, backoff_base=0.05)
    await sender.start()
    try:
        head = {"public_key": "pk", "node_id": 0}
        assert sender.submit("generated", url, {**head, "artifacts": [1, 2]}, "g-1", merge="g")
        assert sender.submit("generated", url, {**head, "artifacts": [3], "dropped_nonces": [9]}, "g-2", merge="g")
        assert sender.submit("generated", url, {**head, "artifacts": [4]}, "g-3", merge="g")
        await asyncio.sleep(0.2)
        assert s.got["generated"] == [] and s.fail_first == 1 and sender.pending == 3  # held: not even tried
        sender.release("g", final=True)
        assert await sender.flush(5) == 0
        assert s.got["generated"] == [{**head, "artifacts": [1, 2, 3, 4], "dropped_nonces": [9],
                                       "record_ids": ["g-1", "g-2", "g-3"]}]
        # one short key for the merged POST (the ids are in the body); the refused POST was re-sent as it was
        assert len(s.keys) == 1 and s.keys[0].startswith("merged-") and len(s.keys[0]) < 64 and s.fail_first == 0
        assert sender.submit("generated", url, {**head, "artifacts": [5]}, "g-4", merge="g")  # after the end
        assert await sender.flush(5) == 0 and s.got["generated"][-1]["artifacts"] == [5]
    finally:
        await sender.close(1)


async def test_v1_init_routes_switch_phase_while_generating(client, sink):
    """An MLNode goes from generation to validation with POST /init/validate and no stop in between (its
    InitValidateNodeCommandV1 leaves a node in POW state running); the reference then switches the phase, restarting
    only for a different init. /init/generate with the same init while generating is a no-op, with another one a
    restart; /init stops generation (IDLE). None of these is a 409."""
    init = {"node_id": 0, "node_count": 1, "block_hash": G1["block_hash"], "block_height": 5,
            "public_key": G1["public_key"], "batch_size": 8, "r_target": 2.0, "fraud_threshold": 1e-7,
            "params": dict(PARAMS_A), "url": sink.url}

    async def post(path, body):
        r = await client.post(f"{POW}{path}", json=body)
        assert r.status == 200, await r.text()
        return (await r.json())["pow_status"]["status"]

    async def status():
        return await (await client.get(f"{POW}/status")).json()

    assert await post("/init/generate", init) == "GENERATING"
    first = client.app[pow_key].gen
    assert await post("/init/generate", init) == "GENERATING"
    assert client.app[pow_key].gen is first and first.active  # same init: not restarted
    assert await post("/phase/generate", None) == "GENERATING"
    assert client.app[pow_key].gen is first and first.active
    await sink.wait("generated", 1)
    assert await post("/init/validate", init) == "VALIDATING"
    assert not first.active and (await status())["status"] == "VALIDATING"
    assert await post("/init/generate", init) == "GENERATING"
    second = client.app[pow_key].gen
    assert await post("/init/generate", {**init, "block_height": 6}) == "GENERATING"  # another init: restarted
    st = await status()
    assert not second.active and client.app[pow_key].gen.active and st["config"]["block_height"] == 6
    assert await post("/init", init) == "IDLE"
    assert not client.app[pow_key].gen.active and (await status())["status"] == "IDLE"
    await client.post(f"{POW}/stop")


async def test_v1_validate_scores_what_the_reference_scores(client, sink):
    """/api/v1/pow/validate takes any ProofBatch the reference's pydantic model takes and scores it: an empty one
    (n_invalid 0, probability_honest 1.0), repeated nonces (each occurrence scored, as InValidation's per-nonce map
    does) and negative ones (a node's on-chain batch can hold them; a 400 would leave the validator no verdict)."""
    init = {"node_id": 0, "node_count": 1, "block_hash": G1["block_hash"], "block_height": 5,
            "public_key": G1["public_key"], "batch_size": 8, "r_target": 2.0, "fraud_threshold": 1e-7,
            "params": dict(PARAMS_A), "url": sink.url}
    r = await client.post(f"{POW}/init/validate", json=init)
    assert r.status == 200, await r.text()
    head = {"public_key": G1["public_key"], "block_hash": G1["block_hash"], "block_height": 5, "node_id": 3}
    r = await client.post(f"{POW}/validate", json={**head, "nonces": [], "dist": []})
    assert r.status == 200, await r.text()
    res = await poll_result(client, (await r.json())["request_id"])
    assert res["status"] == "completed", res
    assert res["n_invalid"] == 0 and res["probability_honest"] == 1.0 and res["fraud_detected"] is False
    batch = {**head, "nonces": [4, 4, -2, 4], "dist": [1.0, 1.0, 1.0, 1.0]}
    r = await client.post(f"{POW}/validate", json=batch)
    assert r.status == 200, await r.text()
    res = await poll_result(client, (await r.json())["request_id"])
    assert res["status"] == "completed", res
    assert res["nonces"] == [4, 4, -2, 4] and res["received_dist"] == batch["dist"]
    assert res["dist"][0] == res["dist"][1] == res["dist"][3] != res["dist"][2]
    got = await sink.wait("validated", 2)
    assert [g["nonces"] for g in got] == [[], [4, 4, -2, 4]]
    assert list(got[1]) == ["public_key", "block_hash", "block_height", "nonces", "dist", "node_id", "received_dist",
                            "r_target", "fraud_threshold", "n_invalid", "probability_honest", "fraud_detected"]
    assert got[1]["node_id"] == 3 and got[1]["r_target"] == 2.0 and got[1]["fraud_threshold"] == 1e-7
    await client.post(f"{POW}/stop")


def test_v1_init_takes_any_node_id_the_reference_takes():
    """The reference's v1 /init/generate refuses only node_id or node_count of -1, and its NonceIterator is defined
    for any node_id: an MLNode whose node numbers have gaps (node_id >= node_count) must still generate and validate."""
    from poc.engine.jobs import take
    from poc.server.config import ServerConfig
    from poc.server.schemas import parse_pow_v1_init

    body = {"block_hash": "b", "block_height": 1, "public_key": "p", "node_id": 3, "node_count": 2,
            "params": dict(PARAMS_A)}
    for need_node in (True, False):
        init = parse_pow_v1_init(body, ServerConfig(), need_node=need_node)
        assert (init.node_id, init.node_count) == (3, 2)
    assert take(init.job().nonces, 3) == [3, 5, 7]
    for bad in ({"node_id": -1}, {"node_count": -1}, {"node_count": 0}, {"node_id": -2}):
        with pytest.raises(InputError):
            parse_pow_v1_init({**body, **bad}, ServerConfig(), need_node=True)


async def test_v1_validate_a_batch_larger_than_one_chunk(big_queue_client, sink):
    """A batch over the 100-nonce compute chunk, in no particular order: each recomputed dist goes back to its own
    nonce (compared with the same nonces validated alone) and n_invalid counts across chunks."""
    init = {"node_id": 0, "node_count": 1, "block_hash": G1["block_hash"], "block_height": 5,
            "public_key": G1["public_key"], "batch_size": 8, "r_target": 2.0, "fraud_threshold": 1e-7,
            "params": dict(PARAMS_A), "url": sink.url}
    assert (await big_queue_client.post(f"{POW}/init/validate", json=init)).status == 200
    head = {"public_key": G1["public_key"], "block_hash": G1["block_hash"], "block_height": 5, "node_id": 0}
    nonces = list(range(229, -1, -1))
    results = []
    for ns in (nonces, [0, 150, 229]):
        r = await big_queue_client.post(f"{POW}/validate", json={**head, "nonces": ns, "dist": [1.0] * len(ns)})
        assert r.status == 200, await r.text()
        results.append(await poll_result(big_queue_client, (await r.json())["request_id"]))
    big, small = results
    assert big["status"] == small["status"] == "completed" and big["nonces"] == nonces
    by_nonce = dict(zip(big["nonces"], big["dist"]))
    np.testing.assert_allclose([by_nonce[n] for n in small["nonces"]], small["dist"], rtol=1e-6, atol=0)
    assert big["n_invalid"] == 0 and len(set(big["dist"])) == 230
    await big_queue_client.post(f"{POW}/stop")


async def test_a_job_runs_on_a_thread_the_os_names_and_names_back(client, monkeypatch):
    """While a job computes, its thread carries JOB_THREAD as the OS shows thread names (top -H, the soak's split
    of the server's CPU), and the engine's input thread PREPARE_THREAD; after the job the executor's thread has its
    own name back."""
    import os
    import threading
    from pathlib import Path

    from poc.engine.engine import PREPARE_THREAD
    from poc.logs import os_thread_name
    from poc.server.context import engine_key
    from poc.server.stream import JOB_THREAD

    if not os.path.isdir("/proc/self/task"):
        pytest.skip("thread names are read from Linux's /proc")
    engine, seen = client.app[engine_key], []
    run = engine.run

    def named_run(*a, **k):
        seen.append((threading.get_native_id(), os_thread_name()))
        return run(*a, **k)

    monkeypatch.setattr(engine, "run", named_run)
    r = await client.post(f"{POW}/generate", json=gen_body(P2["nonces"], wait=True))
    assert r.status == 200 and (await r.json())["status"] == "completed"
    (tid, name), = seen
    assert name == JOB_THREAD
    comm = Path("/proc/self/task")
    assert (comm / str(tid) / "comm").read_text() == Path("/proc/self/comm").read_text()
    names = {(comm / t / "comm").read_text().strip() for t in os.listdir(comm)}
    assert PREPARE_THREAD in names
