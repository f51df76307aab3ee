"""The model server in-process (pytest-aiohttp): every root route, streaming, disconnect, busy, bad input.

A CPU engine; v1 with golden set A (dim 64, 2 layers, vocab 256, seq_len 8), v2 with the tiny qwen3 checkpoint.
The /api/v1/pow routes are in test_server_pow.py, the subprocess tests in test_server_e2e.py.
"""

import asyncio
import json
import logging
import re
import time

import aiohttp
import numpy as np
import pytest

from poc.engine import memory
from poc.errors import InputError
from poc.logs import OneLineFormatter, defuse
from poc.protocol import v1, v2
from poc.server.app import create_app
from poc.server.config import parse_args
from poc.server.context import engine_key
from poc.protocol.nonces import stride_nonces
from poc.server.fields import get_nonces

from .golden import V1_GOLDEN as G1, V2_GOLDEN as G2
from .servers import (BH, PARAMS_A, QWEN3, SET_A, V1_KEYS, first_batch_line, metric, server_config, v1_request,
                      v2_request, validate_request, wait_status)


async def read_lines(resp) -> list[tuple[float, dict]]:
    out = []
    async for raw in resp.content:
        out.append((time.monotonic(), json.loads(raw)))
    return out


# --------------------------------------------------------------------------------------------------
# /health, /metrics


