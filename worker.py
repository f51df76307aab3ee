"""The Vast.ai serverless PyWorker (vastai==1.9.1) in front of model_server.py: it authenticates requests, queues
them, forwards them to the model server on 127.0.0.1 and reports load and throughput to the autoscaler.

    python worker.py    # beside ./start_server.sh, on a Vast serverless instance

Environment: what Vast sets (CONTAINER_ID, REPORT_ADDR, WORKER_PORT, PUBLIC_IPADDR, VAST_TCP_PORT_<WORKER_PORT>,
optional WORKER_HTTP_PORT, UNSECURED, MASTER_TOKEN, USE_SSL), plus POC_PORT (the model server's port, 18000),
MODEL_LOG (the log start_server.sh writes, /var/log/model/server.log), POC_WORKER_HOST (bind address; default
all interfaces) and the benchmark's POC_BENCH_PARAMS (a params object, v1 or v2), POC_BENCH_NONCES (2048),
POC_BENCH_BATCH (256), POC_BENCH_SEQ_LEN (v2 default 256), POC_BENCH_RUNS (3), and POC_WORKER_MAX_BODY (bytes,
16 MiB: a larger body is a 413 before the SDK reads it).

Routes (forwarded as is; NDJSON streams pass through line by line):
- /generate, /warmup, /pooled: one at a time (the device runs one job), workload = the payload's max_nonces, else
  its batch_size (so the autoscaler's units are nonces);
- /health: in parallel, workload 1;
- /benchmark: the benchmark handler. The SDK's own benchmark stops its clock when the response HEADERS arrive,
  which on a stream is wildly wrong (spec/pyworker.md); here its remote function runs a real /generate job of
  POC_BENCH_NONCES nonces and reads the WHOLE stream, so max_perf is real nonces/s.
Before the SDK's handler (Guard): a body over POC_WORKER_MAX_BODY is a 413, one not received within 60 s a 408, one
that does not decode in its Content-Type's charset a 400 and one without an auth_data object a 422 (the body is read
as the SDK reads it), an auth_data.reqnum that is not a JSON integer in 0..2**63-1 a 422, and a correctly signed one
not above the last accepted a 409. The SDK's signature covers only auth_data.url, so a captured envelope stays a credential for this
worker URL (with a higher reqnum and any payload): serve the worker over TLS (USE_SSL) and keep the model server on
127.0.0.1 (README "Hostile clients and networks").
Readiness: the model server's "Application startup complete." line (on_load), then the benchmark, then
GET /health answering 200 (model_healthcheck_url; it also marks the worker errored later if /health turns 503,
e.g. CUDA broke). on_error is only model_server.py's FATAL line ("Error: POC-FATAL", printed on an unrecoverable
start-up failure): the server's log formatter turns every logged "Error:" into "Error -", so no handled event, and
no text a request carries, can match it (the reference's "Traceback"/"Error:" patterns killed workers on handled
exceptions: spec-v1 §6 F13).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
from aiohttp import web
from vastai.serverless.server.worker import (BenchmarkConfig, HandlerConfig, LogActionConfig, Worker,
                                             WorkerConfig)

MODEL_SERVER_URL = "http://127.0.0.1"
MODEL_SERVER_PORT = int(os.environ.get("POC_PORT", "18000"))
MODEL_LOG = os.environ.get("MODEL_LOG", "/var/log/model/server.log")
READY_LINE = "Application startup complete."  # model_server.py logs it once, when it can take work
FATAL_LINE = "Error: POC-FATAL"  # model_server.FATAL
BENCH_ROUTE = "/benchmark"
MAX_BODY = int(os.environ.get("POC_WORKER_MAX_BODY", str(16 << 20)))  # the model server's own body limit
BODY_TIMEOUT = 60.0  # seconds to receive a whole body

# gonka's v1 MainNet params (spec-v1 §1.1 PARAMS_V2): what a v1 endpoint serves
MAINNET_V1 = {"dim": 1792, "n_layers": 64, "n_heads": 64, "n_kv_heads": 64, "vocab_size": 8196,
              "ffn_dim_multiplier": 10.0, "multiple_of": 8192, "norm_eps": 1e-5, "rope_theta": 10000.0,
              "use_scaled_rope": False, "seq_len": 256}


def workload(default: float):
    """Nonces a request will compute: max_nonces, else batch_size, else `default`."""

    def calc(payload: dict) -> float:
        for k in ("max_nonces", "batch_size"):
            v = payload.get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                return float(v)
        return default

    return calc


def bench_params() -> dict:
    raw = os.environ.get("POC_BENCH_PARAMS")
    if raw:
        return json.loads(raw)
    model = os.environ.get("POC_MODEL")
    if model:  # the server serves PoC v2 for this checkpoint: its directory's name, or the repo id as given
        name = os.path.basename(model.rstrip("/")) if os.path.isdir(model) else model
        return {"model": name, "seq_len": int(os.environ.get("POC_BENCH_SEQ_LEN", "256")), "k_dim": 12}
    return MAINNET_V1


def bench_payload() -> dict:
    """A small real /generate job; the same block hash every time, so its model is built once (by the warm-up)."""
    params = bench_params()
    body = {"block_hash": "pyworker-benchmark", "block_height": 1, "public_key": "pyworker-benchmark",
            "batch_size": int(os.environ.get("POC_BENCH_BATCH", "256")),
            "max_nonces": int(os.environ.get("POC_BENCH_NONCES", "2048")), "max_duration": 600, "params": params}
    if "model" in params:
        body.update(node_id=0, node_count=1)
    else:
        body.update(r_target=1.4013564660458173, start_nonce=0)
    return body


async def run_benchmark_job(**body) -> dict:
    """POST the job to the model server and read the whole stream: the elapsed time covers the computation."""
    url = f"{MODEL_SERVER_URL}:{MODEL_SERVER_PORT}/generate"
    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_read=600)) as http:
        async with http.post(url, json=body) as r:
            raw = await r.read()
            if r.status != 200:
                raise RuntimeError(f"benchmark job refused: HTTP {r.status} {raw[:300]!r}")
    seconds = time.perf_counter() - t0
    lines = [json.loads(x) for x in raw.splitlines() if x.strip()]
    errors = [d for d in lines if "error" in d]
    done = lines[-1] if lines else {}
    if errors or done.get("status") != "done" or done.get("computed") != body.get("max_nonces"):
        raise RuntimeError(f"benchmark job incomplete: {(errors or [done])[0]}")
    return {"computed": done["computed"], "seconds": round(seconds, 4),
            "nonces_per_second": round(done["computed"] / seconds, 3)}


MAX_REQNUM = 2**63 - 1  # a reqnum is an int64 counter


class Guard:
    """What the SDK does not do before its own handler: bound the body (it reads any size before checking the
    signature) and refuse a replayed envelope as far as a replay can be told. The SDK's signature covers only
    `auth_data.url` (RSA PKCS#1 v1.5 over {"url": ...}: the same bytes for every request to this worker), so a
    captured envelope is a standing credential for this worker URL whatever its reqnum and payload; what can be
    refused is a reqnum that is not a JSON integer in 0..2**63-1 (422) or not above the last one accepted (409).
    `signed(auth_data)` is the SDK's own check (True, False, or None while its public key is not loaded): a request
    it will refuse (401) never moves the mark, so an unsigned request cannot block the real ones."""

    def __init__(self, max_body: int = MAX_BODY, signed=None):
        self.max_body = max_body
        self.signed = signed or (lambda _auth: True)
        self.last = -1  # the highest reqnum accepted so far

    def wrap(self, handler):
        async def guarded(request: web.Request) -> web.StreamResponse:
            if request.content_length is not None and request.content_length > self.max_body:
                return _refusal(413, f"request body of {request.content_length} bytes is over {self.max_body}")
            body = bytearray()
            try:
                async with asyncio.timeout(BODY_TIMEOUT):
                    while chunk := await request.content.readany():
                        body += chunk
                        if len(body) > self.max_body:
                            return _refusal(413, f"request body is over {self.max_body} bytes")
            except TimeoutError:
                return _refusal(408, f"request body not received within {BODY_TIMEOUT:g} s")
            request._read_bytes = bytes(body)  # aiohttp's cache of the body: the SDK's request.json() reads it
            auth = sdk_auth_data(request._read_bytes, request.charset)
            if isinstance(auth, web.Response):  # a body the SDK would read otherwise, or not at all: not passed on
                return auth
            refused = self.check(auth)
            if refused is not None:
                return refused
            return await handler(request)

        return guarded

    def check(self, auth: dict) -> web.Response | None:
        """A refusal for this envelope's reqnum, or None (then a correctly signed one has moved the mark)."""
        n = auth.get("reqnum")
        if type(n) is not int or not 0 <= n <= MAX_REQNUM:  # not bool, not 11.0, not 2**70
            return _refusal(422, f"auth_data.reqnum must be a JSON integer in 0..2**63-1, got {str(n)[:40]}")
        if self.signed(auth) is not True:
            return None  # the SDK answers 401; the mark stays
        if n <= self.last:
            return _refusal(409, f"reqnum {n} is not above the last accepted ({self.last}): a replayed envelope "
                                 "is refused")
        self.last = n
        return None

    def routes(self, routes: list) -> list:
        return [web.route(r.method, r.path, self.wrap(r.handler), **r.kwargs) for r in routes]


def sdk_auth_data(body: bytes, charset: str | None) -> dict | web.Response:
    """The envelope's auth_data read exactly as the SDK reads the body (vastai 1.9.1's handler calls aiohttp's
    request.json(): the bytes decoded by the Content-Type's charset, UTF-8 without one, then json.loads of that
    text), or the refusal: a body that does not decode in its charset (400), or that has no auth_data object (422,
    as the SDK answers it). Reading it any other way (json.loads of the bytes guesses UTF-8/16/32) let a body
    declared `charset=latin-1` with one non-ASCII byte skip the reqnum check while the SDK read and forwarded it."""
    try:
        text = body.decode(charset or "utf-8")
    except (LookupError, UnicodeDecodeError):
        return _refusal(400, f"the body does not decode as {str(charset or 'utf-8')[:40]} (its Content-Type's charset)")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return _refusal(422, "the body is not JSON")
    auth = data.get("auth_data") if isinstance(data, dict) else None
    if not isinstance(auth, dict):
        return _refusal(422, "auth_data (an object) is required")
    return auth


def sdk_signature(backend):
    """The SDK's signature check, without its side effects: True when `auth_data.signature` is the autoscaler's RSA
    PKCS#1 v1.5 signature of json.dumps({"url": auth_data.url}, indent=4, sort_keys=True) (spec/pyworker.md), or the
    worker is UNSECURED; None while the public key is not loaded (the SDK refuses everything then)."""
    import base64

    from Crypto.Hash import SHA256
    from Crypto.Signature import pkcs1_15

    def signed(auth: dict) -> bool | None:
        if backend.unsecured:
            return True
        key = getattr(backend, "_pubkey", None)  # vastai 1.9.1's Backend keeps the key it fetched from /pubkey/
        if key is None:
            return None
        msg = json.dumps({"url": auth.get("url")}, indent=4, sort_keys=True)
        try:
            pkcs1_15.new(key).verify(SHA256.new(msg.encode()), base64.b64decode(auth.get("signature") or ""))
            return True
        except (ValueError, TypeError):
            return False

    return signed


def _refusal(status: int, why: str) -> web.Response:
    resp = web.json_response({"error": why}, status=status)
    resp.force_close()  # the unread rest of a body is not waited for
    return resp


def build_config() -> WorkerConfig:
    job = dict(allow_parallel_requests=False)  # one device, one job: the PyWorker's FIFO, not a 409
    return WorkerConfig(
        model_server_url=MODEL_SERVER_URL,
        model_server_port=MODEL_SERVER_PORT,
        model_log_file=MODEL_LOG,
        model_healthcheck_url="/health",
        handlers=[
            HandlerConfig(route="/generate", max_queue_time=60.0, workload_calculator=workload(1024.0), **job),
            HandlerConfig(route="/warmup", max_queue_time=120.0, workload_calculator=workload(100.0), **job),
            HandlerConfig(route="/pooled", max_queue_time=60.0, workload_calculator=workload(100.0), **job),
            HandlerConfig(route="/health", allow_parallel_requests=True, max_queue_time=5.0,
                          workload_calculator=lambda _p: 1.0),
            HandlerConfig(route=BENCH_ROUTE, remote_function=run_benchmark_job, workload_calculator=workload(2048.0),
                          benchmark_config=BenchmarkConfig(generator=bench_payload, concurrency=1,
                                                           runs=int(os.environ.get("POC_BENCH_RUNS", "3"))),
                          **job),
        ],
        log_action_config=LogActionConfig(on_load=[READY_LINE], on_error=[FATAL_LINE]),
    )


def main() -> None:
    worker = Worker(build_config())
    guard = Guard(signed=sdk_signature(worker.backend))
    worker.routes = guard.routes(worker.routes)  # body bound and reqnum checks before the SDK's handler
    worker.run(host=os.environ.get("POC_WORKER_HOST") or None)


if __name__ == "__main__":
    main()
