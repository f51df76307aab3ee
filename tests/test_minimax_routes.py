"""MiniMax-M2.7 through the server's routes as a Gonka node and the other clients use them: served under its Hub repo
id (/v1/models), its attention recipe and FP8 arithmetic in /health, /generate, the node's init/generate with
callbacks, /warmup, inference/up from the Hugging Face cache and worker.py's benchmark payload. The checkpoint is a
tiny one in the release's FP8 layout (tests/test_minimax.py's sizes); every artifact is checked against the
single-process engine."""

import json

import numpy as np
import pytest

pytest.importorskip("transformers")

from poc.engine.engine import Engine  # noqa: E402
from poc.protocol import v2  # noqa: E402
from poc.server.app import create_app  # noqa: E402
from poc.server.context import engine_key  # noqa: E402

from .fakes import FakeController, Lines, status, wait_until  # noqa: E402
from .gonka_client import NodeReceiver, go_post, init_generate_v2, params_v2  # noqa: E402
from .servers import POW, hub_cache, server_config, v2_request, wait_status  # noqa: E402

REPO = "MiniMaxAI/MiniMax-M2.7"
SEQ, K = 16, 12


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    """The release-layout checkpoint and the single-process engine's float32 vectors of nonces 0..7 for
    v2_request's block hash and key."""
    from .checkpoints import MINIMAX_WIDE, make_hf_minimax, write_minimax_fp8

    root = tmp_path_factory.mktemp("minimax-routes")
    make_hf_minimax(root / "src", bias_std=0.05, **MINIMAX_WIDE)
    write_minimax_fp8(root / "src", root / "fp8", mtp_layers=1)
    p = v2_request()
    e = Engine("cpu", model_dir=str(root / "fp8"), dtype="float32")
    e.load()
    ref = e.v2.vectors(e.v2.prepare(p["block_hash"], p["public_key"], list(range(8)), SEQ, K)).numpy()
    e.close()
    return root / "fp8", ref


def _vectors(arts: list[dict]) -> dict[int, np.ndarray]:
    return {a["nonce"]: v2.decode(a["vector_b64"]) for a in arts}


async def test_health_models_and_generate(minimax, aiohttp_client):
    path, ref = minimax
    c = await aiohttp_client(create_app(server_config(model=str(path), served_model_name=(REPO,))))
    h = await wait_status(c)
    assert h["attention"] == "fp8" and h["fp8"] == {"forward": "w8a8", "scales": "ue8m0"}
    assert h["router"] == "float32"  # the server's float32 model on the CPU (CUDA's bf16 default: split)
    r = await c.get("/v1/models")
    assert [m["id"] for m in (await r.json())["data"]][0] == REPO
    r = await c.post("/generate", json=v2_request(params={"model": REPO, "seq_len": SEQ, "k_dim": K}))
    assert r.status == 200
    lines = [json.loads(x) for x in (await r.read()).splitlines()]
    got = _vectors([a for d in lines for a in d.get("artifacts", [])])
    assert sorted(got) == list(range(8)) and lines[-1]["status"] == "done"
    assert max(np.abs(got[n] - ref[n]).max() for n in got) < 1e-3  # fp16 encoding of the same vectors


async def test_the_nodes_generation_delivers_minimax_artifacts(minimax, aiohttp_client, aiohttp_server):
    path, ref = minimax
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    c = await aiohttp_client(create_app(server_config(model=str(path), served_model_name=(REPO,))))
    await wait_status(c)
    body = [(k, params_v2(REPO, SEQ) if k == "params" else v) for k, v in init_generate_v2(str(srv.make_url("/poc/x")))]
    r = await go_post(c, POW + "/init/generate", body)
    assert r.status == 200, await r.text()
    await wait_until(lambda: sum(len(b["artifacts"]) for b in rx.got["generated"]) >= 8, 60, "callbacks")
    r = await go_post(c, POW + "/stop", [])
    assert r.status == 200
    batches = rx.got["generated"]
    assert {b["block_height"] for b in batches} == {3}
    got = {a["nonce"]: v2.decode(a["vector_b64"]) for b in batches for a in b["artifacts"]}
    p = v2_request()
    e = Engine("cpu", model_dir=str(path), dtype="float32")
    e.load()
    nonces = sorted(got)[:8]
    want = e.v2.vectors(e.v2.prepare(p["block_hash"], p["public_key"], nonces, SEQ, 12)).numpy()
    e.close()
    assert max(np.abs(got[n] - want[i]).max() for i, n in enumerate(nonces)) < 1e-3


