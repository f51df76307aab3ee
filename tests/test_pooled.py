"""/pooled against a fake orchestrator on 127.0.0.1 (tests/fakes.py), and the spool under it.

- faults: 500 on every 3rd POST, connections dropped after processing (every 7th) and before it (every 11th), one
  restart of the orchestrator mid-range: every batch of the range is acknowledged exactly once by idempotency id,
  the accepted spans tile the range, and nothing is missing;
- commands: switch_job, a new range and shutdown are honoured within one poll interval;
- kill -9 of a model_server.py subprocess mid-range while the orchestrator refuses results, then a restart on the
  same spool directory: every result the dead server had streamed is delivered;
- the spool and the sender as units (replay, torn record, segment deletion, results/batch).
v1 set A params (dim 64, 2 layers, vocab 256, seq_len 8) on the CPU.
"""

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from poc.clients.callbacks import CallbackSender
from poc.clients.spool import Spool
from poc.server.app import create_app
from poc.server.context import sender_key

from .fakes import (FakeOrchestrator, Lines, ServerProcess, TwoReplicaEngine, covers_exactly, is_result, status,
                    wait_until)
from .golden import V1_GOLDEN as G1
from .servers import PARAMS_A, POLL, Sink, pooled_config, wait_status

BH = G1["block_hash"]
R = G1["r_target_used_for_filter"]


async def start_session(aiohttp_client, tmp_path, orch, body=None, **cfg):
    client = await aiohttp_client(create_app(pooled_config(tmp_path, **cfg)))
    await wait_status(client)
    resp = await client.post("/pooled", json={"orchestrator_url": orch.url, **(body or {})})
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"] == "application/x-ndjson"
    return client, Lines(resp)


# --------------------------------------------------------------------------------------------------
# a faulty orchestrator


# The fake orchestrator drops connections by closing its own socket inside a handler; now and then (a loaded CI
# machine) aiohttp's server side then leaves that socket to the garbage collector, which pytest reports as an
# unraisable ResourceWarning of the fake's transport: not the server under test, whose checks are the asserts below.
@pytest.mark.filterwarnings("ignore:Exception ignored in. <(function _SelectorTransport.__del__|socket.socket)"
                            ":pytest.PytestUnraisableExceptionWarning")
async def test_faulty_orchestrator_every_batch_acknowledged_exactly_once(aiohttp_client, tmp_path):
    orch = FakeOrchestrator(fail_every=3, drop_after_every=7, drop_before_every=11)
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 299, "r_target": R}
    restart: list[asyncio.Task] = []

    def on_result(n):  # the orchestrator goes away for a second after the 8th result POST it took
        if n == 8 and not restart:
            restart.append(asyncio.create_task(orch.restart(1.0)))

    orch.on_result = on_result
    await orch.start()
    try:
        client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 10})
        await lines.wait(status("range_complete"), 30)
        await wait_until(lambda: len(orch.accepted) >= 30 and orch.restarts == 1, 30, "all 30 results accepted")
        # a heartbeat got through (each 0.3 s; a fast run can finish while the faults and the restart eat every one)
        await wait_until(lambda: orch.heartbeats, 30, "a heartbeat accepted")
        orch.commands.append({"type": "shutdown"})
        await lines.wait(status("shutdown"), 30)
        out = await lines.finish()
    finally:
        await orch.stop()
    results = [d for d in out if is_result(d)]
    ids = [d["idempotency_id"] for d in results]
    assert len(ids) == len(set(ids)) == 30  # each batch streamed once (300 nonces in batches of 10)
    assert set(orch.accepted) == set(ids)  # each acknowledged, none missing, none extra
    assert covers_exactly(orch.spans("key-A"), 0, 299)  # the whole range, every nonce once (F1b)
    assert all(r["batch_computed"] == 10 for r in orch.accepted.values())
    # the faults happened and were survived: retried POSTs, drops, the restart (config polls failed meanwhile)
    assert sum(orch.posts.values()) > 30 and orch.faults["500"] and orch.faults["drop_after"]
    assert orch.faults["drop_before"] and orch.restarts == 1
    assert any(d.get("status") == "orchestrator_unreachable" for d in out)
    assert [d["status"] for d in out if d.get("status") in ("registering", "registered", "waiting_block_hash",
                                                            "received_block_hash", "loading_model", "model_loaded",
                                                            "ready", "computing")] == [
        "registering", "registered", "waiting_block_hash", "received_block_hash", "loading_model", "model_loaded",
        "ready", "computing"]
    # v1 result bodies: the reference's keys in order, then the span and the id
    assert list(results[0]) == ["worker_id", "public_key", "block_hash", "block_height", "nonces", "dist", "node_id",
                                "batch_number", "batch_computed", "batch_valid", "total_computed", "total_valid",
                                "elapsed_seconds", "first_nonce", "last_nonce", "idempotency_id"]
    assert all(x < R for r in results for x in r["dist"])
    assert results[-1]["total_computed"] == 300
    stats = orch.shutdowns[-1]["stats"]
    assert stats["total_batches_sent"] == 30 and stats["pending_results"] == 0
    assert out[-1]["status"] == "shutdown" and out[-1]["total_batches_sent"] == 30
    assert orch.heartbeats and all("pending_results" in h for h in orch.heartbeats)
    assert client.server.app[sender_key].pending == 0


