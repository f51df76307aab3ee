"""In-process servers for the tests: their config, the requests they are sent (golden set A for v1, the tiny qwen3
checkpoint for v2), reading their answers, waiting for a state, raw loopback connections, and a callback receiver."""

import asyncio
import json
import socket
import time

from aiohttp import web

from poc.server.config import ServerConfig

from .golden import V1_GOLDEN as G1, V2_GOLDEN as G2, v2_checkpoint

QWEN3 = str(v2_checkpoint("qwen3"))
POLL = 0.25  # /pooled's poll interval in pooled_config
BH, PK = G1["block_hash"], G1["public_key"]
SET_A = G1["sets"]["A_gqa_plain_rope"]
PARAMS_A = SET_A["params"]
P2 = G2["parameters"]
V1_KEYS = ["worker_id", "public_key", "block_hash", "block_height", "nonces", "dist", "node_id", "batch_number",
           "batch_computed", "batch_valid", "total_computed", "total_valid", "elapsed_seconds", "next_nonce",
           "aggregated_batch_number", "aggregated_total_computed", "aggregated_total_valid", "n_workers"]
POW = "/api/v1/pow"
POST = b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def server_config(**kw) -> ServerConfig:
    base = dict(device="cpu", dtype="float32", progress_interval=0.2, rate_log_interval=0.5, callback_interval=0.2,
                callback_backoff=0.05, max_body_bytes=256 << 10, shutdown_flush_seconds=1.0)
    base.update(kw)
    return ServerConfig(**base)


def pooled_config(tmp_path, **kw) -> ServerConfig:
    base = dict(spool_dir=str(tmp_path / "spool"), pooled_poll_interval=POLL, pooled_heartbeat_interval=0.3,
                orchestrator_retry_base=0.05, orchestrator_timeout=2.0, callback_backoff=0.05,
                callback_backoff_max=0.4, callback_timeout=2.0, pooled_flush_seconds=5.0, progress_interval=60.0)
    base.update(kw)
    return server_config(**base)


def v1_request(**kw) -> dict:
    req = {"block_hash": BH, "block_height": 12345, "public_key": PK, "r_target": 2.0, "batch_size": 5,
           "start_nonce": 0, "params": dict(PARAMS_A), "max_nonces": 16}
    req.update(kw)
    return req


def v2_request(**kw) -> dict:
    p = G2["parameters"]
    req = {"block_hash": p["block_hash"], "block_height": 7, "public_key": p["public_key"], "node_id": 0,
           "node_count": 1, "batch_size": 3, "max_nonces": 8,
           "params": {"model": "qwen3", "seq_len": p["seq_len"], "k_dim": p["k_dim"]}}
    req.update(kw)
    return req


def validate_request(run, **kw) -> dict:
    keep = [i for i, n in enumerate(run["nonces"]) if n in run["nonces_below_r_target"]]
    req = {"public_key": PK, "block_hash": BH, "block_height": 12345, "nonces": [run["nonces"][i] for i in keep],
           "dist": [run["dist"][i] for i in keep], "node_id": 0, "params": dict(PARAMS_A),
           "r_target": G1["r_target_used_for_filter"], "fraud_threshold": 1e-7}
    req.update(kw)
    return req


def gen_body(nonces, **kw) -> dict:
    """A v2 POST /api/v1/pow/generate body for the tiny qwen3 checkpoint."""
    b = {"block_hash": P2["block_hash"], "block_height": 3, "public_key": P2["public_key"], "node_id": 0,
         "node_count": 1, "nonces": list(nonces), "batch_size": 3,
         "params": {"model": "qwen3", "seq_len": P2["seq_len"], "k_dim": P2["k_dim"]}}
    b.update(kw)
    return b


async def first_batch_line(resp) -> dict:
    """The first line that is not a progress line (on a loaded machine a progress line can come first)."""
    while True:
        d = json.loads(await resp.content.readline())
        if d.get("status") != "progress":
            return d


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{") and line.split(" ")[0] == name:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def wait_status(client, want=("ready",), timeout=10.0) -> dict:
    t0 = time.monotonic()
    while True:
        r = await client.get("/health")
        h = await r.json()
        if h["state"] in want:
            return h
        assert time.monotonic() - t0 < timeout, h
        await asyncio.sleep(0.02)


async def wait_job(client, rid: str, want: str, timeout: float = 20.0) -> dict:
    t0 = time.monotonic()
    while True:
        d = await (await client.get(f"{POW}/generate/{rid}")).json()
        if d["status"] == want:
            return d
        assert time.monotonic() - t0 < timeout and d["status"] in ("queued", "running"), d
        await asyncio.sleep(0.01)


async def raw(client, head: bytes, buffers: int | None = None):
    """A raw loopback connection to the test server that has sent `head`; `buffers`: the kernel's socket buffers of
    both ends, made that small (a few KiB stand for the megabytes a real stalled connection absorbs first)."""
    s = socket.socket()
    if buffers:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffers)
    s.setblocking(False)
    before = set(client.server.runner.server.connections) if buffers else set()
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", client.server.port))
    r, w = await asyncio.open_connection(sock=s)
    if buffers:
        while not set(client.server.runner.server.connections) - before:
            await asyncio.sleep(0.01)
        for h in set(client.server.runner.server.connections) - before:
            h.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffers)
    w.write(head)
    await w.drain()
    return r, w


class Sink:
    """A callback receiver: records POST /generated and /validated (body and Idempotency-Key)."""

    def __init__(self, fail_first: int = 0):
        self.got: dict[str, list] = {"generated": [], "validated": []}
        self.keys: list[str] = []
        self.fail_first = fail_first
        self.app = web.Application()
        self.app.router.add_post("/cb/{kind}", self.handle)

    async def handle(self, request):
        if self.fail_first > 0:
            self.fail_first -= 1
            return web.json_response({"error": "try later"}, status=500)
        self.got[request.match_info["kind"]].append(await request.json())
        self.keys.append(request.headers.get("Idempotency-Key"))
        return web.json_response({"ok": True})

    async def wait(self, kind: str, n: int = 1, timeout: float = 10.0) -> list:
        t0 = time.monotonic()
        while len(self.got[kind]) < n:
            assert time.monotonic() - t0 < timeout, self.got
            await asyncio.sleep(0.02)
        return self.got[kind]


def hub_cache(root, repo_id: str, src=None, rev: str = "0123456789abcdef0123456789abcdef01234567", skip=()):
    """A model in a Hugging Face hub cache laid out as huggingface_hub writes it: models--Org--Name/blobs/<hash>,
    snapshots/<rev>/<file> a link to its blob, refs/main naming <rev>. The files come from the checkpoint
    directory `src` (those named in `skip` left out: a partial download). Returns the snapshot directory."""
    import hashlib
    from pathlib import Path

    repo = Path(root) / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap.mkdir(parents=True)
    for f in sorted(Path(src).iterdir()) if src is not None else ():
        if f.name in skip:
            continue
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", blob.name))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snap
