"""In-process servers for the tests: their config, waiting for a state, and a callback receiver."""

import asyncio
import time

from aiohttp import web

from poc.server.config import ServerConfig

from .golden import v2_checkpoint

QWEN3 = str(v2_checkpoint("qwen3"))
POLL = 0.25  # /pooled's poll interval in pooled_config


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


async def wait_status(client, want=("ready",), timeout=10.0) -> dict:
    t0 = time.monotonic()
    while True:
        r = await client.get("/health")
        h = await r.json()
        if h["state"] in want:
            return h
        assert time.monotonic() - t0 < timeout, h
        await asyncio.sleep(0.02)


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