async def test_results_at_the_senders_cap_pause_the_session_until_the_orchestrator_takes_them(aiohttp_client,
                                                                                               tmp_path, orch):
    """An orchestrator that refuses every result (500, retried) while the sender may hold 3 for it: the session
    says "paused" after the 3rd result and streams nothing more (the device waits: the job runner's bound), then,
    once the orchestrator takes results, "resumed"; the range completes and every nonce reaches it once."""
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 99, "r_target": R}
    orch.reject_results = True
    client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 10}, callback_max_pending=3)
    _, paused, i = await lines.wait(status("paused"), 30)
    assert paused["pending_results"] == 3 and sum(1 for d in lines.lines()[:i] if is_result(d)) == 3
    await asyncio.sleep(0.5)
    assert sum(1 for d in lines.lines() if is_result(d)) == 3 and not orch.accepted  # nothing more while paused
    orch.reject_results = False
    await lines.wait(status("resumed"), 30, start=i)
    await lines.wait(status("range_complete"), 30)
    await wait_until(lambda: len(orch.accepted) == 10, 30, "all 10 results accepted")
    orch.commands.append({"type": "shutdown"})
    await lines.wait(status("shutdown"), 30)
    out = await lines.finish()
    assert not [d for d in out if "error" in d], out
    assert len({d["idempotency_id"] for d in out if is_result(d)}) == 10
    assert covers_exactly(orch.spans("key-A"), 0, 99)  # every nonce, once


# --------------------------------------------------------------------------------------------------
# commands


async def test_switch_job_new_range_and_shutdown_within_one_poll_interval(aiohttp_client, tmp_path, orch, capsys):
    # A 1 s poll here: a command applied on the poll that served it shows within ~30 ms, one applied a poll later
    # would take >= 1 s, and a loaded 2-core CI machine's scheduling noise (up to a few hundred ms) fits between.
    poll = 1.0
    first_end = 10 ** 9
    # the new range lies past the first one's end: the first range's job runs on until the poll that serves the
    # command (up to a poll interval, dozens of batches), and however far it got, its spans stay apart from the new
    # range's (a new range of 5000..5999 met spans of the first range there on a fast machine)
    lo, hi = first_end + 5000, first_end + 5999
    orch.config = {}  # no block hash yet: the session waits, polling
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": first_end}
    client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 200},
                                        pooled_poll_interval=poll)
    await lines.wait(status("waiting_block_hash"))
    await asyncio.sleep(2 * poll)
    assert not any(d.get("status") == "received_block_hash" for d in lines.lines())
    orch.config = {"type": "config", "block_hash": BH, "block_height": 7, "params": PARAMS_A, "r_target": R}
    _, _, i = await lines.wait(status("computing"), 20)
    for _ in range(3):
        _, d, i = await lines.wait(is_result, 10, i + 1)
        assert d["public_key"] == "key-A"
    delays = {}

    async def command(cmd: dict, line_status: str, start: int):
        t_set = time.monotonic()
        n = len(orch.served)
        orch.commands.append(cmd)
        t_line, d, j = await lines.wait(status(line_status), 10, start)
        t_served = orch.served[n][0]
        delays[line_status] = (t_line - t_set, t_line - t_served)
        assert t_line - t_served < poll, (line_status, t_line - t_served)  # applied on the poll that served it
        assert t_line - t_set < 2 * poll, (line_status, t_line - t_set)  # at most one interval to that poll
        return d, j

    d, j = await command({"type": "switch_job", "public_key": "key-B"}, "switched_public_key", i)
    assert d["public_key"] == "key-B"  # written once the batch in flight went out, under the key it was computed with
    _, first_b, k = await lines.wait(is_result, 10, j + 1)
    assert first_b["public_key"] == "key-B"
    assert first_b["first_nonce"] == 0 and first_b["batch_number"] == 1  # the range restarts, counters reset
    _, _, k = await lines.wait(is_result, 10, k + 1)

    d, j = await command({"type": "config", "nonce_range_start": lo, "nonce_range_end": hi}, "new_range", k)
    assert (d["range_start"], d["range_end"]) == (lo, hi)
    _, done, _ = await lines.wait(status("range_complete"), 20, j)
    assert (done["range_start"], done["range_end"], done["total_computed"]) == (lo, hi, 1000)
    await wait_until(lambda: client.server.app[sender_key].pending == 0, 10, "results acknowledged")
    b_new = [s for s in orch.spans("key-B") if s[0] > first_end]
    b_low = [s for s in orch.spans("key-B") if s[1] <= first_end]
    assert len(b_new) + len(b_low) == len(orch.spans("key-B"))  # every key-B span in one range or the other
    assert covers_exactly(b_new, lo, hi)  # the new range, every nonce once
    assert b_low and covers_exactly(b_low, 0, b_low[-1][1])  # key B from 0, contiguous, until the new range
    a_spans = orch.spans("key-A")
    assert covers_exactly(a_spans, 0, a_spans[-1][1])
    await wait_until(lambda: any(h.get("range_complete") == [lo, hi] for h in orch.heartbeats), 5,
                     "the heartbeat that reports the exhausted range")

    d, j = await command({"type": "shutdown"}, "stopping", j)
    assert d["reason"] == "shutdown_command"
    out = await lines.finish()
    assert out[-1]["status"] == "shutdown" and not any(is_result(x) for x in out[j + 1:])
    assert orch.shutdowns[-1]["stats"]["total_batches_sent"] == sum(1 for x in out if is_result(x))
    with capsys.disabled():
        print("\n[pooled] command -> status line (from set, from served): " +
              ", ".join(f"{k} {a * 1000:.0f}/{b * 1000:.0f} ms" for k, (a, b) in delays.items()) +
              f" (poll interval {poll * 1000:.0f} ms)")
    await wait_status(client)  # the device is free again


