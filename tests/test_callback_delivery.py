"""Callbacks that know when to stop and never throw results away (issue 15).

The receivers here play the Gonka node's callback routes (decentralized-api's postGeneratedArtifactsV2 answers 503
outside its PoC window and 500 when its chain submit fails): loopback aiohttp apps with aiohttp's default limits
(8190-byte headers, 1 MiB bodies) unless a test says otherwise.
"""

import asyncio
import json

from aiohttp import web

from poc.clients.callbacks import CallbackSender
from poc.clients.spool import Spool, read_dead_letter
from poc.server.app import create_app
from poc.server.context import sender_key
from poc.server.metrics import Metrics
from poc.server.pow_service import pow_key

from .fakes import wait_until
from .golden import V1_GOLDEN as G1
from .servers import server_config, wait_status

POW = "/api/v1/pow"
TINY = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256, "ffn_dim_multiplier": None,
        "multiple_of": 32, "norm_eps": 1e-05, "rope_theta": 10000.0, "use_scaled_rope": False, "seq_len": 8}


class Node:
    """The node's callback receiver: POST /cb/{kind}, answering `status` (200 once `accept` is set)."""

    def __init__(self, status: int = 200, **app_kw):
        self.status = status
        self.bodies: list[dict] = []
        self.keys: list[str] = []
        self.refused = 0
        self.app = web.Application(**app_kw)  # aiohttp's defaults: the header and body limits of a plain receiver
        self.app.router.add_post("/cb/{kind}", self.handle)

    async def handle(self, request):
        if self.status != 200:
            self.refused += 1
            await request.read()
            return web.json_response({"error": "outside the PoC window"}, status=self.status)
        self.keys.append(request.headers.get("Idempotency-Key", ""))
        self.bodies.append(await request.json())
        return web.json_response({"status": "OK"})

    def nonces(self) -> list[int]:
        return [n for b in self.bodies for n in b.get("nonces", [])]


async def start(aiohttp_server, node: Node) -> str:
    srv = await aiohttp_server(node.app)
    return str(srv.make_url("/cb"))


def payload(i: int, width: int = 4) -> dict:
    """A ProofBatch-like record of `width` nonces (the node decodes list fields, merged in order)."""
    return {"public_key": "pk", "block_hash": "bh", "block_height": 7, "node_id": 0,
            "nonces": list(range(i * width, (i + 1) * width)), "dist": [0.5] * width}


# --------------------------------------------------------------------------------------------------
# merged POSTs: small headers, bounded bodies


async def test_merges_of_thousands_of_records_reach_a_receiver_with_aiohttp_default_limits(aiohttp_server):
    """3,000 records held in one interval (W3's GPU rate gives ~1,270 per merge): before, their ids went in one
    Idempotency-Key (~37 bytes each) and a default aiohttp receiver answered 400 past ~220 records. Now every
    POST has one short key and a body under 1 MiB, and every nonce arrives once."""
    node = Node()
    url = await start(aiohttp_server, node)
    s = CallbackSender(timeout=5, backoff_base=0.05)
    await s.start()
    try:
        for i in range(3000):
            assert s.submit("generated", url, payload(i, 32), f"gen-{i:06d}-{'x' * 24}", merge="g")
        await wait_until(lambda: s.pending == 3000, 10, "all stored")
        s.release("g", final=True)
        assert await s.flush(30) == 0
    finally:
        await s.close(1)
    assert sorted(node.nonces()) == list(range(96000)) and len(node.nonces()) == 96000  # each once
    assert len(node.bodies) > 1  # bounded: one merge (~1.8 MB) went out as several POSTs
    assert all(len(k) < 100 for k in node.keys)
    assert len(set(node.keys)) == len(node.keys)
    ids = [r for b in node.bodies for r in b["record_ids"]]  # the POSTs go out in parallel: any order between them
    assert sorted(ids) == [f"gen-{i:06d}-{'x' * 24}" for i in range(3000)]
    assert all(b["record_ids"] == sorted(b["record_ids"]) for b in node.bodies)  # in order within one
    assert all(len(json.dumps(b)) < 1 << 20 for b in node.bodies)


