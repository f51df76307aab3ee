"""The network's validation tool for an MLNode as the tests replay it (tests/test_validate_tool.py): gonka's
mlnode/packages/benchmarks/scripts/poc_validation/validate.py (the `mlnode-validate` skill; docs: gonka-docs
docs/host/mlnode-validation.md). Its four phases send what it sends (python `requests`: `json=` bodies, so
json.dumps with its default separators and Content-Type: application/json; GETs with no body) in its order, and read
what it reads from each answer, failing where it would stop. Its sleeps (5 s between deploy polls, 30 s warm-up,
60 s of 10 s samples) are the tests' own short ones here; nothing else differs."""

import asyncio
import json
import time

API = "/api/v1"
SERVER_DEFAULT_STAT_TEST = {"dist_threshold": 0.02, "p_mismatch": 0.001, "fraud_threshold": 0.01}  # the tool's copy
# of the MLNode's StatTestModel defaults; an artifact's dist_threshold replaces the first
STARTUP_STATUS = {"status": str, "is_starting": bool, "is_running": bool, "elapsed_seconds": (float, int, None),
                  "error": (str, None)}  # the MLNode's StartupStatus (pydantic: every field present, None as null)
STARTUP_WORDS = {"not_started", "in_progress", "completed", "failed", "cancelled"}


class ToolStopped(Exception):
    """Where the tool raises its RuntimeError and ends with exit code 1."""


async def post(client, path: str, payload) -> tuple[int, object]:
    """requests.post(url, json=payload): the body json.dumps writes, Content-Type application/json."""
    r = await client.post(path, data=json.dumps(payload, allow_nan=False).encode(),
                          headers={"Content-Type": "application/json"})
    return r.status, await _body(r)


async def get(client, path: str) -> tuple[int, object]:
    r = await client.get(path)
    return r.status, await _body(r)


async def _body(r):
    text = await r.text()
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_startup_status(body) -> dict:
    """GET /api/v1/inference/up/status as the MLNode's StartupStatus has it (the tool reads is_running, is_starting,
    status and elapsed_seconds)."""
    assert isinstance(body, dict), body
    for k, types in STARTUP_STATUS.items():
        assert k in body, f"{k} missing from {body}"
        t = types if isinstance(types, tuple) else (types,)
        ok = any(body[k] is None if x is None else isinstance(body[k], x) for x in t)
        assert ok and not (bool not in t and isinstance(body[k], bool)), f"{k}: {body[k]!r} in {body}"
    assert body["status"] in STARTUP_WORDS, body
    return body


# --------------------------------------------------------------------------------------------------
# the phases


async def download(client, repo: str, timeout: float = 5.0, poll: float = 0.05) -> dict:
    """[1/4] POST /models/status {hf_repo, hf_commit: null}; DOWNLOADED ends it, else POST /models/download (200 or
    202) and poll the status until DOWNLOADED (NOT_FOUND after 30 s, or the timeout: it stops)."""
    status = await _model_status(client, repo)
    if status.get("status") == "DOWNLOADED":
        return {"action": "already_downloaded", "last_status": status}
    code, body = await post(client, f"{API}/models/download", {"hf_repo": repo, "hf_commit": None})
    if code not in (200, 202) or not isinstance(body, dict):
        raise ToolStopped(f"POST /models/download failed: {code} {body}")
    if body.get("status") == "DOWNLOADED":
        return {"action": "verified", "last_status": body}
    t0 = time.monotonic()
    while True:
        status = await _model_status(client, repo)
        if status.get("status") == "DOWNLOADED":
            return {"action": "downloaded", "last_status": status}
        if time.monotonic() - t0 > timeout:
            raise ToolStopped(f"model download did not complete in {timeout}s; last status: {status}")
        await asyncio.sleep(poll)


async def _model_status(client, repo: str) -> dict:
    code, body = await post(client, f"{API}/models/status", {"hf_repo": repo, "hf_commit": None})
    if code != 200 or not isinstance(body, dict):
        raise ToolStopped(f"POST /models/status failed: {code} {body}")
    return body


async def startup_status(client) -> dict:
    code, body = await get(client, f"{API}/inference/up/status")
    if code != 200 or not isinstance(body, dict):
        raise ToolStopped(f"GET /inference/up/status failed: {code} {body}")
    return check_startup_status(body)