async def test_shutdown_while_waiting_and_failed_registration_still_call_shutdown(aiohttp_client, tmp_path, orch):
    client, lines = await start_session(aiohttp_client, tmp_path, orch)
    await lines.wait(status("waiting_block_hash"))
    orch.commands.append({"type": "shutdown"})
    out = await lines.finish()
    assert out[-1] == {"status": "shutdown"} and len(orch.shutdowns) == 1  # F15: /shutdown is called
    # nobody listens: registration fails after its retries, the line says so, and /shutdown is still tried
    dead = FakeOrchestrator()
    r = await client.post("/pooled", json={"orchestrator_url": dead.url})
    out = [d for d in await Lines(r).finish()]
    assert out[-1]["error"] == "Failed to register with orchestrator" and out[-1]["error_type"] == "ConnectionError"
    r = await client.post("/pooled", json={})
    assert r.status == 400 and (await r.json())["error"] == "orchestrator_url is required"


async def test_server_shutdown_interrupts_registration_retries(aiohttp_client, tmp_path):
    """SIGTERM while connect is still being retried (an unreachable orchestrator: 5 tries, 1-2-4-8 s apart) ends
    the session at once with a shutdown line; it used to sit out every retry (~15 s) and end on an error line."""
    dead = FakeOrchestrator()  # never started: connection refused
    client = await aiohttp_client(create_app(pooled_config(tmp_path, orchestrator_retry_base=1.0)))
    await wait_status(client)
    lines = Lines(await client.post("/pooled", json={"orchestrator_url": dead.url}))
    await lines.wait(status("registering"))
    await asyncio.sleep(0.2)  # inside the first retry sleep
    t0 = time.monotonic()
    await client.server.app.shutdown()  # the app's on_shutdown handlers, as on SIGTERM
    out = await lines.finish()
    assert time.monotonic() - t0 < 3, out
    assert out[-1] == {"status": "shutdown"}, out


async def test_bad_params_from_the_orchestrator_end_the_session_with_a_clear_line(aiohttp_client, tmp_path, orch):
    orch.connect_reply = {"status": "ok", "block_hash": BH, "params": {**PARAMS_A, "seq_len": "eight"}}
    client, lines = await start_session(aiohttp_client, tmp_path, orch)
    out = await lines.finish()
    assert out[-1]["error_type"] == "InputError" and out[-1]["field"] == "params.seq_len"
    assert orch.shutdowns and "error" in orch.shutdowns[-1]["stats"]


# --------------------------------------------------------------------------------------------------
# what an orchestrator written against the reference may send or answer


async def test_integer_valued_floats_and_an_empty_range_from_the_orchestrator(aiohttp_client, tmp_path, orch):
    """An end below its start is an empty range (the reference's iterator yields nothing and the session lives
    on), not an error; 7.0 and 29.0 (a Python orchestrator dividing a range) are the integers they equal."""
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7.0, "params": PARAMS_A, "r_target": R}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 10, "nonce_range_end": 9}
    client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 10})
    _, empty, i = await lines.wait(status("range_complete"), 20)
    assert (empty["range_start"], empty["range_end"], empty["total_computed"]) == (10, 9, 0)
    orch.commands.append({"type": "config", "nonce_range_start": 0.0, "nonce_range_end": 29.0})
    _, done, _ = await lines.wait(lambda d: d.get("status") == "range_complete" and d["range_end"] == 29, 20, i + 1)
    assert done["total_computed"] == 30
    await wait_until(lambda: client.server.app[sender_key].pending == 0, 10, "results acknowledged")
    orch.commands.append({"type": "shutdown"})
    out = await lines.finish()
    assert not [d for d in out if "error" in d], out
    results = [d for d in out if is_result(d)]
    assert covers_exactly(orch.spans("key-A"), 0, 29)
    assert all(type(r["block_height"]) is int and r["block_height"] == 7 for r in results)
    assert all(type(n) is int for r in results for n in r["nonces"] + [r["first_nonce"], r["last_nonce"]])
    assert out[-1]["status"] == "shutdown"