async def test_warmup_streams_a_minimax_job(minimax, aiohttp_client, tmp_path):
    path, ref = minimax
    cfg = server_config(model=str(path), served_model_name=(REPO,), spool_dir=str(tmp_path / "spool"),
                        warmup_poll_interval=0.2, warmup_max_duration=30.0, progress_interval=60.0)
    c = await aiohttp_client(create_app(cfg))
    await wait_status(c)
    ctl = FakeController(params=v2_request(params={"model": REPO, "seq_len": SEQ, "k_dim": K}), ready_after=1)
    await ctl.start()
    try:
        r = await c.post("/warmup", json={"callback_url": ctl.url, "job_id": "mm"})
        out = Lines(r)
        await out.wait(status("warmup_ready"))
        lines = await out.finish(60)
    finally:
        await ctl.stop()
    got = _vectors([a for d in lines for a in d.get("artifacts", [])])
    assert sorted(got) == list(range(8))
    assert max(np.abs(got[n] - ref[n]).max() for n in got) < 1e-3
    assert ctl.completes and ctl.completes[0][1]["total_computed"] == 8


async def test_inference_up_loads_minimax_from_the_hugging_face_cache(minimax, aiohttp_client, tmp_path,
                                                                      monkeypatch):
    from .servers import QWEN3

    path, _ = minimax
    hub_cache(tmp_path / "hub", REPO, path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    c = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(c)
    r = await go_post(c, "/api/v1/inference/up", [("model", REPO), ("dtype", "auto"), ("additional_args", None)])
    assert r.status == 200, await r.text()
    h = await wait_status(c)
    assert h["attention"] == "fp8" and c.app[engine_key].v2.cfg.family == "minimax_m2"
    r = await c.get("/v1/models")
    assert [m["id"] for m in (await r.json())["data"]] == [REPO]


def test_worker_benchmark_payload_names_minimax(monkeypatch):
    import worker

    monkeypatch.setenv("POC_BENCH_PARAMS", json.dumps({"model": REPO, "seq_len": 1024, "k_dim": 12}))
    body = worker.bench_payload()
    assert body["params"]["model"] == REPO and "node_id" in body


async def test_pooled_computes_a_minimax_range(minimax, aiohttp_client, tmp_path):
    """An orchestrator handing out a MiniMax range (/pooled, v2 params): every nonce's artifact reaches it once, the
    single-process engine's vector."""
    from .fakes import FakeOrchestrator, covers_exactly, is_result
    from .servers import pooled_config

    path, ref = minimax
    p = v2_request()
    orch = FakeOrchestrator()
    orch.connect_reply = {"status": "ok", "block_hash": p["block_hash"], "block_height": 7,
                          "params": {"model": REPO, "seq_len": SEQ, "k_dim": K}}
    orch.ready_reply = {"public_key": p["public_key"], "nonce_range_start": 0, "nonce_range_end": 7}
    await orch.start()
    try:
        c = await aiohttp_client(create_app(pooled_config(tmp_path, model=str(path), served_model_name=(REPO,))))
        await wait_status(c)
        r = await c.post("/pooled", json={"orchestrator_url": orch.url, "batch_size": 4})
        assert r.status == 200, await r.text()
        lines = Lines(r)
        await lines.wait(status("range_complete"), 60)
        await wait_until(lambda: len(orch.accepted) >= 2, 30, "both results accepted")
        orch.commands.append({"type": "shutdown"})
        await lines.wait(status("shutdown"), 30)
        out = await lines.finish()
    finally:
        await orch.stop()
    results = [d for d in out if is_result(d)]
    assert len(results) == 2 and covers_exactly(orch.spans(p["public_key"]), 0, 7)
    got = _vectors([a for b in orch.accepted.values() for a in b["artifacts"]])
    assert sorted(got) == list(range(8))
    assert max(np.abs(got[n] - ref[n]).max() for n in got) < 1e-3