async def test_a_413_splits_the_merged_post_and_nothing_is_given_up(aiohttp_server):
    """A receiver with a small body limit answers 413 (our request is too large: ours to fix): the POSTs to it get
    smaller and every record is delivered, none dead-lettered."""
    node = Node(client_max_size=8 << 10)
    url = await start(aiohttp_server, node)
    m = Metrics()
    s = CallbackSender(timeout=5, backoff_base=0.05, metrics=m)
    await s.start()
    try:
        for i in range(400):
            assert s.submit("generated", url, payload(i), f"r{i}", merge="g")
        await wait_until(lambda: s.pending == 400, 10, "all stored")
        s.release("g", final=True)
        assert await s.flush(30) == 0
    finally:
        await s.close(1)
    assert sorted(node.nonces()) == list(range(1600))
    assert s.dead_lettered == 0
    assert m.registry.get_sample_value("poc_callbacks_total", {"kind": "generated", "outcome": "sent"}) == 400


# --------------------------------------------------------------------------------------------------
# the retry policy and the lifetime


async def test_a_callback_refused_with_503_for_its_whole_lifetime_is_dead_lettered_counted_and_not_resurrected(
        aiohttp_server, aiohttp_client, tmp_path):
    """The node answers 503 outside its PoC window: the record is retried (with backoff) until its lifetime
    passes, then moved to dead-letter.jsonl, counted in /metrics, and a restart does not make it pending again."""
    node = Node(status=503)
    url = await start(aiohttp_server, node)
    cfg = server_config(spool_dir=str(tmp_path), callback_lifetime=0.6, callback_backoff=0.05,
                        callback_backoff_max=0.1)
    client = await aiohttp_client(create_app(cfg))
    await wait_status(client)
    sender = client.app[sender_key]
    assert await sender.put("generated", url, payload(0), "late-1")
    await wait_until(lambda: sender.pending == 0, 10, "the record dead-lettered")
    assert node.refused >= 2  # retried while it lived
    assert node.bodies == []
    text = await (await client.get("/metrics")).text()
    assert 'poc_callbacks_total{kind="generated",outcome="dead_letter"} 1.0' in text
    assert "poc_callbacks_dead_letter_records 1.0" in text
    dead = read_dead_letter(tmp_path)
    assert [(d["id"], d["url"], d["status"], d["payload"]) for d in dead] == [("late-1", url, 503, payload(0))]
    assert dead[0]["reason"].startswith("expired after")
    await client.close()
    # a restart: nothing pending, the dead letter still counted
    again = CallbackSender(spool_dir=str(tmp_path), metrics=Metrics())
    await again.start()
    try:
        assert again.pending == 0 and again.replayed == 0
        assert again.metrics.registry.get_sample_value("poc_callbacks_dead_letter_records") == 1
    finally:
        await again.close(0.1)
    c = Spool(tmp_path)
    assert [e.id for e in c.open()] == []
    c.close()


async def test_a_callback_accepted_on_a_later_retry_is_delivered_exactly_once(aiohttp_server, tmp_path):
    node = Node(status=500)  # the node's chain submit fails for a while
    url = await start(aiohttp_server, node)
    s = CallbackSender(timeout=2, backoff_base=0.05, backoff_max=0.1, spool_dir=str(tmp_path), lifetime=30)
    await s.start()
    try:
        assert await s.put("generated", url, payload(1), "once-1")
        await wait_until(lambda: node.refused >= 3, 10, "refused a few times")
        node.status = 200
        assert await s.flush(10) == 0
        await asyncio.sleep(0.3)  # no second delivery follows
    finally:
        await s.close(1)
    assert node.bodies == [payload(1)] and node.keys == ["once-1"]
    assert s.dead_lettered == 0 and read_dead_letter(tmp_path) == []
    c = Spool(tmp_path)
    assert [e.id for e in c.open()] == []  # acknowledged: not replayed either
    c.close()