async def test_no_heartbeat_or_config_poll_once_shutdown_is_called(aiohttp_client, tmp_path):
    """/shutdown stops the heartbeat (spec-v1 §4.3, call 7): an orchestrator that forgets a worker on /shutdown
    must not see it beat again (or poll) while, or after, that call is answered."""
    orch = FakeOrchestrator(shutdown_delay=1.0)
    await orch.start()
    try:
        client, lines = await start_session(aiohttp_client, tmp_path, orch)
        await lines.wait(status("waiting_block_hash"))
        await wait_until(lambda: len(orch.heartbeats) >= 1, 5, "a heartbeat")
        orch.commands.append({"type": "shutdown"})
        out = await lines.finish()
        await asyncio.sleep(0.5)
    finally:
        await orch.stop()
    assert out[-1] == {"status": "shutdown"} and len(orch.shutdowns) == 1
    assert orch.late == []


async def test_an_orchestrator_without_results_batch_gets_every_result_singly(tmp_path):
    """POST /results/batch answered 404 (an orchestrator that only implements /results, which is all the reference
    needs while nothing fails): the backlog goes out one result at a time, nothing is dead-lettered."""
    orch = FakeOrchestrator(batch_route=False)
    await orch.start()
    url = f"{orch.url}/api/workers/w1"
    orch.reject_results = True
    a = CallbackSender(timeout=2, backoff_base=0.05, backoff_max=0.2, spool_dir=str(tmp_path), refusal_limit=2)
    await a.start()
    try:
        for i in range(6):
            assert await a.put("results", url, {"idempotency_id": f"r{i}", "first_nonce": i, "last_nonce": i}, f"r{i}")
        await asyncio.sleep(0.3)
        orch.reject_results = False
        assert await a.flush(10) == 0
    finally:
        await a.close(0.1)
        await orch.stop()
    assert a.dead_lettered == 0 and sorted(orch.accepted) == [f"r{i}" for i in range(6)]


async def test_key_and_r_target_during_the_model_load_then_a_new_block_hash_mid_range(aiohttp_client, tmp_path,
                                                                                    orch):
    """The key and r_target come in a "compute" command served while the model loads (the ready reply carries only
    the range); later a config with a new block hash is a new job: the range restarts on the new block's model."""
    import hashlib

    import numpy as np

    from poc.protocol.v1 import V1Params
    from poc.server.context import engine_key

    bh2 = hashlib.sha256(b"next block").hexdigest()
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A}
    orch.ready_reply = {"nonce_range_start": 0, "nonce_range_end": 10 ** 6}
    orch.commands.append({"type": "compute", "public_key": "key-A", "r_target": R})
    client = await aiohttp_client(create_app(pooled_config(tmp_path)))
    await wait_status(client)
    eng = client.server.app[engine_key]
    build = eng.v1_compute

    def slow_build(*a):  # the first build outlasts a few polls: the command is served meanwhile
        if not orch.served:
            time.sleep(3 * POLL)
        return build(*a)

    eng.v1_compute = slow_build
    lines = Lines(await client.post("/pooled", json={"orchestrator_url": orch.url, "batch_size": 10}))
    _, ready, i = await lines.wait(status("ready"), 20)
    assert orch.served and ready["public_key"] == "key-A"
    _, first, i = await lines.wait(is_result, 20, i)
    assert (first["public_key"], first["block_hash"], first["block_height"]) == ("key-A", BH, 7)
    orch.commands.append({"type": "config", "block_hash": bh2, "block_height": 8})
    _, job, j = await lines.wait(status("new_job"), 10, i)
    assert (job["block_hash"], job["block_height"], job["range_start"]) == (bh2[:16], 8, 0)
    _, r2, _ = await lines.wait(lambda d: is_result(d) and d["block_hash"] == bh2 and d["nonces"], 30, j)
    orch.commands.append({"type": "shutdown"})
    out = await lines.finish()
    assert not any(d.get("status") == "r_target_default" or "error" in d for d in out), out
    new = [d for d in out if is_result(d) and d["block_hash"] == bh2]
    assert new[0]["first_nonce"] == 0 and new[0]["batch_number"] == 1 and new[0]["block_height"] == 8
    assert all(x < R for d in out if is_result(d) for x in d["dist"])
    want = eng.v1_distances(V1Params.from_json(PARAMS_A), bh2, "key-A", r2["nonces"], "float16")
    np.testing.assert_allclose(r2["dist"], want, rtol=1e-3)  # computed on the new block's model