async def deploy(client, model: str, dtype: str = "auto", additional_args=(), timeout: float = 30.0,
                 poll: float = 0.05) -> dict:
    """[2/4] is_running already: done. Else POST /inference/up/async {model, dtype, additional_args} unless a start
    is under way (200 goes on, 409 is benign, anything else stops it), then poll until is_running; status failed or
    cancelled stops it."""
    status = await startup_status(client)
    if status["is_running"]:
        return {"action": "already_running", "status": status, "posts": []}
    posts = []
    if not status["is_starting"]:
        code, body = await post(client, f"{API}/inference/up/async",
                                {"model": model, "dtype": dtype, "additional_args": list(additional_args)})
        posts.append((code, body))
        if code not in (200, 409):
            raise ToolStopped(f"/inference/up/async failed: {code} {body}")
    t0 = time.monotonic()
    seen = []
    while True:
        status = await startup_status(client)
        seen.append(status)
        if status["is_running"]:
            return {"action": "deployed", "status": status, "posts": posts, "seen": seen}
        if status["status"] in ("failed", "cancelled"):
            raise ToolStopped(f"vLLM startup failed: {status}")
        if time.monotonic() - t0 > timeout:
            raise ToolStopped(f"vLLM did not become ready within {timeout}s; last status: {status}")
        await asyncio.sleep(poll)


async def throughput(client, artifact: dict, batch_size: int = 32, measure_s: float = 1.0,
                     interval: float = 0.25) -> dict:
    """[3/4] POST /inference/pow/init/generate (no callback url; 503 retried), sample GET /inference/pow/status
    (each backend's stats.nonces_per_second and stats.total_processed), then POST /inference/pow/stop with {}."""
    payload = {"block_hash": artifact["block_hash"], "block_height": int(artifact.get("block_height", 100)),
               "public_key": artifact["public_key"], "node_id": int(artifact.get("node_id", 0)),
               "node_count": int(artifact.get("node_count", 1)), "batch_size": int(batch_size),
               "params": {"model": artifact["model"], "seq_len": int(artifact["seq_len"]),
                          "k_dim": int(artifact["k_dim"])}}
    for _ in range(12):
        code, init = await post(client, f"{API}/inference/pow/init/generate", payload)
        if code == 200:
            break
        if code != 503:
            raise ToolStopped(f"/inference/pow/init/generate failed: {code} {init}")
        await asyncio.sleep(interval)
    else:
        raise ToolStopped("/inference/pow/init/generate gave up after 12 retries")
    samples = []
    try:
        t0 = time.monotonic()
        while time.monotonic() - t0 < measure_s:
            await asyncio.sleep(interval)
            code, status = await get(client, f"{API}/inference/pow/status")
            if code != 200 or not isinstance(status, dict):
                raise ToolStopped(f"GET /inference/pow/status failed: {code} {status}")
            backends = status.get("backends", []) or []
            stats = [b.get("stats") or {} for b in backends]
            samples.append({"agg_status": status.get("status"), "n_backends": len(backends),
                            "rates": [float(s.get("nonces_per_second") or 0.0) for s in stats],
                            "processed": [int(s.get("total_processed") or 0) for s in stats]})
    finally:
        await post(client, f"{API}/inference/pow/stop", {})
    return {"init": init, "samples": samples}


async def validate(client, artifact: dict, stat_test: dict, batch_size: int = 64) -> dict:
    """[4/4] POST /inference/pow/generate with the artifact's nonces, wait: true, validation.artifacts and the
    stat_test triple; 200 required; it reads n_total, n_mismatch, mismatch_nonces, p_value, fraud_detected."""
    pieces = artifact["artifacts"]
    payload = {"block_hash": artifact["block_hash"], "block_height": int(artifact.get("block_height", 100)),
               "public_key": artifact["public_key"], "node_id": int(artifact.get("node_id", 0)),
               "node_count": int(artifact.get("node_count", 1)), "nonces": [int(a["nonce"]) for a in pieces],
               "params": {"model": artifact["model"], "seq_len": int(artifact["seq_len"]),
                          "k_dim": int(artifact["k_dim"])},
               "batch_size": int(batch_size), "wait": True, "validation": {"artifacts": pieces},
               "stat_test": dict(stat_test)}
    code, body = await post(client, f"{API}/inference/pow/generate", payload)
    if code != 200:
        raise ToolStopped(f"/inference/pow/generate failed: {code} {body}")
    return body


def stat_test_for(artifact: dict) -> dict:
    """The triple the tool sends: its server defaults, the artifact's dist_threshold and stat_test on top."""
    st = dict(SERVER_DEFAULT_STAT_TEST)
    if artifact.get("dist_threshold") is not None:
        st["dist_threshold"] = float(artifact["dist_threshold"])
    for k in ("p_mismatch", "fraud_threshold"):
        if k in (artifact.get("stat_test") or {}):
            st[k] = float(artifact["stat_test"][k])
    return st


def verdict(response: dict) -> tuple[str, int]:
    """The tool's verdict and exit code: fraud_detected fails (2); mismatches the stat test tolerates pass."""
    if response.get("fraud_detected", False):
        return "FAIL (fraud_detected)", 2
    if int(response.get("n_mismatch") or 0) > 0:
        return "PASS (with mismatches within stat-test tolerance)", 0
    return "PASS", 0
