"""/warmup against a fake controller on 127.0.0.1 (tests/fakes.py): lines arrive as they are produced (arrival
times), the /generate lines stream while the job runs, /warmup/complete is delivered (through a failure), and a
controller that is down gets one clear status line per poll and then the timeout line, never a silent stall.
"""

import pytest

from poc.server.app import create_app

from .fakes import FakeController, Lines, free_port, status
from .servers import V1_KEYS, first_batch_line, server_config, v1_request, wait_status

POLL = 0.2


@pytest.fixture
async def client(aiohttp_client, tmp_path):
    cfg = server_config(spool_dir=str(tmp_path / "spool"), warmup_poll_interval=POLL, warmup_max_duration=30.0,
                        callback_backoff=0.05, callback_backoff_max=0.2, callback_timeout=3.0, progress_interval=60.0)
    c = await aiohttp_client(create_app(cfg))
    await wait_status(c)
    return c


async def test_warmup_streams_each_line_as_produced_and_calls_complete(client):
    job = v1_request(batch_size=4, max_nonces=None, max_duration=1.0, r_target=2.0)  # ~1 s of batches
    ctl = FakeController(params=job, ready_after=3, fail_complete=1)
    await ctl.start()
    try:
        r = await client.post("/warmup", json={"callback_url": ctl.url, "job_id": "job-7"})
        assert r.status == 200 and r.headers["Content-Type"] == "application/x-ndjson"
        out = Lines(r)
        t_ready, first, _ = await out.wait(status("warmup_ready"))
        assert first == {"status": "warmup_ready", "job_id": "job-7"}
        # the waiting lines arrive one poll apart, while the controller is still saying "waiting"
        t1, w1, _ = await out.wait(status("warmup_waiting"))
        t2, w2, _ = await out.wait(lambda d: d.get("status") == "warmup_waiting" and d["poll_count"] == 2)
        assert w1["poll_count"] == 1 and 0.5 * POLL < t2 - t1 < 3 * POLL
        assert (await wait_status(client))["state"] == "ready"  # the device stays free while it waits
        lines = await out.finish(20)
    finally:
        await ctl.stop()
    times = dict((id(d), t) for t, d in out.items)
    got = [d["status"] for d in lines if "status" in d and d["status"].startswith("warmup")]
    assert got == ["warmup_ready", "warmup_waiting", "warmup_waiting", "warmup_waiting", "warmup_params_received",
                   "warmup_complete_sent"]
    assert [job_id for _, job_id in ctl.polls] == ["job-7"] * 4
    batches = [d for d in lines if "worker_id" in d]
    assert len(batches) >= 3 and all(list(d) == V1_KEYS for d in batches)
    # streamed during the 1 s job, not buffered until its end (spec-v1 §6 F3)
    spread = times[id(batches[-1])] - times[id(batches[0])]
    assert spread > 0.5, spread
    done = next(d for d in lines if d.get("status") == "done")
    assert done["reason"] == "max_duration"
    # /warmup/complete: refused once (500), re-sent, acknowledged; the numbers match the stream
    assert ctl.complete_posts == 2 and len(ctl.completes) == 1
    body = ctl.completes[0][1]
    assert body == {"job_id": "job-7", "total_batches": done["batches"], "total_computed": done["computed"],
                    "total_valid": done["valid"]}


async def test_warmup_with_the_controller_down_says_so_each_poll_then_times_out(aiohttp_client, tmp_path):
    cfg = server_config(spool_dir=str(tmp_path / "spool"), warmup_poll_interval=POLL, warmup_max_duration=0.9,
                        callback_timeout=1.0)
    c = await aiohttp_client(create_app(cfg))
    await wait_status(c)
    r = await c.post("/warmup", json={"callback_url": f"http://127.0.0.1:{free_port()}"})  # nothing listens there
    out = Lines(r)
    lines = await out.finish(10)
    assert lines[0] == {"status": "warmup_ready", "job_id": "unknown"}
    down = [d for d in lines if d.get("status") == "warmup_callback_unreachable"]
    assert len(down) >= 3 and [d["poll_count"] for d in down] == list(range(1, len(down) + 1))
    assert all(d["error"] and "elapsed" in d for d in down)
    ts = [t for t, d in out.items if d.get("status") == "warmup_callback_unreachable"]
    assert all(b - a > 0.5 * POLL for a, b in zip(ts, ts[1:]))  # one line per poll, as it happens
    assert lines[-1]["status"] == "warmup_timeout" and lines[-1]["elapsed"] >= 0.9


async def test_warmup_bad_params_and_bad_requests(client):
    ctl = FakeController(params={"block_hash": "x"}, ready_after=0)  # ready, but not a /generate request
    await ctl.start()
    try:
        r = await client.post("/warmup", json={"callback_url": ctl.url})
        lines = await Lines(r).finish(10)
    finally:
        await ctl.stop()
    assert lines[-1]["error_type"] == "InputError" and lines[-1]["field"] == "params" and not ctl.completes
    r = await client.post("/warmup", json={"job_id": "x"})
    assert r.status == 400 and (await r.json())["error"] == "callback_url is required"
    r = await client.post("/warmup", json={"callback_url": "ftp://x"})
    assert r.status == 400