async def test_the_compute_window_starts_with_computing_not_at_registration(aiohttp_client, tmp_path, orch):
    """The reference waits up to 600 s for a block hash, then computes for up to 600 s: a worker registered early
    (a warm pool waiting for the PoC phase) still gets its whole window once the block hash comes."""
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 10 ** 6}
    client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 10, "max_duration": 2.0})
    await lines.wait(status("waiting_block_hash"))
    await asyncio.sleep(2.5)  # longer than max_duration
    orch.config = {"type": "config", "block_hash": BH, "block_height": 7, "params": PARAMS_A, "r_target": R}
    t_computing, _, _ = await lines.wait(status("computing"), 20)
    t_stop, stop, _ = await lines.wait(status("stopping"), 20)
    out = await lines.finish()
    assert stop["reason"] == "max_duration" and 1.5 < t_stop - t_computing < 5, t_stop - t_computing
    assert any(is_result(d) for d in out) and out[-1]["status"] == "shutdown"


# --------------------------------------------------------------------------------------------------
# kill -9 and the spool


async def test_kill9_mid_range_then_restart_resends_spooled_results(tmp_path, orch):
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A, "r_target": R}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 10 ** 7}
    orch.reject_results = True  # nothing is acknowledged before the kill
    spool = tmp_path / "spool"
    srv = ServerProcess(tmp_path / "s1.log", "--spool-dir", str(spool))
    srv2 = None
    try:
        await srv.wait_ready()
        async with aiohttp.ClientSession() as http:
            resp = await http.post(srv.url + "/pooled", json={"orchestrator_url": orch.url, "batch_size": 50})
            lines = Lines(resp)
            await wait_until(lambda: sum(1 for d in lines.lines() if is_result(d)) >= 20, 30, "20 results")
            srv.kill9()
            await lines.finish()
        streamed = {d["idempotency_id"] for d in lines.lines() if is_result(d)}
        assert len(streamed) >= 20 and not orch.accepted
        orch.reject_results = False
        srv2 = ServerProcess(tmp_path / "s2.log", "--spool-dir", str(spool))
        await srv2.wait_ready()
        await wait_until(lambda: streamed <= set(orch.accepted), 30, "the spooled results re-sent")
        assert "replaying" in srv2.text()
        spans = orch.spans("key-A")
        assert covers_exactly(spans, 0, spans[-1][1])  # a prefix of the range, no gap, no overlap
    finally:
        srv.terminate()
        if srv2 is not None:
            assert srv2.terminate() == 0


def test_spool_replays_unacknowledged_records_skips_a_torn_one_and_deletes_acked_segments(tmp_path):
    s = Spool(tmp_path, segment_records=3)
    assert s.open() == []
    es = [s.append(f"id{i}", "results", "http://x", {"i": i}) for i in range(7)]  # segments 1 (3), 2 (3), 3 (1)
    assert s.segments() == [1, 2, 3]
    s.ack(es[:3])
    assert s.segments() == [2, 3] and not (tmp_path / "seg-00000001.jsonl").exists()  # closed, all acked
    s.ack([es[4]])
    assert s.read(es[5]) == {"i": 5}
    s.close()
    with open(tmp_path / "seg-00000003.jsonl", "ab") as f:
        f.write(b'{"id": "torn", "ki')  # a crash mid-write
    s2 = Spool(tmp_path, segment_records=3)
    pending = s2.open()
    assert [e.id for e in pending] == ["id3", "id5", "id6"]
    assert [s2.read(e)["i"] for e in pending] == [3, 5, 6]
    s2.ack(pending)
    s2.close()
    s3 = Spool(tmp_path, segment_records=3)
    assert s3.open() == [] and s3.segments() == [5]  # only the fresh segment is left
    s3.close()


def test_spool_acks_by_position_and_still_reads_an_older_spools_id_acks(tmp_path):
    s = Spool(tmp_path)
    s.open()
    e1, e2, e3 = (s.append("x", "generated", u, {"u": u}) for u in ("http://a", "http://b", "http://c"))
    s.ack([e1])  # only url a's "x": b's and c's stay pending
    s.close()
    with open(tmp_path / "seg-00000001.acks", "a") as f:
        f.write("nope\n")  # an older spool's line: an id
    s2 = Spool(tmp_path)
    assert [(e.url, e.id) for e in s2.open()] == [("http://b", "x"), ("http://c", "x")]
    s2.close()
    with open(tmp_path / "seg-00000001.acks", "a") as f:
        f.write("x\n")  # an older spool acked every "x" of the segment
    s3 = Spool(tmp_path)
    assert s3.open() == [] and s3.segments() == [3]
    s3.close()


async def test_sender_spools_first_then_replays_after_restart_in_batches(tmp_path, orch):
    url = f"{orch.url}/api/workers/w1"
    orch.reject_results = True
    a = CallbackSender(timeout=2, backoff_base=0.05, backoff_max=0.2, spool_dir=str(tmp_path))
    await a.start()
    for i in range(6):
        assert await a.put("results", url, {"idempotency_id": f"r{i}", "first_nonce": i, "last_nonce": i}, f"r{i}")
    assert await a.put("results", url, {"idempotency_id": "r0"}, "r0")  # a repeat is taken once
    assert a.pending == a.pending_for(url) == 6
    await asyncio.sleep(0.3)
    await a.close(0.1)  # nothing acknowledged: everything stays on disk
    orch.reject_results = False
    b = CallbackSender(timeout=2, backoff_base=0.05, spool_dir=str(tmp_path))
    await b.start()
    try:
        assert b.replayed == 6
        assert await b.flush(10) == 0
    finally:
        await b.close(1)
    assert sorted(orch.accepted) == [f"r{i}" for i in range(6)] and orch.batch_posts >= 1
    c = CallbackSender(spool_dir=str(tmp_path))
    await c.start()
    assert c.replayed == 0
    await c.close(0.1)