async def test_health_and_metrics(client):
    r = await client.get("/health")
    assert r.status == 200
    h = await r.json()
    ids = [m["id"] for m in (await (await client.get("/v1/models")).json())["data"]]
    # the model as /v1/models names it (a --model directory with no --served-model-name: the path as given, as vLLM)
    assert h == {"status": "healthy", "state": "ready", "model": ids[0], "device": "cpu", "cuda_broken": False,
                 "job": None, "attention": "bf16"}  # the attention recipe the loaded model computes (a Qwen3: bf16)
    assert (await client.post("/health")).status == 200  # the PyWorker benchmark posts
    r = await client.get("/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    text = await r.text()
    assert 'poc_engine_state{poc_engine_state="ready"} 1.0' in text
    assert "poc_model_load_seconds" in text


# --------------------------------------------------------------------------------------------------
# /generate v1


async def test_v1_stream_golden_distances_and_line_format(client):
    """float32 distances equal the golden set; every batch line has the reference's keys in its order."""
    r = await client.post("/generate", json=v1_request(dtype="float32"))
    assert r.status == 200 and r.headers["Content-Type"] == "application/x-ndjson"
    lines = [d for _, d in await read_lines(r)]
    batches = [d for d in lines if "worker_id" in d]
    assert [list(d) for d in batches] == [V1_KEYS] * 4  # 16 nonces in batches of 5: 5, 5, 5, 1
    assert [d["batch_computed"] for d in batches] == [5, 5, 5, 1]
    nonces = [n for d in batches for n in d["nonces"]]
    dist = [x for d in batches for x in d["dist"]]
    assert nonces == list(range(16))
    np.testing.assert_allclose(dist, SET_A["runs"]["float32"]["dist"], rtol=0, atol=1e-6)
    last = batches[-1]
    assert last["batch_number"] == last["aggregated_batch_number"] == 4
    assert last["total_computed"] == last["aggregated_total_computed"] == 16
    assert last["next_nonce"] == 16 and last["n_workers"] == 1 and last["node_id"] == 0
    assert lines[-1] == {**lines[-1], "status": "done", "reason": "max_nonces", "computed": 16, "valid": 16,
                         "batches": 4, "next_nonce": 16}


async def test_v1_only_hits_are_lines_but_totals_count_everything(client):
    """Lines carry only dist < r_target (default fp16 compute); totals count every computed nonce (F9)."""
    run = SET_A["runs"]["float16"]
    r_target = G1["r_target_used_for_filter"]
    r = await client.post("/generate", json=v1_request(r_target=r_target, batch_size=4))
    lines = [d for _, d in await read_lines(r)]
    batches = [d for d in lines if "worker_id" in d]
    assert [n for d in batches for n in d["nonces"]] == run["nonces_below_r_target"]
    assert all(x < r_target for d in batches for x in d["dist"])
    assert all(d["batch_computed"] == 4 for d in batches)
    assert batches[-1]["total_computed"] == max(run["nonces_below_r_target"]) // 4 * 4 + 4
    done = lines[-1]
    assert done["status"] == "done" and done["computed"] == 16
    assert done["valid"] == len(run["nonces_below_r_target"])


@pytest.mark.parametrize("proto", ["v1", "v2"])
async def test_nonces_end_at_int64_max(client, proto):
    """start_nonce may be 2**63 - 1 (nonces are int64 on the chain and the device): the job ends there ("exhausted")
    instead of computing and reporting 2**63, 2**63 + 1, ... (whose next_nonce /generate then refused as start_nonce)."""
    top = (1 << 63) - 1
    body = (v1_request(start_nonce=top - 2, batch_size=2, max_nonces=5, r_target=10.0) if proto == "v1" else
            v2_request(start_nonce=top - 2, batch_size=2, max_nonces=5))
    r = await client.post("/generate", json=body)
    lines = [d for _, d in await read_lines(r)]
    if proto == "v1":
        nonces = [n for d in lines if "worker_id" in d for n in d["nonces"]]
    else:
        nonces = [a["nonce"] for d in lines if "artifacts" in d for a in d["artifacts"]]
    assert nonces == [top - 2, top - 1, top]
    assert lines[-1]["status"] == "done" and lines[-1]["reason"] == "exhausted" and lines[-1]["computed"] == 3


async def test_stream_arrives_incrementally_with_progress(client, caplog):
    """Lines reach the client while the job runs (not buffered to the end), with progress lines between;
    the log gets rate lines meanwhile."""
    with caplog.at_level(logging.INFO, logger="poc.server"):
        r = await client.post("/generate", json=v1_request(batch_size=1, max_nonces=None, max_duration=2.0))
        t0 = time.monotonic()
        got = await read_lines(r)
    assert any(rec.getMessage().startswith("rate: ") and "nonces/s, computed" in rec.getMessage()
               for rec in caplog.records)
    kinds = [("batch" if "worker_id" in d else d.get("status")) for _, d in got]
    assert kinds[-1] == "done" and got[-1][1]["reason"] == "max_duration"
    assert "progress" in kinds
    batch_times = [t - t0 for (t, d) in got if "worker_id" in d]
    end = got[-1][0] - t0
    assert len(batch_times) > 10
    assert batch_times[0] < end - 1.0  # the first line came long before the job ended
    assert np.median(np.diff(batch_times)) < 0.5  # and the rest trickled in
    prog = [d for _, d in got if d.get("status") == "progress"]
    assert {"computed", "valid", "batches", "elapsed", "nonces_per_second"} <= set(prog[-1])
    assert prog[-1]["computed"] > 0


async def test_pyworker_envelope(client):
    r = await client.post("/generate", json={"auth_data": {"reqnum": 1}, "payload": v1_request(max_nonces=5)})
    lines = [d for _, d in await read_lines(r)]
    assert lines[-1]["computed"] == 5


def test_pyworker_envelope_with_other_keys():
    # spec-v1 §4.0: a body with a `payload` key is the envelope, whatever else it carries
    from poc.server.fields import unwrap

    req = v1_request()
    assert unwrap({"auth_data": {"reqnum": 1}, "payload": req, "endpoint": "/generate", "cost": 5}) == req
    assert unwrap({"payload": req}) == req
    assert unwrap(req) == req
    with pytest.raises(InputError) as e:
        unwrap({"payload": [1], "auth_data": {}})
    assert e.value.field == "payload"


# --------------------------------------------------------------------------------------------------
# /generate v2


async def test_v2_stream_golden_artifacts(client):
    r = await client.post("/generate", json=v2_request())
    assert r.status == 200
    lines = [d for _, d in await read_lines(r)]
    batches = [d for d in lines if "artifacts" in d]
    assert [list(d) for d in batches] == [["public_key", "block_hash", "block_height", "node_id", "batch_number",
                                           "artifacts", "encoding"]] * 3
    assert batches[0]["encoding"] == {"dtype": "f16", "k_dim": 12, "endian": "le"}
    arts = [a for d in batches for a in d["artifacts"]]
    want = G2["models"]["qwen3"]["artifacts"]
    assert [a["nonce"] for a in arts] == [w["nonce"] for w in want]
    for a, w in zip(arts, want):
        assert np.linalg.norm(v2.decode(a["vector_b64"]) - np.array(w["vector_f32_from_f16"])) < 1e-3
    assert lines[-1]["status"] == "done" and lines[-1]["computed"] == 8 and lines[-1]["dropped"] == 0


async def test_v2_node_layout_and_start_nonce(client):
    """node 1 of 3 computes 1, 4, 7, ...; start_nonce skips the node's nonces below it."""
    r = await client.post("/generate", json=v2_request(node_id=1, node_count=3, start_nonce=5, max_nonces=3))
    lines = [d for _, d in await read_lines(r)]
    assert [a["nonce"] for d in lines if "artifacts" in d for a in d["artifacts"]] == [7, 10, 13]
    assert lines[-1]["next_nonce"] == 14
    it = stride_nonces(0, 1, 2, 1, 2)  # base 1 + 1*2 = 3, stride 4
    assert [next(it) for _ in range(3)] == [3, 7, 11]


@pytest.mark.parametrize("proto", ["v1", "v2"])
async def test_next_nonce_with_replicas_is_the_first_nonce_not_computed(aiohttp_client, monkeypatch, proto):
    """With replicas, results arrive out of order and a stop drops batches dealt but not computed (here the
    job's third batch, while later ones were computed): the done line's next_nonce must resume at the first
    nonce of the job's own sequence not computed (v2: its node lattice), never past it; so must the last v1
    batch line's."""
    from poc.engine.engine import Engine
    from poc.engine import factory
    from poc.server.context import runners_key

    from .fakes import TwoReplicaEngine

    monkeypatch.setattr(factory, "Engine", TwoReplicaEngine.make(Engine))
    c = await aiohttp_client(create_app(server_config(**({"model": QWEN3} if proto == "v2" else {}))))
    await wait_status(c)
    if proto == "v1":  # nonces 0, 1, 2, ...; batch 3 is 20..29
        req, seq, key = v1_request(batch_size=10), list(range(10_000)), "nonces"
    else:  # node 1 of 3 from 5: 7, 10, 13, ...; batch 3 is 25, 28, 31
        req, key = v2_request(node_id=1, node_count=3, start_nonce=5, batch_size=3), "artifacts"
        it = stride_nonces(5, 1, 3, 0, 1)
        seq = [next(it) for _ in range(10_000)]
    del req["max_nonces"]  # the job runs until it is stopped
    r = await c.post("/generate", json=req)
    lines = []
    while sum(key in d for d in lines) < 6:
        lines.append(json.loads(await r.content.readline()))
    next(iter(c.server.app[runners_key])).stop()
    lines += [d for _, d in await read_lines(r)]
    batches = [d for d in lines if key in d]
    got = {n for d in batches for n in (d["nonces"] if proto == "v1" else [a["nonce"] for a in d["artifacts"]])}
    first_missing = next(n for n in seq if n not in got)
    third = 2 * req["batch_size"]  # the third batch's first nonce is seq[third]
    assert first_missing == seq[third] and max(got) > first_missing  # a gap: computed nonces past a dropped batch
    done = lines[-1]
    assert done["status"] == "done" and done["reason"] == "stopped"
    assert done["next_nonce"] == seq[third - 1] + 1  # as with one engine: past the last nonce before the gap
    if proto == "v1":
        assert done["next_nonce"] == first_missing and batches[-1]["next_nonce"] == first_missing
    else:
        assert next(stride_nonces(done["next_nonce"], 1, 3, 0, 1)) == first_missing


def test_job_order_positions_and_the_resume_point():
    """JobOrder places dealt nonces in the job's sequence; next_nonce is past the computed prefix of it."""
    from poc.engine.jobs import take
    from poc.server.stream import JobOrder, JobStats, add_spans

    def stats_after(nonces, batches, dealt):
        order = JobOrder(nonces)
        dealt_batches = [take(order, dealt[0]) for _ in range(dealt[1])]
        s = JobStats("v2", "t", order=order)
        for i in batches:  # the computed batches, in arrival order
            add_spans(s.done_spans, [order.position(n) for n in dealt_batches[i]])
        return s

    assert stats_after(stride_nonces(5, 1, 3, 0, 1), [], (3, 4)).next_nonce is None
    assert stats_after(stride_nonces(5, 1, 3, 0, 1), [0, 1, 2], (3, 4)).next_nonce == 32  # in order: largest + 1
    assert stats_after(stride_nonces(5, 1, 3, 0, 1), [1, 3, 0], (3, 4)).next_nonce == 23  # batch 2 (25..31) dropped
    assert stats_after(stride_nonces(5, 1, 3, 0, 1), [1, 3], (3, 4)).next_nonce == 7  # nothing before the gap
    assert stats_after(v1.worker_nonces(40, 0, 1), [2, 0, 1], (5, 4)).next_nonce == 55
    order = JobOrder(iter([3, 4, 5, 10, 20, 30, 31, 40]))  # three runs
    assert [order.position(n) for n in order] == list(range(8)) and [order.nonce(i) for i in range(8)] == \
        [3, 4, 5, 10, 20, 30, 31, 40]
    assert [order.position(n) for n in (2, 6, 25, 41)] == [None] * 4
    order = JobOrder(iter([5, 3]))  # not increasing: not tracked
    assert list(order) == [5, 3] and order.position(5) is None


# --------------------------------------------------------------------------------------------------
# stop conditions


async def test_disconnect_stops_the_job(client):
    r = await client.post("/generate", json=v1_request(batch_size=1, max_nonces=None, max_duration=60))
    first = await first_batch_line(r)
    assert "worker_id" in first
    r.close()  # the client goes away mid-stream
    t0 = time.monotonic()
    await wait_status(client, ("ready",), timeout=5)
    assert time.monotonic() - t0 < 2.0
    text = await (await client.get("/metrics")).text()
    assert metric(text, 'poc_jobs_total{protocol="v1",reason="disconnect"}') == 1.0, [l for l in text.splitlines() if "jobs" in l]
    computed = metric(text, 'poc_nonces_computed_total{protocol="v1"}')
    await asyncio.sleep(0.3)
    text = await (await client.get("/metrics")).text()
    assert metric(text, 'poc_nonces_computed_total{protocol="v1"}') == computed  # nothing runs any more


async def test_a_cancelled_handler_counts_its_job_as_a_disconnect_when_the_engine_ends_first(aiohttp_client,
                                                                                             monkeypatch):
    """aiohttp's TestServer cancels the handler of a gone client. The stream's generator then stops the job at once,
    and the engine thread may end before the handler names the reason; the job was then counted `stopped` (seen once
    in a CI run of the test above). Here nothing else can notice the client first (no progress lines, a batch every
    0.25 s), and the watch task takes 1.5 s to leave, so the thread, with at most two batches in flight, ends first."""
    from poc.server import stream

    async def slow_to_leave(w, runner):
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            await asyncio.sleep(1.5)  # the engine thread ends its batches and is accounted for meanwhile
            raise

    monkeypatch.setattr(stream, "_watch_client", slow_to_leave)
    app = create_app(server_config(progress_interval=60.0))
    engine = app[engine_key]
    real = engine.v1_compute

    def slow(*a, **kw):
        c = real(*a, **kw)
        collect = c.collect
        c.collect = lambda h: (time.sleep(0.25), collect(h))[1]
        return c

    engine.v1_compute = slow
    client = await aiohttp_client(app)
    await wait_status(client)
    r = await client.post("/generate", json=v1_request(batch_size=1, max_nonces=None, max_duration=60))
    assert "worker_id" in await first_batch_line(r)
    r.close()
    await wait_status(client, ("ready",), timeout=5)
    text = await (await client.get("/metrics")).text()
    jobs = [line for line in text.splitlines() if line.startswith("poc_jobs_total")]
    assert metric(text, 'poc_jobs_total{protocol="v1",reason="disconnect"}') == 1.0, jobs


@pytest.mark.parametrize("cancel", [False, True], ids=["production", "handler_cancellation"])
async def test_disconnect_logs_the_batches_computed_after_it(aiohttp_client, caplog, monkeypatch, cancel):
    """The batch on the device when the client goes is computed all the same; it cannot reach the client, and the
    log says so (how many batches and nonces, which) instead of dropping it silently. Both ways a server meets a
    gone client: model_server.py's web.run_app (no handler cancellation: the stream notices on its next write or
    check) and aiohttp's TestServer (the handler is cancelled, leaving batches in the runner's queue)."""
    from .fakes import LoopbackApp

    caplog.set_level(logging.INFO, logger="poc.server")
    app = create_app(server_config())
    engine = app[engine_key]
    real = engine.v1_compute

    def slow(*a, **kw):  # a batch takes longer than the progress interval, as a large batch on a GPU does
        c = real(*a, **kw)
        collect = c.collect
        c.collect = lambda h: (time.sleep(0.4), collect(h))[1]
        return c

    engine.v1_compute = slow
    req = v1_request(batch_size=1, max_nonces=None, max_duration=60)
    if cancel:
        from poc.server import stream

        async def blind_watch(w, runner):  # only the cancelled handler can tell the runner its client went
            await asyncio.Event().wait()

        monkeypatch.setattr(stream, "_watch_client", blind_watch)
        client = await aiohttp_client(app)
        await wait_status(client)
        r = await client.post("/generate", json=req)
        await first_batch_line(r)
        r.close()  # the next batch is on the device: it is computed after the client went
        await wait_status(client, ("ready",), timeout=5)
    else:
        srv = await LoopbackApp(app).start()
        try:
            async with aiohttp.ClientSession() as http:
                t0 = time.monotonic()
                while (await (await http.get(srv.url + "/health")).json())["state"] != "ready":
                    assert time.monotonic() - t0 < 10
                    await asyncio.sleep(0.02)
                r = await http.post(srv.url + "/generate", json=req)
                await first_batch_line(r)
                r.close()
                t0 = time.monotonic()
                while (await (await http.get(srv.url + "/health")).json())["state"] != "ready":
                    assert time.monotonic() - t0 < 5
                    await asyncio.sleep(0.02)
        finally:
            await srv.stop()
    msgs = [rec.getMessage() for rec in caplog.records]
    done = [m for m in msgs if m.startswith("job done")][-1]
    assert "reason disconnect" in done
    computed = int(done.split("computed ")[1].split(",")[0])
    lost = [m for m in msgs if "never reached the client" in m]
    assert len(lost) == 1, msgs[-5:]
    m = re.match(r"(\d+) computed batch\(es\), (\d+) nonces \((\d+)\.\.(\d+)\)", lost[0])
    n_batches, n_nonces, first, last = map(int, m.groups())
    assert n_batches == n_nonces >= 1 and first >= 1 and last == computed - 1  # batch 1: nonce k is batch k+1


async def test_second_job_gets_409_at_once(client):
    r = await client.post("/generate", json=v1_request(batch_size=1, max_nonces=None, max_duration=30))
    assert "worker_id" in await first_batch_line(r)
    h = await wait_status(client, ("busy",))
    assert h["job"]["computed"] > 0 and h["status"] == "healthy"  # the reference's word while serving (200)
    t0 = time.monotonic()
    for path, body in [("/generate", v1_request()), ("/generate", v2_request()),
                       ("/validate", validate_request(SET_A["runs"]["float16"]))]:
        r2 = await client.post(path, json=body)
        assert r2.status == 409, path
        assert await r2.json() == {"error": "busy: a job is already running", "field": None}
    assert time.monotonic() - t0 < 1.0
    r.close()
    await wait_status(client)


async def test_engine_failure_mid_job_is_one_line(client, caplog):
    """An engine exception: an error line then done(reason=error); the log has no crash markers; still healthy."""
    engine = client.server.app[engine_key]
    real = engine.v1_compute

    def broken(*a, **kw):
        raise RuntimeError("boom: simulated device failure")

    engine.v1_compute = broken
    with caplog.at_level(logging.INFO):
        r = await client.post("/generate", json=v1_request())
        lines = [d for _, d in await read_lines(r)]
    engine.v1_compute = real
    assert lines[-2] == {"error": "boom: simulated device failure", "error_type": "RuntimeError"}
    assert lines[-1]["status"] == "done" and lines[-1]["reason"] == "error"
    fmt = OneLineFormatter()
    text = "\n".join(fmt.format(rec) for rec in caplog.records)
    assert "job failed" in text and "(RuntimeError) boom" in text
    assert "Traceback" not in text and "Error:" not in text
    assert (await wait_status(client))["state"] == "ready"


# --------------------------------------------------------------------------------------------------
# /validate (v1)


async def test_v1_validate(client):
    run = SET_A["runs"]["float16"]
    r = await client.post("/validate", json=validate_request(run))
    assert r.status == 200
    vb = await r.json()
    assert list(vb) == ["public_key", "block_hash", "block_height", "nonces", "dist", "node_id", "received_dist",
                        "r_target", "fraud_threshold", "n_invalid", "probability_honest", "fraud_detected"]
    assert vb["n_invalid"] == 0 and vb["fraud_detected"] is False and vb["probability_honest"] == 1.0
    # claim every nonce is under r_target: the ones that are not count as invalid
    r = await client.post("/validate", json=validate_request(run, nonces=run["nonces"], dist=[1.0] * 16))
    vb = await r.json()
    assert vb["n_invalid"] == 16 - len(run["nonces_below_r_target"])
    assert vb["fraud_detected"] is True


# --------------------------------------------------------------------------------------------------
# bad input: 400/409/413/422 with {"error", "field"}, then a healthy /health


def _v1(**kw):
    return v1_request(**kw)


def _v1p(**kw):
    return v1_request(params={**PARAMS_A, **kw})


def _v2p(**kw):
    return v2_request(params={"model": "qwen3", "seq_len": 16, **kw})


def _drop(d: dict, key: str) -> dict:
    return {k: v for k, v in d.items() if k != key}


def _pow_gen(**kw):
    return {**_drop(v2_request(), "max_nonces"), "nonces": [0, 1, 2], "wait": True, **kw}


HUGE_V1 = {**PARAMS_A, "dim": 8192, "n_layers": 512, "n_heads": 64, "n_kv_heads": 64, "vocab_size": 32000,
           "ffn_dim_multiplier": 4.0, "multiple_of": 256}

BAD = [
    ("/generate", b"{not json", 400, None),
    ("/generate", b"[1, 2]", 400, None),
    ("/generate", b'{"r_target": NaN}', 400, None),
    ("/generate", _drop(_v1(), "params"), 400, "params"),
    ("/generate", _drop(_v1(), "r_target"), 400, "r_target"),
    ("/generate", _v1(surprise=1), 400, "surprise"),
    ("/generate", _v1(block_height="12"), 400, "block_height"),
    ("/generate", _v1(batch_size=0), 400, "batch_size"),
    ("/generate", _v1(batch_size=-3), 400, "batch_size"),
    ("/generate", _v1(batch_size=10**6), 400, "batch_size"),
    ("/generate", _v1(batch_size=2.5), 400, "batch_size"),
    ("/generate", _v1(start_nonce=-1), 400, "start_nonce"),
    ("/generate", _v1(r_target="1.4"), 400, "r_target"),
    ("/generate", _v1(dtype="int8"), 400, "dtype"),
    ("/generate", _v1(max_duration=0), 400, "max_duration"),
    ("/generate", _v1(max_nonces=0), 400, "max_nonces"),
    ("/generate", _v1(params=_drop(PARAMS_A, "seq_len")), 400, "params.seq_len"),
    ("/generate", _v1p(extra_key=1), 400, "params.extra_key"),
    ("/generate", _v1p(seq_len=0), 400, "params.seq_len"),
    ("/generate", _v1p(dim="64"), 400, "params.dim"),
    ("/generate", _v1(params=HUGE_V1), 422, "params"),
    ("/generate", _v1(params={"foo": 1}), 400, "params"),
    ("/generate", _v2p(seq_len=0), 400, "params.seq_len"),
    ("/generate", _v2p(seq_len=5000), 400, "params.seq_len"),
    ("/generate", _v2p(k_dim=0), 400, "params.k_dim"),
    ("/generate", _v2p(k_dim=65), 400, "params.k_dim"),
    ("/generate", _v2p(extra=1), 400, "params.extra"),
    ("/generate", v2_request(params={"model": "other", "seq_len": 16}), 409, "params.model"),
    ("/generate", v2_request(node_id=2, node_count=2), 400, "node_id"),
    ("/generate", v2_request(batch_size=0), 400, "batch_size"),
    ("/generate", v2_request(batch_size=4096, params={"model": "qwen3", "seq_len": 4096}), 422, "params.seq_len"),
    ("/validate", validate_request(SET_A["runs"]["float16"], nonces=[-1, 2]), 400, "nonces"),
    ("/validate", validate_request(SET_A["runs"]["float16"], nonces=[2, 2]), 400, "nonces"),
    ("/validate", validate_request(SET_A["runs"]["float16"], dist=[1.0]), 400, "dist"),
    ("/validate", _drop(validate_request(SET_A["runs"]["float16"]), "fraud_threshold"), 400, "fraud_threshold"),
    ("/api/v1/pow/generate", _pow_gen(nonces=[0, -1]), 400, "nonces"),
    ("/api/v1/pow/generate", _pow_gen(nonces=[3, 3]), 400, "nonces"),
    ("/api/v1/pow/generate", _pow_gen(nonces=[]), 400, "nonces"),
    ("/api/v1/pow/generate", _pow_gen(batch_size=0), 400, "batch_size"),
    ("/api/v1/pow/generate", _pow_gen(params={"model": "qwen3", "seq_len": 16, "k_dim": 100}), 400, "params.k_dim"),
    ("/api/v1/pow/generate", _pow_gen(validation={"artifacts": [{"nonce": 0, "vector_b64": ""}]}), 400,
     "validation.artifacts"),
    ("/api/v1/pow/generate", _pow_gen(stat_test={"p_mismatch": 2}), 400, "stat_test.p_mismatch"),
    ("/api/v1/pow/init/generate", {**_drop(v2_request(), "max_nonces"), "batch_size": 0}, 400, "batch_size"),
    ("/api/v1/pow/init/generate", {**_drop(v2_request(), "max_nonces"), "node_count": 0}, 400, "node_count"),
    ("/api/v1/pow/init/generate", {**_drop(v1_request(), "max_nonces"), "node_id": -1, "node_count": -1}, 400,
     "node_count"),
    ("/generate", {"x": "y" * (300 << 10)}, 413, None),
    # hostile values: deep nesting, ints past float or int64, URLs without a usable host
    ("/generate", b"[" * 30_000 + b"]" * 30_000, 400, None),  # under /generate's 64 KiB: json.loads on the loop
    ("/validate", b"[" * 100_000 + b"]" * 100_000, 400, None),  # a large body: bigjson.loads on its thread
    ("/generate", _v1(r_target=10**400), 400, "r_target"),
    ("/generate", _v1(max_duration=10**400), 400, "max_duration"),
    ("/generate", _v1(block_height=2**200), 400, "block_height"),
    ("/generate", _v1(max_nonces=2**200), 400, "max_nonces"),
    ("/generate", _v1p(norm_eps=10**400), 400, "params.norm_eps"),
    ("/generate", _v1p(n_layers=10**400), 400, "params.n_layers"),
    ("/generate", _v1p(dim=2**200, n_heads=1, n_kv_heads=1), 400, "params.dim"),
    ("/generate", _v1p(dim=2**62, n_heads=1, n_kv_heads=1), 400, "params.ffn_dim_multiplier"),  # FFN past int64
    ("/generate", _v1p(dim=2**40, n_heads=1, n_kv_heads=1), 422, "params"),  # fits int64, not in memory
    ("/generate", _v1p(n_layers=2**63 - 1), 422, "params"),
    ("/generate", _v1p(seq_len=2**63 - 1), 422, "params"),
    ("/generate", _v1p(ffn_dim_multiplier=1e308), 400, "params.ffn_dim_multiplier"),
    ("/generate", _v1p(dim=2**62, n_heads=1, n_kv_heads=1, n_layers=2**63 - 1, ffn_dim_multiplier=1e30), 400,
     "params.ffn_dim_multiplier"),
    ("/generate", v2_request(node_count=2**200), 400, "node_count"),
    ("/generate", v2_request(n_groups=2**200), 400, "n_groups"),
    ("/validate", validate_request(SET_A["runs"]["float16"], node_id=2**200), 400, "node_id"),
    ("/validate", validate_request(SET_A["runs"]["float16"], fraud_threshold=10**400), 400, "fraud_threshold"),
    ("/validate", {**validate_request(SET_A["runs"]["float16"]), "nonces": [0], "dist": [10**400]}, 400, "dist"),
    ("/pooled", {"orchestrator_url": "http://"}, 400, "orchestrator_url"),
    ("/pooled", {"orchestrator_url": "http://x:99999"}, 400, "orchestrator_url"),
    ("/pooled", {"orchestrator_url": "http://[::1"}, 400, "orchestrator_url"),
    ("/pooled", {"orchestrator_url": "http://a b/"}, 400, "orchestrator_url"),
    ("/pooled", {"orchestrator_url": "http://127.0.0.1:1", "max_duration": 10**400}, 400, "max_duration"),
    ("/warmup", {"callback_url": "http:///x"}, 400, "callback_url"),
    ("/api/v1/pow/init/generate", {**_drop(v2_request(), "max_nonces"), "node_id": 2**200}, 400, "node_id"),
    ("/api/v1/pow/init/generate", {**_drop(v2_request(), "max_nonces"), "url": "http://"}, 400, "url"),
    ("/api/v1/pow/generate", _pow_gen(node_count=2**200), 400, "node_count"),
    ("/api/v1/pow/generate", _pow_gen(stat_test={"p_mismatch": 10**400}), 400, "stat_test.p_mismatch"),
]


@pytest.mark.parametrize("path,body,status,field", BAD, ids=[f"{i}-{b[0]}-{b[3]}" for i, b in enumerate(BAD)])
async def test_bad_input_is_refused_and_server_stays_healthy(client, path, body, status, field):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = await client.post(path, data=data, headers={"Content-Type": "application/json"})
    assert r.status == status, await r.text()
    err = await r.json()
    assert err["field"] == field and err["error"]
    h = await client.get("/health")
    assert h.status == 200 and (await h.json())["state"] == "ready"


async def test_an_unread_body_closes_its_connection(client):
    """A body over the limit is refused before it is read: the answer says Connection: close, so the client opens
    a new connection for its next request (reusing this one met a reset about one run in six)."""
    r = await client.post("/generate", data=json.dumps({"x": "y" * (300 << 10)}).encode(),
                          headers={"Content-Type": "application/json"})
    assert r.status == 413 and r.headers.get("Connection", "").lower() == "close"
    r = await client.post("/generate", json={"block_hash": BH})  # a small refusal keeps its connection
    assert r.status == 400 and r.headers.get("Connection", "").lower() != "close"
    assert (await client.get("/health")).status == 200


def test_repeated_nonce_is_found_in_linear_time():
    # at the 100k-nonce limit a repeat at the end took ~50 s of quadratic search, blocking the event loop
    t0 = time.monotonic()
    with pytest.raises(InputError, match="holds 5 more than once"):
        get_nonces({"nonces": [*range(99_999), 5]}, "nonces", 100_000)
    assert time.monotonic() - t0 < 1.0


async def test_missing_fields_message_as_the_reference(client):
    # spec-v1 §4.0: 400 {"error": "Missing required fields: [...]"}, in the reference's field order
    r = await client.post("/generate", json=_drop(_drop(_v1(), "start_nonce"), "block_hash"))
    assert r.status == 400
    err = await r.json()
    assert err["error"] == "Missing required fields: ['block_hash', 'start_nonce']" and err["field"] == "block_hash"
    r = await client.post("/generate", json={"block_hash": BH})
    assert (await r.json())["error"] == ("Missing required fields: ['block_height', 'public_key', 'r_target', "
                                         "'batch_size', 'start_nonce', 'params']")


async def test_unknown_route_and_method_are_json(client):
    r = await client.get("/nope")
    assert r.status == 404 and (await r.json())["field"] is None
    r = await client.get("/generate")
    assert r.status == 405 and "POST" in r.headers["Allow"]


# --------------------------------------------------------------------------------------------------
# units: config, memory estimate, log formatting


def test_config_flags_and_env():
    c = parse_args([], {})
    assert (c.host, c.port, c.model, c.dtype, c.device) == ("127.0.0.1", 18000, None, "auto", None)
    c = parse_args(["--port", "19000"], {"POC_PORT": "1", "POC_MODEL": "/m", "POC_DEVICE": "cpu", "POC_DTYPE": "float16"})
    assert (c.port, c.model, c.device, c.dtype) == (19000, "/m", "cpu", "float16")
    for argv in (["--port", "x"], ["--dtype", "int4"], ["--bogus"]):
        with pytest.raises(InputError):
            parse_args(argv, {})


def test_every_server_flag_and_env_var_is_documented():
    """Each ServerConfig flag and its POC_* variable appear in README's Configuration table, model_server.py's
    docstring and --help (--served-model-name / POC_SERVED_MODEL_NAME were in none of the first two)."""
    import contextlib
    import io
    from pathlib import Path

    from poc.server.config import ENV

    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text().split("## Configuration", 1)[1].split("\n## ", 1)[0]
    doc = (root / "model_server.py").read_text().split('"""')[1]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        parse_args(["--help"], {})
    for key, var in ENV.items():
        flag = "--" + key.replace("_", "-")
        for where, text in (("README.md", readme), ("model_server.py", doc), ("--help", out.getvalue())):
            assert flag in text and var in text, (flag, var, where)


def test_memory_estimate():
    p = v1.V1Params.from_json(PARAMS_A)
    assert memory.v1_total_params(p) == p.total_params
    e = memory.v1_estimate(p, 5, "float16")
    assert e.weights == (p.total_params - 256 * 64) * 2 and e.pool == 4 * v1.pool_size(p.total_params)
    assert e.activations == memory.activation_bytes(5, 8, 64, p.ffn_dim, 4, 2) + 5 * 256 * 36  # + the logits' post-process
    memory.check_fits(e, memory.torch.device("cpu"))  # tiny: fits
    with pytest.raises(InputError) as ei:
        memory.check_fits(memory.Estimate(weights=1 << 60), memory.torch.device("cpu"))
    assert ei.value.status == 422 and "GiB" in ei.value.message


def test_log_lines_never_carry_crash_markers():
    fmt = OneLineFormatter()
    try:
        raise ValueError("bad thing")
    except ValueError:
        import sys
        rec = logging.LogRecord("poc.server", logging.WARNING, __file__, 1, "handled %s", ("Error: x",), sys.exc_info())
    s = fmt.format(rec)
    assert "\n" not in s and "Traceback" not in s and "Error:" not in s and "(ValueError) bad thing" in s
    assert defuse("torch.OutOfMemoryError: CUDA out of memory") == "torch.OutOfMemory - CUDA out of memory"


async def test_v1_only_server_refuses_v2(aiohttp_client):
    c = await aiohttp_client(create_app(server_config()))
    h = await wait_status(c)
    assert h["model"] is None
    r = await c.post("/generate", json=v2_request())
    assert r.status == 409
    err = await r.json()
    assert err["error"] == "params mismatch" and err["deployed"]["model"] == [] and err["field"] == "params.model"
    r = await c.post("/generate", json=v1_request(max_nonces=3))
    assert [d for _, d in await read_lines(r)][-1]["computed"] == 3


async def test_log_and_metrics_count_every_batch_even_when_the_reader_leaves(client, caplog):
    """The job's log line and /metrics count every computed batch: the stream's done line agrees, and a reader
    that disconnects before draining the stream does not make batches disappear from the totals."""
    caplog.set_level(logging.INFO, logger="poc.server")
    r = await client.post("/generate", json=v1_request(max_nonces=40, batch_size=4))
    lines = []
    async for raw in r.content:  # a slow reader: the job finishes while its last lines still wait to be written
        lines.append(json.loads(raw))
        await asyncio.sleep(0.05)
    done = lines[-1]
    assert done["status"] == "done" and done["computed"] == 40
    logged = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("job done")]
    assert logged and f"computed 40, valid {done['valid']}" in logged[-1], logged
    m = await (await client.get("/metrics")).text()
    assert metric(m, 'poc_nonces_computed_total{protocol="v1"}') == 40

    # a reader that reads one line and goes away: the job stops, and everything it computed is counted once
    r = await client.post("/generate", json=v1_request(max_nonces=400, batch_size=2, r_target=2.0))
    await first_batch_line(r)
    r.close()
    await wait_status(client)
    logged = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("job done")]
    n = int(logged[-1].split("computed ")[1].split(",")[0])
    assert 2 <= n < 400
    m = await (await client.get("/metrics")).text()
    assert metric(m, 'poc_nonces_computed_total{protocol="v1"}') == 40 + n
