"""The server keeps a pipeline full: at pp=4 (CPU, gloo, random:tiny-4l) with each stage's forward standing in for
device time (RankConfig.stage_delay_s), both the /generate stream and /api/v1/pow/init/generate with callbacks keep
every stage computing most of the time (the ranks' JobClock: busy share), i.e. about pp batches in their forwards at
once; the first stage's leader never waits for the engine to deal its next batch; and the engine keeps at least pp
batches dealt and not yet reported (its JobFlight). Stages that take turns (busy ~1/pp) fail it.

One server (four rank processes) for both paths; each job is at least 16 batches of 2 nonces.
"""

import asyncio
import time

import pytest

from poc.engine import factory
from poc.engine.dist import DistEngine
from poc.server.app import create_app
from poc.server.context import engine_key

from .servers import Sink, server_config, wait_status

PP, DELAY, BATCH, BATCHES = 4, 0.05, 2, 16
MODEL = "random:tiny-4l"
BODY = {"block_hash": "flight", "block_height": 1, "public_key": "pk", "node_id": 0, "node_count": 1,
        "batch_size": BATCH, "params": {"model": MODEL, "seq_len": 8, "k_dim": 12}}


@pytest.fixture
async def served(aiohttp_client, monkeypatch):
    """A server on a pp=4 DistEngine whose stages sleep DELAY after each forward."""
    make = factory.make_engine
    monkeypatch.setattr(factory, "make_engine", lambda *a, **kw: make(*a, stage_delay=DELAY, **kw))
    client = await aiohttp_client(create_app(server_config(model=MODEL, pp=PP, callback_interval=0.2)))
    await wait_status(client, timeout=180)
    engine = client.server.app[engine_key]
    assert isinstance(engine, DistEngine) and engine.layout.pp == PP
    return client, engine


def check_pipeline(stats: dict, layout) -> None:
    """Every replica kept its pipeline full (see the module docstring)."""
    assert stats["ahead"] >= layout.pp, stats
    for r, rep in enumerate(stats["replicas"]):
        assert rep["min_in_flight"] is not None and rep["min_in_flight"] >= layout.pp, (r, stats)
    ranks = sorted(stats["ranks"], key=lambda x: x["rank"])
    assert len(ranks) == layout.world, stats
    for r in range(layout.replicas):
        mine = [x for x in ranks if layout.coords(x["rank"])[0] == r]
        # each stage computed most of its span: stages that take turns sit near 1/pp
        assert all(x["busy"] is not None and x["busy"] >= 0.5 for x in mine), (r, mine)
        # batches in their forwards at once, on average: the sum of the stages' busy shares (one tp rank a stage)
        assert sum(x["busy"] for x in mine) / layout.tp >= 0.55 * layout.pp, (r, mine)
        leader = next(x for x in mine if x["rank"] == layout.leader(r))
        # the leader found its next batch dealt already (the first one may be dealt while it looks)
        assert leader["starved"] <= 1, (r, leader)


async def test_generate_and_pow_callbacks_keep_the_pipeline_full(served, aiohttp_server):
    """One server for both paths (its four rank processes start once): the /generate stream, then generation with
    callbacks to a local receiver (which gets every computed artifact after /stop)."""
    client, engine = served
    r = await client.post("/generate", json={**BODY, "max_nonces": BATCH * BATCHES})
    assert r.status == 200
    lines = [line async for line in r.content]
    assert b'"reason": "max_nonces"' in lines[-1], lines[-1]
    check_pipeline(engine.last_job_stats, engine.layout)

    sink = Sink()
    srv = await aiohttp_server(sink.app)
    r = await client.post("/api/v1/pow/init/generate", json={**BODY, "url": str(srv.make_url("/cb"))})
    assert r.status == 200, await r.text()
    t0 = time.monotonic()
    while True:
        st = (await (await client.get("/api/v1/pow/status")).json())["stats"]
        if st and st["total_processed"] >= BATCH * BATCHES:
            break
        assert time.monotonic() - t0 < 60, st
        await asyncio.sleep(0.05)
    await client.post("/api/v1/pow/stop")
    got = await sink.wait("generated")
    assert sum(len(p["artifacts"]) for p in got) >= BATCH * BATCHES
    check_pipeline(engine.last_job_stats, engine.layout)