async def test_params_arriving_after_the_client_went_start_no_job(tmp_path, caplog):
    """model_server.py's server (web.run_app: handlers are not cancelled on disconnect). The client leaves while
    the worker waits; the next poll hands over the params: no job may start for nobody (a v1 model build and
    batches on the device, all lost), and polling stops."""
    import asyncio
    import logging

    import aiohttp

    from .fakes import LoopbackApp

    caplog.set_level(logging.INFO)
    job = v1_request(batch_size=4, max_nonces=None, max_duration=5.0, r_target=2.0)
    ctl = FakeController(params=job, ready_after=1)
    await ctl.start()
    cfg = server_config(spool_dir=str(tmp_path / "spool"), warmup_poll_interval=POLL, warmup_max_duration=30.0,
                        progress_interval=60.0)
    srv = await LoopbackApp(create_app(cfg)).start()
    try:
        async with aiohttp.ClientSession() as http:
            while (await (await http.get(srv.url + "/health")).json())["state"] != "ready":
                await asyncio.sleep(0.02)
            r = await http.post(srv.url + "/warmup", json={"callback_url": ctl.url, "job_id": "gone"})
            assert (await r.content.readline()).startswith(b'{"status": "warmup_ready"')
            assert b"warmup_waiting" in await r.content.readline()
            r.close()  # gone before the params arrive (the controller has them at the next poll)
            await asyncio.sleep(6 * POLL)
            assert (await (await http.get(srv.url + "/health")).json())["state"] == "ready"
    finally:
        await srv.stop()
        await ctl.stop()
    msgs = [rec.getMessage() for rec in caplog.records]
    assert len(ctl.polls) == 2
    assert not [m for m in msgs if m.startswith("job started")], msgs
    assert any("went away" in m and "params" in m for m in msgs), msgs


async def test_a_controllers_integer_job_id_is_echoed_as_given(client):
    """The reference takes job_id as it comes (data.get("job_id", "unknown")): a controller's integer id is in the
    ready line and the /warmup/complete body as that integer, and in the poll's query string."""
    ctl = FakeController(params=v1_request(batch_size=4, max_nonces=8), ready_after=0)
    await ctl.start()
    try:
        r = await client.post("/warmup", json={"callback_url": ctl.url, "job_id": 42})
        assert r.status == 200, await r.text()
        out = Lines(r)
        lines = await out.finish(20)
        await out.wait(lambda d: d.get("status") == "warmup_complete_sent", 10)
    finally:
        await ctl.stop()
    assert lines[0] == {"status": "warmup_ready", "job_id": 42}
    assert [job_id for _, job_id in ctl.polls] == ["42"]
    assert ctl.completes[0][1]["job_id"] == 42


async def test_warmup_poll_lines_keep_the_reference_keys_first_and_hide_the_failure(client):
    """{"status", "poll_count", "elapsed"} in that order; a 404 reads as any unreachable callback (the stream must not
    tell a closed port from an HTTP error: it would be a port scanner), the status is only logged."""
    ctl = FakeController(params=None)
    await ctl.start()
    try:
        r = await client.post("/warmup", json={"callback_url": ctl.url + "/elsewhere"})  # GET .../warmup/params: 404
        out = Lines(r)
        _, w, _ = await out.wait(status("warmup_callback_unreachable"))
        r.close()
    finally:
        await ctl.stop()
    assert list(w)[:3] == ["status", "poll_count", "elapsed"]
    assert w["error"] == "callback unreachable" and "http_status" not in w


async def test_a_busy_device_leaves_the_params_with_the_controller_until_it_is_free(client):
    """While another job holds the device the parked worker does not ask for params (they would meet a busy
    refusal and the controller's job would be lost); once the device is free it takes them and runs the job."""
    ctl = FakeController(params=v1_request(batch_size=4, max_nonces=8, r_target=2.0), ready_after=0)
    await ctl.start()
    try:
        busy = await client.post("/generate", json=v1_request(batch_size=1, max_nonces=None, max_duration=1.0))
        assert "worker_id" in await first_batch_line(busy)
        out = Lines(await client.post("/warmup", json={"callback_url": ctl.url, "job_id": "j"}))
        _, w, _ = await out.wait(status("warmup_waiting"))
        assert w["detail"] == "device busy" and ctl.polls == []
        await busy.read()  # the /generate job ends (max_duration)
        lines = await out.finish(20)
    finally:
        await ctl.stop()
    assert len(ctl.polls) == 1  # asked once, when the device was free, and given the params at once
    done = next(d for d in lines if d.get("status") == "done")
    assert done["reason"] == "max_nonces" and done["computed"] == 8
    assert any(d.get("status") == "warmup_complete_sent" for d in lines)
