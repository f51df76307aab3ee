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
Before the SDK's handler (Guard): a body over POC_WORKER_MAX_BODY is a 413, one not received within 60 s a 408, and
an auth_data.reqnum already used a 409 (the SDK's signature covers only auth_data.url, so a captured envelope could
be replayed).
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
from collections import OrderedDict

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
REMEMBERED_REQNUMS = 100_000  # reqnums kept to refuse a replay (the oldest are forgotten first)

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


class Guard:
    """What the SDK does not do before its own handler: bound the body (it reads any size before checking the
    signature, and its signature covers only auth_data.url) and refuse an auth_data.reqnum it has already seen (a
    captured envelope replayed). A reqnum is remembered once the SDK accepted the request (not 401/422), so an unsigned
    request cannot burn a reqnum a real one will use; while one is in flight, the same reqnum is refused."""

    def __init__(self, max_body: int = MAX_BODY, remember: int = REMEMBERED_REQNUMS):
        self.max_body, self.remember = max_body, remember
        self.seen: OrderedDict = OrderedDict()

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
            reqnum = _reqnum(body)
            if reqnum is not None:
                if reqnum in self.seen:
                    return _refusal(409, f"reqnum {reqnum} was already used: a replayed request is refused")
                self.seen[reqnum] = True
                while len(self.seen) > self.remember:
                    self.seen.popitem(last=False)
            accepted = False
            try:
                resp = await handler(request)
                accepted = resp.status not in (401, 422)  # the SDK refused it: its reqnum is not spent
                return resp
            finally:
                if reqnum is not None and not accepted:
                    self.seen.pop(reqnum, None)

        return guarded

    def routes(self, routes: list) -> list:
        return [web.route(r.method, r.path, self.wrap(r.handler), **r.kwargs) for r in routes]


def _reqnum(body: bytes):
    try:
        n = json.loads(body).get("auth_data", {}).get("reqnum")
    except (ValueError, AttributeError, RecursionError):
        return None
    return n if isinstance(n, int) and not isinstance(n, bool) else None


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
    worker.routes = Guard().routes(worker.routes)  # body bound and reqnum replay check before the SDK's handler
    worker.run(host=os.environ.get("POC_WORKER_HOST") or None)


if __name__ == "__main__":
    main()