async def test_a_4xx_refusal_is_not_retried_but_408_413_429_are(aiohttp_server, tmp_path):
    gone, slow = Node(status=404), Node(status=429)
    gone_url, slow_url = await start(aiohttp_server, gone), await start(aiohttp_server, slow)
    s = CallbackSender(timeout=2, backoff_base=0.02, backoff_max=0.05, spool_dir=str(tmp_path), lifetime=60)
    await s.start()
    try:
        assert await s.put("generated", gone_url, payload(0), "g1")
        assert await s.put("generated", slow_url, payload(1), "s1")
        await wait_until(lambda: s.pending_for(gone_url) == 0, 5, "the refused record dead-lettered")
        await wait_until(lambda: slow.refused > 3, 5, "429 retried")
        assert gone.refused == 1 and s.pending_for(slow_url) == 1
    finally:
        await s.close(0.1)
    assert [(d["id"], d["status"]) for d in read_dead_letter(tmp_path)] == [("g1", 404)]


# --------------------------------------------------------------------------------------------------
# a cap per destination; a full one pauses the generation


async def test_a_dead_destination_does_not_starve_a_healthy_one(aiohttp_server):
    node = Node()
    url = await start(aiohttp_server, node)
    s = CallbackSender(timeout=1, backoff_base=5, max_pending=10)
    await s.start()
    try:
        dead = "http://127.0.0.1:9/cb"  # nothing listens there
        for i in range(10):
            assert s.submit("generated", dead, payload(i), f"d{i}")
        assert not s.room(dead) and not s.submit("generated", dead, payload(10), "d10")  # its own cap
        assert s.room(url)
        for i in range(10):
            assert s.submit("generated", url, payload(i), f"h{i}")
        await wait_until(lambda: s.pending_for(url) == 0, 10, "the healthy destination served")
    finally:
        await s.close(0.1)
    assert sorted(node.nonces()) == list(range(40))


def v1_init(url: str) -> dict:
    # r_target above every distance: each computed nonce is in a ProofBatch, so "received" = "computed"
    return {"node_id": 0, "node_count": 1, "block_hash": G1["block_hash"], "block_height": 5,
            "public_key": G1["public_key"], "batch_size": 1, "r_target": 1e9, "fraud_threshold": 1e-7,
            "params": dict(TINY), "url": url}


async def test_a_generation_to_a_full_destination_pauses_and_resumes_without_a_lost_nonce(aiohttp_server,
                                                                                          aiohttp_client):
    """/api/v1/pow generation to a node that answers 503, with a cap of 20 records per destination: the
    generation pauses (before, it computed on and the refused batches were dropped), the node comes back, the
    generation resumes, and after /stop every computed nonce was received exactly once. Meanwhile a second
    destination that is down holds its own records without taking the first one's room."""
    node = Node(status=503)
    url = await start(aiohttp_server, node)
    cfg = server_config(callback_max_pending=20, callback_interval=0.05, callback_backoff=0.05,
                        callback_backoff_max=0.1, callback_lifetime=600)
    client = await aiohttp_client(create_app(cfg))
    await wait_status(client)
    sender = client.app[sender_key]
    for i in range(20):  # a dead destination filled to its cap
        assert sender.submit("validated", "http://127.0.0.1:9/cb", payload(i), f"dead-{i}")
    r = await client.post(f"{POW}/init/generate", json=v1_init(url))
    assert r.status == 200
    gen = client.app[pow_key].gen
    await wait_until(lambda: gen.paused, 20, "the generation paused")
    st = await (await client.get(f"{POW}/status")).json()
    assert st["status"] == "GENERATING" and st["stats"]["paused"] is True
    computed = gen.runner.stats.computed
    await asyncio.sleep(0.5)
    assert gen.runner.stats.computed <= computed + 2  # paused: at most the batches already in flight
    assert sender.pending_for(url) == 20
    node.status = 200  # the node's PoC window opens
    await wait_until(lambda: len(node.nonces()) > computed + 20, 20, "resumed and delivering")
    assert gen.pauses >= 1
    r = await client.post(f"{POW}/stop")
    assert r.status == 200
    await wait_until(lambda: sender.pending_for(url) == 0, 20, "everything delivered")
    got = node.nonces()
    total = gen.runner.stats.computed
    assert sorted(got) == list(range(total)) and len(got) == total  # every computed nonce, once
    assert sender.pending_for("http://127.0.0.1:9/cb") == 20
    await client.close()