async def test_the_same_id_to_two_urls_is_two_records_before_and_after_a_restart(aiohttp_server, tmp_path):
    """Records are keyed by (destination, idempotency id): a record for url2 is never folded into one for url1
    that carries the same id, neither while url1's is pending nor when both are replayed after a restart."""
    s1, s2 = Sink(fail_first=10**6), Sink(fail_first=10**6)
    url1 = str((await aiohttp_server(s1.app)).make_url("/cb"))
    url2 = str((await aiohttp_server(s2.app)).make_url("/cb"))
    a = CallbackSender(timeout=2, backoff_base=0.05, backoff_max=0.2, spool_dir=str(tmp_path))
    await a.start()
    assert await a.put("generated", url1, {"to": 1, "n": "x"}, "x")
    assert await a.put("generated", url2, {"to": 2, "n": "x"}, "x")  # another destination: another record
    assert await a.put("generated", url1, {"to": 1, "n": "y"}, "y")
    assert a.pending == 3 and a.pending_for(url1) == 2 and a.pending_for(url2) == 1
    await a.close(0.1)  # both unreachable: all three stay on disk
    s2.fail_first = 0
    b = CallbackSender(timeout=2, backoff_base=0.05, backoff_max=0.2, spool_dir=str(tmp_path))
    await b.start()
    try:
        assert b.replayed == 3
        await wait_until(lambda: len(s2.got["generated"]) == 1, 5, "url2's record")
        assert await b.put("generated", url2, {"to": 2, "n": "y"}, "y")  # url1's "y" is still pending
        await wait_until(lambda: len(s2.got["generated"]) == 2, 5, "url2's new record")
        s1.fail_first = 0
        assert await b.flush(5) == 0
    finally:
        await b.close(0.1)
    assert sorted((p["to"], p["n"]) for p in s1.got["generated"]) == [(1, "x"), (1, "y")]
    assert sorted((p["to"], p["n"]) for p in s2.got["generated"]) == [(2, "x"), (2, "y")]
    c = Spool(tmp_path)
    assert c.open() == []  # every record acknowledged on disk, each by its own destination
    c.close()


async def test_a_permanent_refusal_goes_to_the_dead_letter_file_after_a_few_attempts(aiohttp_server, tmp_path,
                                                                                     caplog):
    """404/400/410/422 are retried a bounded number of times, then moved to dead-letter.jsonl with one ERROR line
    (no PyWorker crash marker in it) and a metric; 429 (and 408/409/425, 5xx, no connection) is retried on."""
    import json
    import logging

    from poc.server.metrics import Metrics

    seen = {"gone": 0, "slow": 0}

    async def gone(request):
        seen["gone"] += 1
        return web.json_response({"detail": "no such node"}, status=404)

    async def slow(request):
        seen["slow"] += 1
        return web.json_response({"detail": "later"}, status=429)

    rx = web.Application()
    rx.router.add_post("/gone/generated", gone)
    rx.router.add_post("/slow/generated", slow)
    srv = await aiohttp_server(rx)
    m = Metrics()
    s = CallbackSender(timeout=2, backoff_base=0.02, backoff_max=0.05, spool_dir=str(tmp_path), metrics=m,
                       refusal_limit=3)
    await s.start()
    try:
        caplog.set_level(logging.INFO, logger="poc.callbacks")
        assert await s.put("generated", str(srv.make_url("/gone")), {"artifacts": [1]}, "g1")
        assert await s.put("generated", str(srv.make_url("/slow")), {"artifacts": [2]}, "s1")
        await wait_until(lambda: s.pending_for(str(srv.make_url("/gone"))) == 0, 5, "the refused record dead-lettered")
        await wait_until(lambda: seen["slow"] > 5, 5, "429 retried past the refusal limit")
        assert seen["gone"] == 3 and s.pending == 1  # the 429 record is still pending
    finally:
        await s.close(0.1)
    dead = [json.loads(x) for x in (tmp_path / "dead-letter.jsonl").read_text().splitlines()]
    assert len(dead) == 1
    d = dead[0]
    assert (d["id"], d["kind"], d["url"], d["status"], d["payload"]) == (
        "g1", "generated", str(srv.make_url("/gone")), 404, {"artifacts": [1]})
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(lines) == 1 and "g1" in lines[0] and str(srv.make_url("/gone")) in lines[0] and "404" in lines[0]
    assert "Traceback" not in lines[0] and "Error:" not in lines[0]
    assert m.registry.get_sample_value("poc_callbacks_total", {"kind": "generated", "outcome": "dead_letter"}) == 1
    c = Spool(tmp_path)
    assert [e.id for e in c.open()] == ["s1"]  # the dead-lettered record is not replayed; the 429 one is
    c.close()


