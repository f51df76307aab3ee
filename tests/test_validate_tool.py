"""The network's validation tool for an MLNode (validate.py, replayed by tests/validate_tool.py) against this server
end to end: its download phase (the model cached), its deploy (POST /api/v1/inference/up/async, then
GET /api/v1/inference/up/status until is_running), its throughput phase (init/generate with batch_size and k_dim,
the pow status stats, the stop) and its validation (explicit nonces with wait, validation.artifacts and the
stat_test triple). The artifact is the golden tiny llama's vectors; the server starts with no model, as an MLNode
does, and serves it from a Hugging Face cache in a tmp dir."""

import asyncio
import threading

import pytest

from poc.server.app import create_app
from poc.server.context import engine_key
from poc.server.pow_service import pow_key

from . import validate_tool as tool
from .golden import GOLDEN, V2_GOLDEN as G2
from .servers import hub_cache, server_config, wait_status

LLAMA = GOLDEN / "v2_tiny" / "llama"
P2 = G2["parameters"]
REPO = "Org/Tiny-Llama"


def artifact(**kw) -> dict:
    """The tool's artifact file (make_artifact.py's shape): the model, the PoC params, the honest vectors."""
    a = {"model": REPO, "seq_len": P2["seq_len"], "k_dim": P2["k_dim"], "block_hash": P2["block_hash"],
         "block_height": 100, "public_key": P2["public_key"], "node_id": 0, "node_count": 1, "dist_threshold": 0.2,
         "artifacts": [{"nonce": x["nonce"], "vector_b64": x["vector_b64"]}
                       for x in G2["models"]["llama"]["artifacts"]],
         "source": "tests: the golden tiny llama"}
    a.update(kw)
    return a


@pytest.fixture
def hub(tmp_path, monkeypatch):
    root = tmp_path / "hub"
    hub_cache(root, REPO, LLAMA)
    snap = hub_cache(root, "Org/Broken", LLAMA, skip={"model.safetensors"})
    (snap / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


@pytest.fixture
async def client(aiohttp_client, hub):
    c = await aiohttp_client(create_app(server_config()))  # no --model: the tool deploys one
    await wait_status(c)
    return c


async def test_the_validation_tool_runs_its_four_phases_against_the_server(client):
    art = artifact()
    engine = client.app[engine_key]

    # [1/4] download: the model is in the cache
    got = await tool.download(client, REPO)
    assert got["action"] == "already_downloaded" and got["last_status"]["status"] == "DOWNLOADED"

    # [2/4] deploy: nothing runs, so up/async, then status polls until is_running (the load held a moment, so that
    # the tool sees it starting)
    gate, orig = threading.Event(), engine._load
    engine._load = lambda: (gate.wait(20), orig())
    asyncio.get_running_loop().call_later(0.3, gate.set)
    try:
        got = await tool.deploy(client, REPO, "auto", ["--tensor-parallel-size", "1", "--max-model-len", "4096"])
    finally:
        gate.set()
        del engine._load
    assert got["action"] == "deployed" and [c for c, _ in got["posts"]] == [200]
    assert got["posts"][0][1]["status"] == "starting"
    assert any(s["status"] == "in_progress" and s["is_starting"] for s in got["seen"]), got["seen"]
    assert got["status"]["status"] == "completed" and got["status"]["error"] is None
    again = await tool.deploy(client, REPO)  # a second run finds it running and posts nothing
    assert again["action"] == "already_running" and again["posts"] == []

    # [3/4] throughput: generation at the tool's batch_size and the artifact's k_dim, counted by /pow/status
    got = await tool.throughput(client, art, batch_size=4, measure_s=1.5, interval=0.3)
    assert got["init"]["backends"] == 1 and got["init"]["status"] == "OK"
    samples = got["samples"]
    assert samples and all(s["n_backends"] == 1 for s in samples)
    assert samples[-1]["processed"][0] > 0 and max(s["rates"][0] for s in samples) > 0, samples
    assert all(s["processed"][0] % 4 == 0 for s in samples)  # whole batches of the tool's batch_size
    gen = client.app[pow_key].gen
    assert (gen.init.batch_size, gen.init.k_dim) == (4, P2["k_dim"]) and not gen.active  # the tool stopped it
    _, st = await tool.get(client, "/api/v1/inference/pow/status")
    assert st["status"] == "IDLE"

    # [4/4] validate: the honest vectors pass; the same vectors under the wrong nonces are fraud (exit code 2)
    stat = tool.stat_test_for(art)
    assert stat == {"dist_threshold": 0.2, "p_mismatch": 0.001, "fraud_threshold": 0.01}
    res = await tool.validate(client, art, stat)
    assert (res["n_total"], res["n_mismatch"], res["mismatch_nonces"], res["fraud_detected"]) == (8, 0, [], False)
    assert tool.verdict(res) == ("PASS", 0) and isinstance(res["p_value"], float)
    pieces = art["artifacts"]
    moved = [{"nonce": a["nonce"], "vector_b64": b["vector_b64"]} for a, b in zip(pieces, pieces[1:] + pieces[:1])]
    res = await tool.validate(client, artifact(artifacts=moved), stat)
    assert res["n_mismatch"] == 8 and res["fraud_detected"] is True and tool.verdict(res)[1] == 2


async def test_the_tool_stops_at_a_deploy_that_fails_and_at_a_model_not_cached(client):
    with pytest.raises(tool.ToolStopped, match="vLLM startup failed") as e:
        await tool.deploy(client, "Org/Broken")
    assert "'status': 'failed'" in str(e.value) and "model load failed" in str(e.value)
    await client.post("/api/v1/inference/down")  # the MLNode's way back from a failed start
    assert (await tool.startup_status(client))["status"] == "not_started"
    with pytest.raises(tool.ToolStopped, match="/inference/up/async failed: 422"):
        await tool.deploy(client, "Org/Absent")
    with pytest.raises(tool.ToolStopped, match="did not complete"):  # nothing is downloaded at run time here
        await tool.download(client, "Org/Absent", timeout=0.3)
