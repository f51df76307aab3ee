"""A node's PoC run in segments, as the Go node drives one (issue 34): generation stopped, then a new init with a new
block_height, while the node's callback server is under load (it answers late, and refuses with 503 across each
switch, as outside its PoC window). Every computed nonce reaches it once, in a callback that carries its own
segment's block_height and block_hash; benchmarks/diagnostics/soak.py runs the same path for minutes."""

import asyncio
import base64
import time

import numpy as np
from aiohttp import web

from poc.server.app import create_app
from poc.server.context import engine_key, sender_key
from poc.server.pow_service import pow_key

from .fakes import wait_until
from .gonka_client import GeneratedArtifactBatchV2, NodeReceiver, go_decode, go_post, init_generate_v2, params_v2
from .golden import V2_GOLDEN as G2
from .servers import QWEN3, server_config, wait_status

PK = G2["parameters"]["public_key"]
SEQ, K = 4, 12
BATCH = 32  # the MLNode's: the node sends none, and on the CPU the server picks the protocol's 32


class LoadedReceiver(NodeReceiver):
    """The node's callback server, slow (each answer `delay` s late) and refusing with 503 until `refuse_until`."""

    def __init__(self, delay: float):
        super().__init__()
        self.delay, self.refuse_until, self.refused = delay, 0.0, 0

    async def handle(self, request):
        if request.match_info["kind"] != "generated":
            return await super().handle(request)
        if time.monotonic() < self.refuse_until:
            self.refused += 1
            return web.json_response({"error": "PoC stage is not active"}, status=503)
        b = go_decode(await request.text(), GeneratedArtifactBatchV2)
        await asyncio.sleep(self.delay)
        self.got["generated"].append(b)
        return web.Response(status=200)


def segment_init(url: str, height: int) -> list:
    req = init_generate_v2(url)
    req[0], req[1] = ("block_hash", f"segment-{height}"), ("block_height", height)
    req[5] = ("params", params_v2(seq_len=SEQ))
    return req


async def test_a_segment_switch_under_load_loses_no_nonce_sends_none_twice_and_keeps_each_height(
        aiohttp_client, aiohttp_server, tmp_path):
    rx = LoadedReceiver(delay=0.05)
    srv = await aiohttp_server(rx.app)
    url = str(srv.make_url("/poc/qwen3"))
    client = await aiohttp_client(create_app(server_config(model=QWEN3, callback_interval=0.1,
                                                           spool_dir=str(tmp_path / "spool"))))
    await wait_status(client)
    gens, pending = {}, []
    for height in (100, 101, 102):
        r = await go_post(client, "/api/v1/inference/pow/init/generate", segment_init(url, height))
        assert r.status == 200, await r.text()
        gen = gens[height] = client.app[pow_key].gen
        await wait_until(lambda: gen.runner.stats.computed >= 6 * BATCH, 60, f"segment {height}")
        rx.refuse_until = time.monotonic() + 0.5  # the switch comes while the node refuses: callbacks wait (spooled)
        r = await go_post(client, "/api/v1/inference/pow/stop", None)
        assert r.status == 200 and not gen.active
        await asyncio.sleep(0.1)
        pending.append(client.app[sender_key].pending)  # what the next segment starts beside
    await wait_until(lambda: client.app[sender_key].pending == 0, 30, "every callback delivered")
    assert rx.refused > 0 and min(pending) > 0, (rx.refused, pending)  # each switch came with callbacks waiting

    got = rx.got["generated"]
    assert {b["block_height"] for b in got} == set(gens)
    engine = client.app[engine_key]
    for height, gen in gens.items():
        batches = [b for b in got if b["block_height"] == height]
        assert all(b["block_hash"] == f"segment-{height}" and b["node_id"] == 0 for b in batches)
        sent = [a["nonce"] for b in batches for a in b["artifacts"] or []]
        assert len(sent) == len(set(sent)), f"segment {height}: a nonce sent twice"
        assert sorted(sent) == list(range(gen.runner.stats.computed)), f"segment {height}: nonces lost"
        # the vectors are this segment's (its block hash), not another's under its height
        vec = {a["nonce"]: a["vector_b64"] for b in batches for a in b["artifacts"]}
        probe = [sent[0], sent[-1]]
        for other in gens:
            want, _ = engine.v2_artifacts(f"segment-{other}", PK, probe, SEQ, K)
            l2 = max(np.linalg.norm(_f16(vec[a["nonce"]]) - _f16(a["vector_b64"])) for a in want)
            assert (l2 < 1e-2) == (other == height), (height, other, l2)


def _f16(b64: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(b64), "<f2").astype(np.float32)