async def test_pow_callbacks_are_spooled_and_delivered_after_a_restart(aiohttp_client, tmp_path):
    """/api/v1/pow generation posts to a callback receiver that is down; the server stops; a new server on the
    same spool delivers every payload once the receiver is up (the same durability as /pooled's results)."""
    from .fakes import LoopbackApp
    sink = Sink()
    rx = LoopbackApp(sink.app)
    cfg = pooled_config(tmp_path, callback_interval=0.2, shutdown_flush_seconds=0.2)
    a = await aiohttp_client(create_app(cfg))
    await wait_status(a)
    init = {"node_id": 0, "node_count": 1, "block_hash": BH, "block_height": 5, "public_key": "pk",
            "batch_size": 8, "r_target": 2.0, "params": dict(PARAMS_A), "url": rx.url + "/cb"}
    r = await a.post("/api/v1/pow/init/generate", json=init)
    assert r.status == 200
    await asyncio.sleep(0.6)
    await a.post("/api/v1/pow/stop")
    spooled = a.server.app[sender_key].pending
    assert spooled >= 2
    await a.close()  # undelivered: they stay in the spool
    await rx.start()
    try:
        b = await aiohttp_client(create_app(cfg))
        await wait_status(b)
        assert b.server.app[sender_key].replayed == spooled  # one record per batch
        assert await b.server.app[sender_key].flush(10) == 0
    finally:
        await rx.stop()
    posts = len(sink.got["generated"])
    assert 1 <= posts < spooled and len(set(sink.keys)) == posts  # replayed merged, each record once
    nonces = sorted(n for p in sink.got["generated"] for n in p["nonces"])
    assert nonces == list(range(len(nonces)))  # every computed nonce, once


V1_INIT = {"node_id": 0, "node_count": 1, "block_hash": BH, "block_height": 5, "public_key": "pk", "batch_size": 8,
           "r_target": 2.0, "params": dict(PARAMS_A)}  # r_target 2.0: every nonce is reported


async def test_pow_generation_spools_each_batch_as_computed_so_a_kill9_mid_interval_loses_none(aiohttp_client,
                                                                                              tmp_path):
    """callback_interval is 60 s, so nothing is due to be posted yet; a copy of the spool taken mid-interval (what
    kill -9 would leave) already holds every computed batch, and a server started on it delivers them once, merged."""
    import shutil

    from .fakes import LoopbackApp
    sink = Sink()
    rx = LoopbackApp(sink.app)  # not started: nothing would be acknowledged anyway
    a = await aiohttp_client(create_app(pooled_config(tmp_path, callback_interval=60.0, shutdown_flush_seconds=0.1)))
    await wait_status(a)
    assert (await a.post("/api/v1/pow/init/generate", json={**V1_INIT, "url": rx.url + "/cb"})).status == 200
    def on_disk():  # complete records: what a kill -9 now would leave
        return sum(p.read_bytes().count(b"\n") for p in (tmp_path / "spool").glob("seg-*.jsonl"))

    await wait_until(lambda: on_disk() >= 3, 10, "batches spooled as they are computed")
    snapshot = tmp_path / "killed"
    shutil.copytree(tmp_path / "spool", snapshot)  # a torn last record, if any, is skipped at replay
    await a.post("/api/v1/pow/stop")
    await a.close()
    await rx.start()
    try:
        b = await aiohttp_client(create_app(pooled_config(tmp_path, spool_dir=str(snapshot))))
        await wait_status(b)
        sender = b.server.app[sender_key]
        n = sender.replayed
        assert n >= 3
        assert await sender.flush(10) == 0
        await b.close()
    finally:
        await rx.stop()
    posts = sink.got["generated"]
    assert 1 <= len(posts) < n  # merged, as the reference posts, not one POST per batch
    assert len(set(sink.keys)) == len(posts)
    nonces = sorted(x for p in posts for x in p["nonces"])
    assert nonces == list(range(len(nonces))) and len(nonces) >= n  # the first batches, each nonce once
    assert {(p["public_key"], p["block_hash"], p["node_id"]) for p in posts} == {("pk", BH, 0)}
    c = CallbackSender(spool_dir=str(snapshot))
    await c.start()
    assert c.replayed == 0  # exactly once: nothing left to replay
    await c.close(0.1)