async def test_a_generation_whose_merge_passes_the_old_header_limit_reaches_a_default_aiohttp_receiver(
        aiohttp_server, aiohttp_client):
    """Batches of one nonce, the first sent at once and the rest released at the end: ~300 records in one merge,
    past the ~220 at which the old Idempotency-Key (every id, ~37 bytes each) passed aiohttp's 8 KB header limit
    (the issue: 8,580 computed, 8 delivered). Every computed nonce arrives, once. (Thousands of records per merge:
    the sender test above; this CPU computes ~20 batches of one per second, so the generation stays at a few
    hundred.)"""
    node = Node()
    url = await start(aiohttp_server, node)
    cfg = server_config(callback_interval=3600.0)  # the first batch alone, then one release when it ends
    client = await aiohttp_client(create_app(cfg))
    await wait_status(client)
    r = await client.post(f"{POW}/init/generate", json=v1_init(url))
    assert r.status == 200
    gen = client.app[pow_key].gen
    await wait_until(lambda: gen.runner.stats.computed >= 300, 120, "300 nonces computed")
    assert (await client.post(f"{POW}/stop")).status == 200
    sender = client.app[sender_key]
    await wait_until(lambda: sender.pending == 0, 60, "everything delivered")
    total = gen.runner.stats.computed
    got = node.nonces()
    assert sorted(got) == list(range(total)) and len(got) == total
    assert "record_ids" not in node.bodies[0] and node.bodies[0]["nonces"] == [0]  # the early first batch
    assert 1 + sum(len(b["record_ids"]) for b in node.bodies[1:]) == total >= 300  # one record per batch of one
    assert all(len(k) < 100 for k in node.keys)
    await client.close()


def test_the_dead_letter_cli_lists_the_records(tmp_path, capsys):
    from poc.clients.spool import main

    sp = Spool(tmp_path)
    sp.open()
    sp.dead_letter([("generated", "http://n/cb", "a1", payload(0), "expired after 1801 s and 40 attempt(s); last: "
                     "HTTP 503")], 503, "HTTP 503")
    sp.dead_letter([("validated", "http://n/cb", "b2", {"x": 1})], 404, "HTTP 404")
    sp.close()
    assert main(["dead-letter", "--spool-dir", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    rows = [json.loads(x) for x in out.splitlines()]
    assert [(r["id"], r["kind"], r["status"]) for r in rows] == [("a1", "generated", 503), ("b2", "validated", 404)]
    assert rows[0]["reason"].startswith("expired after") and rows[1]["reason"] == "HTTP 404"
    assert "payload" not in rows[0] and rows[0]["payload_bytes"] == len(json.dumps(payload(0), separators=(",", ":")))
    assert "2 dead-letter record(s)" in err
    assert main(["dead-letter", "--spool-dir", str(tmp_path), "--payload"]) == 0
    assert json.loads(capsys.readouterr()[0].splitlines()[1])["payload"] == {"x": 1}
    assert main(["dead-letter", "--spool-dir", str(tmp_path / "nope")]) == 2


async def test_stored_returns_when_every_store_is_done_even_before_its_callback_ran():
    """CallbackSender.stored() (what a pow generation awaits after its last batch, before the final release) with a
    finished store still in its outbox's stores, its done-callback not yet run: it returns at once. It waited for
    them to empty, which that callback does: on Python 3.12, where gather() of finished tasks is finished without
    yielding, the loop never got the turn to run it and the server froze after a stop (seen once on four H200s); on
    3.11 it spun until the callback ran. Here the callback never comes, so the old loop never returns."""
    s = CallbackSender(timeout=5, backoff_base=0.05)
    finished = asyncio.get_running_loop().create_future()
    finished.set_result(None)
    s.outbox.stores.add(finished)  # done, and no discard callback will take it out
    slow = asyncio.create_task(asyncio.sleep(0.2))
    s.outbox.stores.add(slow)
    slow.add_done_callback(s.outbox.stores.discard)
    await asyncio.wait_for(s.stored(), 2)
    assert slow.done()  # a store still running was waited for
