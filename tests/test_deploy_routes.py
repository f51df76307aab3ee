"""The MLNode's deploy routes (mlnode/packages/api/src/api/inference/routes.py and manager.py): POST
/api/v1/inference/up/async answers at once and loads in the background, GET /api/v1/inference/up/status reports
the load as the MLNode's StartupStatus, POST /api/v1/inference/down stops every job and unloads. The second
checkpoint comes from a Hugging Face cache in a tmp dir (tests/servers.hub_cache); a load is held at its start to
look at the server meanwhile."""

import asyncio
import contextlib
import json
import threading
import time

import pytest

from poc.server.app import create_app
from poc.server.context import engine_key
from poc.server.pow_service import pow_key

from .fakes import wait_until
from .golden import GOLDEN
from .gonka_client import NodeReceiver, go_get, go_post, init_generate_v2
from .servers import QWEN3, hub_cache, server_config, wait_status
from .validate_tool import check_startup_status

LLAMA = GOLDEN / "v2_tiny" / "llama"
UP, ASYNC, STATUS, DOWN = ("/api/v1/inference/up", "/api/v1/inference/up/async", "/api/v1/inference/up/status",
                           "/api/v1/inference/down")


def up(model, dtype="auto", args=None) -> dict:
    return {"model": model, "dtype": dtype, "additional_args": args or []}


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A Hugging Face cache: the tiny llama as Org/Tiny-Llama, the tiny qwen3 as Org/Tiny-Qwen3, and Org/Broken
    whose weights do not load; HF_HUB_CACHE points at it."""
    root = tmp_path / "hub"
    hub_cache(root, "Org/Tiny-Llama", LLAMA)
    hub_cache(root, "Org/Tiny-Qwen3", QWEN3)
    snap = hub_cache(root, "Org/Broken", LLAMA, skip={"model.safetensors"})
    (snap / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    monkeypatch.setenv("HF_HUB_CACHE", str(root))
    return root


@contextlib.contextmanager
def held_loads(engine):
    """Every load of `engine` waits for the gate (set on leaving, so that no test leaves a load waiting)."""
    gate = threading.Event()
    orig = engine._load
    engine._load = lambda: (gate.wait(30), orig())
    try:
        yield gate
    finally:
        gate.set()
        del engine._load


async def status(client) -> dict:
    r = await client.get(STATUS)
    assert r.status == 200
    return check_startup_status(await r.json())


async def wait_startup(client, timeout=20.0) -> dict:
    t0 = time.monotonic()
    while (st := await status(client))["status"] == "in_progress":
        assert time.monotonic() - t0 < timeout, st
        await asyncio.sleep(0.02)
    return st


async def served_ids(client) -> list[str]:
    r = await client.get("/v1/models")
    assert r.status == 200, await r.text()
    return [m["id"] for m in (await r.json())["data"]]


async def test_status_follows_the_start_up_load(aiohttp_client):
    """A server started with --model reports that load as in progress, then completed; one started without a model
    has not started one."""
    app = create_app(server_config(model=QWEN3))
    with held_loads(app[engine_key]) as gate:
        client = await aiohttp_client(app)
        st = await status(client)
        assert (st["status"], st["is_starting"], st["is_running"], st["error"]) == ("in_progress", True, False, None)
        assert st["elapsed_seconds"] >= 0 and st["model"] == QWEN3
        r = await client.post(ASYNC, json=up("Org/Tiny-Llama"))
        assert r.status == 409 and "loading" in (await r.json())["error"]
        gate.set()
        st = await wait_startup(client)
    assert (st["status"], st["is_starting"], st["is_running"], st["error"]) == ("completed", False, True, None)
    bare = await aiohttp_client(create_app(server_config()))
    await wait_status(bare)
    st = await status(bare)
    assert (st["status"], st["is_starting"], st["is_running"], st["elapsed_seconds"]) == ("not_started", False,
                                                                                          False, None)


async def test_up_async_answers_at_once_and_one_load_runs_at_a_time(aiohttp_client, hub):
    client = await aiohttp_client(create_app(server_config(model=QWEN3, served_model_name=("Org/Tiny-Qwen3",))))
    await wait_status(client)
    engine = client.app[engine_key]
    qwen = engine.v2
    # the model served: a no-op, as /api/v1/inference/up; bad input: 400 or 409, nothing changed
    r = await client.post(ASYNC, json=up("Org/Tiny-Qwen3"))
    assert r.status == 200 and (await r.json())["loaded"] is False
    before = await status(client)
    assert before["status"] == "completed" and before["is_running"]
    for body, code, field in ((up("../llama"), 400, "model"), (up("Org/Absent"), 422, "model"),
                              (up("Org/Tiny-Llama", dtype="int4"), 400, "dtype"),
                              ({"model": "Org/Tiny-Llama", "dtype": "auto", "additional_args": "--tp 2"}, 400,
                               "additional_args")):
        r = await client.post(ASYNC, json=body)
        assert r.status == code and (await r.json())["field"] == field, (body, await r.text())
    assert engine.v2 is qwen and (await status(client))["status"] == "completed"

    with held_loads(engine) as gate:
        t0 = time.monotonic()
        r = await client.post(ASYNC, json=up("Org/Tiny-Llama", args=["--tensor-parallel-size", "4"]))
        assert r.status == 200 and time.monotonic() - t0 < 5  # answered while the load is held
        assert (await r.json())["status"] == "starting"
        st = await status(client)
        assert (st["status"], st["is_starting"], st["is_running"], st["error"], st["model"]) == (
            "in_progress", True, False, None, "Org/Tiny-Llama")
        assert (await wait_status(client, want=("loading",)))["state"] == "loading"
        # a second up while one runs, either route, either model: 409, the load goes on
        for path in (ASYNC, UP):
            for model in ("Org/Tiny-Qwen3", "Org/Tiny-Llama"):
                r = await client.post(path, json=up(model))
                assert r.status == 409 and "loading" in (await r.json())["error"], (path, model)
        r = await go_post(client, "/api/v1/inference/pow/init/generate", init_generate_v2("http://127.0.0.1:9/poc"))
        assert r.status == 503
        await asyncio.sleep(0.05)
        assert (await status(client))["elapsed_seconds"] > st["elapsed_seconds"]
        gate.set()
        st = await wait_startup(client)
    assert (st["status"], st["is_starting"], st["is_running"], st["error"]) == ("completed", False, True, None)
    assert await served_ids(client) == ["Org/Tiny-Llama"] and engine.v2.name != qwen.name

    # a down while a load runs waits for it, then unloads what it loaded
    with held_loads(engine) as gate:
        r = await client.post(ASYNC, json=up("Org/Tiny-Qwen3"))
        assert r.status == 200
        down = asyncio.create_task(client.post(DOWN))
        await asyncio.sleep(0.2)
        assert not down.done() and (await status(client))["status"] == "in_progress"
        gate.set()
        r = await down
    assert r.status == 200 and await r.json() == {"status": "OK", "unloaded": "Org/Tiny-Qwen3"}
    st = await status(client)
    assert (st["status"], st["is_running"]) == ("not_started", False) and engine.v2 is None


async def test_a_failed_async_load_is_reported_and_a_down_clears_it(aiohttp_client, hub):
    client = await aiohttp_client(create_app(server_config(model=QWEN3)))
    await wait_status(client)
    r = await client.post(ASYNC, json=up("Org/Broken"))
    assert r.status == 200 and (await r.json())["status"] == "starting"
    st = await wait_startup(client)
    assert (st["status"], st["is_starting"], st["is_running"], st["elapsed_seconds"]) == ("failed", False, False,
                                                                                          None)
    assert st["error"].startswith("model load failed") and "safetensors" in st["error"], st
    h = await (await client.get("/health")).json()
    assert h["state"] == "broken" and h["reason"] == st["error"]
    r = await client.post(DOWN)
    assert r.status == 200 and (await r.json())["status"] == "OK"
    assert (await wait_status(client))["state"] == "ready" and await served_ids(client) == []
    assert (await status(client))["status"] == "not_started"


async def test_down_stops_every_job_and_the_poc_routes_answer_as_with_no_model(aiohttp_client, aiohttp_server, hub):
    rx = NodeReceiver()
    srv = await aiohttp_server(rx.app)
    client = await aiohttp_client(create_app(server_config(model=QWEN3, served_model_name=("Org/Tiny-Qwen3",))))
    await wait_status(client)
    engine = client.app[engine_key]
    r = await go_post(client, "/api/v1/inference/pow/init/generate", init_generate_v2(str(srv.make_url("/poc/q"))))
    assert r.status == 200
    gen = client.app[pow_key].gen
    await wait_until(lambda: gen.runner.stats.computed > 0, 20, "generation")
    r = await go_post(client, DOWN)  # as the node's client would send it: no body
    assert r.status == 200 and json.loads(await r.text()) == {"status": "OK", "unloaded": "Org/Tiny-Qwen3"}
    assert not gen.active and engine.v2 is None and engine.model_dir is None
    await wait_until(lambda: rx.got["generated"], 10, "the computed batches delivered")

    # the same requests to a server started with no model get the same answers
    bare = await aiohttp_client(create_app(server_config()))
    await wait_status(bare)
    requests = [("GET", "/health", None), ("GET", "/v1/models", None), ("GET", "/api/v1/state", None),
                ("GET", STATUS, None), ("GET", "/api/v1/inference/pow/status", None),
                ("POST", "/api/v1/inference/pow/init/generate", init_generate_v2("http://127.0.0.1:9/poc"))]
    for method, path, body in requests:
        got = []
        for c in (client, bare):
            r = await (go_get(c, path) if method == "GET" else go_post(c, path, body))
            got.append((r.status, json.loads(await r.text())))
        (code, a), (want_code, b) = got
        for d in (a, b):
            for k in ("created", "version", "elapsed_seconds", "model", "device"):
                d.pop(k, None)
            for be in d.get("backends") or []:
                be.pop("port", None)
        assert (code, a) == (want_code, b), path
        if path.endswith("init/generate"):
            assert code == 409 and "no PoC v2 model is loaded" in a["detail"], a
    assert (await status(client))["is_running"] is False
    r = await client.post(DOWN)  # nothing loaded: stops, answers OK
    assert r.status == 200 and await r.json() == {"status": "OK", "unloaded": None}

    # and the model comes back through the deploy routes
    r = await client.post(ASYNC, json=up("Org/Tiny-Llama"))
    assert r.status == 200
    st = await wait_startup(client)
    assert (st["status"], st["is_running"]) == ("completed", True) and await served_ids(client) == ["Org/Tiny-Llama"]