async def test_pow_generation_posts_merged_batches_every_interval(aiohttp_client, tmp_path):
    """Each batch is spooled as it arrives, but the receiver gets one merged POST per callback_interval."""
    from poc.server.pow_service import pow_key

    from .fakes import LoopbackApp
    sink = Sink()
    rx = await LoopbackApp(sink.app).start()
    try:
        a = await aiohttp_client(create_app(pooled_config(tmp_path, callback_interval=0.4)))
        await wait_status(a)
        assert (await a.post("/api/v1/pow/init/generate", json={**V1_INIT, "url": rx.url + "/cb"})).status == 200
        await asyncio.sleep(1.0)
        gen = a.server.app[pow_key].gen
        await a.post("/api/v1/pow/stop")
        assert await a.server.app[sender_key].flush(5) == 0
        stats = gen.runner.stats
    finally:
        await rx.stop()
    posts = sink.got["generated"]
    assert 2 <= len(posts) <= 5 and len(posts) < stats.batches, (len(posts), stats.batches)
    nonces = sorted(x for p in posts for x in p["nonces"])
    assert nonces == list(range(stats.computed))  # every computed nonce, once


async def test_a_transient_spool_read_error_delays_a_batch_and_loses_nothing(tmp_path, orch):
    """A backlog goes out as one /results/batch; one record failing to read back (EMFILE: too many open files)
    must not acknowledge the whole group unsent: that record waits for a retry, the others go out."""
    import errno

    url = f"{orch.url}/api/workers/w1"
    orch.reject_results = True
    s = CallbackSender(timeout=2, backoff_base=0.05, backoff_max=0.2, spool_dir=str(tmp_path))
    await s.start()
    real, failed = s.spool.read, []

    def flaky(e):
        if e.id == "r2" and not failed:
            failed.append(e.id)
            raise OSError(errno.EMFILE, "Too many open files")
        return real(e)

    s.spool.read = flaky
    try:
        for i in range(5):
            assert await s.put("results", url, {"idempotency_id": f"r{i}", "first_nonce": i, "last_nonce": i}, f"r{i}")
        await asyncio.sleep(0.3)  # refused a few times: a backlog that goes out together
        orch.reject_results = False
        assert await s.flush(10) == 0
        assert failed == ["r2"]
        assert sorted(orch.accepted) == [f"r{i}" for i in range(5)]  # r2 too, once it could be read
    finally:
        await s.close(0.1)
    c = Spool(tmp_path)
    assert c.open() == []  # nothing is left unacknowledged on disk either
    c.close()


# --------------------------------------------------------------------------------------------------
# replicas: results out of order


async def test_pooled_with_replicas_out_of_order_covers_the_range_once(aiohttp_client, tmp_path, orch, monkeypatch):
    """A new public key mid-range stops the job and continues the range under it. With replicas, the last result
    to arrive is not the furthest nonce computed, and dropped batches may lie before a computed one: the resumed
    job must compute exactly the nonces not yet computed (no hole, no batch twice)."""
    from poc.engine import factory
    from poc.engine.engine import Engine

    monkeypatch.setattr(factory, "Engine", TwoReplicaEngine.make(Engine))
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A, "r_target": R}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 4999}

    def on_result(n):
        if n in (5, 40):  # twice mid-range: the key changes, the range goes on
            orch.commands.append({"type": "compute", "public_key": f"key-{n}"})

    orch.on_result = on_result
    client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 10})
    await lines.wait(status("range_complete"), 60)
    await wait_until(lambda: client.server.app[sender_key].pending == 0, 10, "results acknowledged")
    orch.commands.append({"type": "shutdown"})
    out = await lines.finish()
    assert sum(1 for d in out if d.get("status") == "public_key_set") == 2
    spans = sorted(orch.spans())
    assert covers_exactly(spans, 0, 4999), [(a, b) for (a, b), (c, _) in zip(spans, spans[1:]) if b + 1 != c][:5]
    results = [d for d in out if is_result(d)]
    assert sum(d["batch_computed"] for d in results) == 5000


async def test_a_plain_config_still_serving_the_first_key_does_not_undo_a_switch_job(aiohttp_client, tmp_path, orch):
    """The reference moves the key only on "switch_job"/"compute": an orchestrator whose plain config keeps the first
    key after a one-shot switch_job must not switch the worker back."""
    orch.connect_reply = {"status": "ok", "block_hash": BH, "block_height": 7, "params": PARAMS_A, "r_target": R}
    orch.ready_reply = {"public_key": "key-A", "nonce_range_start": 0, "nonce_range_end": 10 ** 6}
    orch.config = {"type": "config", "block_hash": BH, "public_key": "key-A"}  # served on every plain poll
    client, lines = await start_session(aiohttp_client, tmp_path, orch, {"batch_size": 10})
    _, _, i = await lines.wait(is_result, 20)
    orch.commands.append({"type": "switch_job", "public_key": "key-B"})
    _, _, j = await lines.wait(status("switched_public_key"), 10, i)
    await asyncio.sleep(4 * POLL)  # a few plain polls, each still naming key-A
    _, _, k = await lines.wait(is_result, 10, len(lines.lines()))
    orch.commands.append({"type": "shutdown"})
    out = await lines.finish()
    after = [d for d in out[j + 1:] if is_result(d)]
    assert after and {d["public_key"] for d in after} == {"key-B"}, {d["public_key"] for d in after}
    assert not any(d.get("status") in ("public_key_set", "switched_public_key") for d in out[j + 1:])
