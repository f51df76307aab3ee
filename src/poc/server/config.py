"""ServerConfig: the model server's settings, from flags, each also settable by an environment variable.

    python model_server.py [--host 127.0.0.1] [--port 18000] [--model DIR] [--served-model-name NAME ...]
                           [--dtype auto|float16|bfloat16|float32]
                           [--device cpu|cuda] [--log-level info] [--spool-dir spool]
                           [--tp 1] [--pp 1] [--replicas 1] [--layout auto] [--compile auto|on|off]
                           [--fp8-experts keep|dequant] [--fp8-scales ue8m0|float32]
                           [--attention auto|fp8|fp8kv|bf16]

Flag > environment variable (POC_HOST, POC_PORT, POC_MODEL, POC_SERVED_MODEL_NAME (comma-separated), POC_DTYPE,
POC_DEVICE, POC_LOG_LEVEL, POC_SPOOL_DIR, POC_TP, POC_PP, POC_REPLICAS, POC_LAYOUT, POC_COMPILE, POC_FP8_EXPERTS,
POC_FP8_SCALES, POC_ATTENTION) > default. Environment only: POC_API_TOKEN, SIGNER_PUBKEY, POC_ALLOWED_ORIGINS,
POC_OUTBOUND_ALLOW, POC_ALLOWED_CLIENTS (comma-separated), POC_V1_CACHE_IDLE (seconds), and the model's and the ranks'
switches POC_FP8, POC_FP8_FUSED_NORM, POC_FP8_GLUON, POC_TP_REDUCE, POC_POOL_WORKERS (ModelOptions.from_env: `options`,
which the engines get whole), POC_STAGE_TIMING, POC_RANK_PROFILE (RankDiagnostics.from_env: `diagnostics`). The other
fields are limits and timings; tests override them directly.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from aiohttp import web

from poc import dtypes
from poc.errors import InputError
from poc.model.options import ModelOptions
from poc.engine.rankgroup import RankDiagnostics
from poc.switches import env_flag

DTYPE_CHOICES = ("auto", *dtypes.NAMES)
ENV = {"host": "POC_HOST", "port": "POC_PORT", "model": "POC_MODEL", "dtype": "POC_DTYPE", "device": "POC_DEVICE",
       "log_level": "POC_LOG_LEVEL", "spool_dir": "POC_SPOOL_DIR", "tp": "POC_TP", "pp": "POC_PP",
       "replicas": "POC_REPLICAS", "layout": "POC_LAYOUT", "compile": "POC_COMPILE",
       "served_model_name": "POC_SERVED_MODEL_NAME", "compile_at_start": "POC_COMPILE_AT_START"}
MODEL_FLAGS = {f.name: f.metadata for f in dataclasses.fields(ModelOptions) if f.metadata.get("flag")}  # --fp8-scales
DEFAULT_SPOOL_DIR = "spool"  # relative to the working directory (start_server.sh: the checkout, beside ./logs)


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"  # the PyWorker runs on the same host
    port: int = 18000
    model: str | None = None  # a HF checkpoint dir: serve PoC v2 for it (and v1); None: PoC v1 only
    served_model_name: tuple[str, ...] = ()  # more names params.model may use (vLLM's --served-model-name)
    dtype: str = "auto"  # of the v2 checkpoint; auto: its own dtype on CUDA, float32 on CPU
    device: str | None = None  # None: cuda when available, else cpu
    log_level: str = "INFO"
    # several devices (src/poc/parallel): tensor x pipeline parallel groups, and independent replicas of them
    tp: int = 1
    pp: int = 1
    replicas: int = 1  # on CUDA: 0 = as many as the visible GPUs allow
    layout: str = ""  # "auto": tp, pp and replicas picked from the model and the GPUs (poc.engine.auto)
    compile: str = "auto"  # torch.compile on CUDA: auto = on (both protocols; compute.compile_flags), off
    # how models are built and computed (--fp8-scales, --fp8-experts, --attention, POC_FP8, ...: model/options.py)
    options: ModelOptions = ModelOptions()
    diagnostics: RankDiagnostics = RankDiagnostics()  # the rank processes' (POC_STAGE_TIMING, POC_RANK_PROFILE)
    # limits: answered with 400/413/422/429 before any GPU work
    max_body_bytes: int = 16 << 20  # the routes that carry nonce lists (security.BULK_PATHS)
    max_small_body_bytes: int = 64 << 10  # every other route (their real bodies are a few KiB)
    max_batch_size: int = 4096
    max_request_nonces: int = 100_000  # explicit nonce lists (/validate, /api/v1/pow/generate)
    max_queued_nonces: int = 100_000  # the /api/v1/pow/generate queue, as the reference's POC_MAX_QUEUED_NONCES
    max_duration_limit: float = 86_400.0  # the largest max_duration a request may ask for
    default_max_duration: float = 420.0  # the reference's MAX_JOB_DURATION
    # hostile clients and networks (server/security.py, clients/urlpolicy.py)
    header_timeout: float = 10.0  # a connection must send a whole request head within this (also keep-alive idle)
    body_idle_timeout: float = 10.0  # 408 when a body sends nothing for this long
    body_timeout: float = 60.0  # 408 when a body is not complete after this long
    max_connections: int = 256  # requests in flight (not counting /health, /metrics); 503 past it
    api_token: str | None = field(default=None, repr=False)  # POC_API_TOKEN: Authorization: Bearer <token>
    signer_pubkey: str | None = None  # SIGNER_PUBKEY: base64 secp256k1 key checking the node's X-Signature
    allowed_origins: tuple[str, ...] = ()  # POC_ALLOWED_ORIGINS: browser origins allowed to call (none by default)
    outbound_allow: tuple[str, ...] = ()  # POC_OUTBOUND_ALLOW: the only hosts/CIDRs we may call (empty: any allowed)
    allowed_clients: tuple[str, ...] = ()  # POC_ALLOWED_CLIENTS: the only source CIDRs/hosts that may call (empty: any)
    stream_max_waiting: int = 4  # computed batches waiting for a slow /generate reader before the job pauses
    stall_timeout: float = 60.0  # a reader that takes nothing for this long ends the job with reason "stalled"
    # timings
    progress_interval: float = 2.0  # {"status": "progress"} lines
    rate_log_interval: float = 5.0  # "rate: ..." log lines
    callback_interval: float = 5.0  # merged results to {url}/generated, as the reference's sender
    callback_timeout: float = 10.0
    callback_max_pending: int = 10_000  # per destination url; a generation to a full one pauses, never drops
    callback_max_pending_total: int = 100_000  # all destinations together
    callback_max_post_bytes: int = 1_000_000  # a merged POST's body, under aiohttp's default 1 MiB client_max_size
    callback_lifetime: float = 1800.0  # seconds from a record's creation; past it, once a send fails: dead-letter
    callback_backoff: float = 1.0  # first retry delay; doubles up to 30 s
    result_ttl: float = 300.0  # queued /generate results stay readable this long after completion
    shutdown_flush_seconds: float = 5.0  # how long shutdown waits for pending callbacks
    memory_headroom: float = 0.9  # a job may plan to use this fraction of the free memory
    v1_cache_idle: float = 300.0  # POC_V1_CACHE_IDLE: the v1 model a job left is dropped after this idle time; 0: kept
    # durable delivery (clients/spool.py): None keeps callbacks in memory only (tests); the CLI defaults to ./spool
    spool_dir: str | None = None
    spool_segment_records: int = 1000  # records per spool segment file
    callback_backoff_max: float = 30.0  # retry delays double up to this (jittered)
    callback_refusal_limit: int = 1  # a 4xx other than 408/413/429 moves the record to the dead-letter file
    # /pooled (spec-v1 §4.3)
    pooled_poll_interval: float = 0.5  # GET config; commands apply within one interval
    pooled_wait_timeout: float = 600.0  # waiting for a block_hash
    pooled_max_duration: float = 600.0  # a session's default length (the request's max_duration overrides)
    pooled_heartbeat_interval: float = 10.0
    pooled_flush_seconds: float = 10.0  # the final wait for result acknowledgements before /shutdown
    pooled_batch_size: int = 100  # when neither the request nor the orchestrator gives one (gonka's default)
    orchestrator_timeout: float = 10.0  # per call
    orchestrator_retries: int = 5  # tries of connect, ready, shutdown
    orchestrator_retry_base: float = 1.0  # sleeps 1, 2, 4, 8 s between those tries
    # /warmup (spec-v1 §4.2)
    warmup_poll_interval: float = 5.0
    warmup_max_duration: float = 600.0
    # start-up (env only): after a fatal start-up failure stay up with /health 503 and the reason, rather than
    # exit 3 (POC_FATAL_KEEPALIVE=1; scripts/docker_entrypoint.sh sets it for the Vast PyWorker's healthcheck)
    fatal_keepalive: bool = False
    # batch shapes run through the engine before "Application startup complete." (compiled on CUDA): warm_start.py
    compile_at_start: tuple = ()

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise InputError(f"--port must be in 1..65535, got {self.port}", "port")
        for k in ("tp", "pp"):
            if getattr(self, k) < 1:
                raise InputError(f"--{k} must be >= 1, got {getattr(self, k)}", k)
        if self.replicas < 0:
            raise InputError(f"--replicas must be >= 0, got {self.replicas}", "replicas")
        if self.layout not in ("", "auto"):
            raise InputError(f"--layout must be auto (or left out), got {self.layout!r}", "layout")
        if self.layout == "auto" and (self.tp, self.pp, self.replicas) != (1, 1, 1):
            raise InputError(f"--layout auto picks tp, pp and replicas itself: leave out --tp {self.tp}, --pp "
                             f"{self.pp}, --replicas {self.replicas}", "layout")
        if self.compile not in ("auto", "on", "off"):
            raise InputError(f"--compile must be auto, on or off, got {self.compile!r}", "compile")
        for k in ("header_timeout", "body_idle_timeout", "body_timeout", "stall_timeout"):
            if not getattr(self, k) > 0:
                raise InputError(f"{k} must be > 0, got {getattr(self, k)}", k)
        if not self.v1_cache_idle >= 0:
            raise InputError(f"POC_V1_CACHE_IDLE must be >= 0 seconds, got {self.v1_cache_idle}", "v1_cache_idle")
        if self.max_connections < 1 or self.stream_max_waiting < 1:
            raise InputError("max_connections and stream_max_waiting must be >= 1", "max_connections")
        if self.dtype not in DTYPE_CHOICES:
            raise InputError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {self.dtype!r}", "dtype")


config_key = web.AppKey("config", ServerConfig)  # the app's settings: every module of the server reads them here


def check_spool_dir(path: str | None) -> None:
    """Create --spool-dir if needed; an InputError naming the flag when it cannot be created or written."""
    import os
    from pathlib import Path

    if not path:
        return
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"--spool-dir {path} cannot be created: {e.strerror or e}", "spool_dir") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"--spool-dir {path} is not writable", "spool_dir")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, no usage dump
        raise InputError(message)


def parse_args(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> ServerConfig:
    """Flags, then POC_* environment variables, then the defaults."""
    import os

    env = os.environ if env is None else env
    d = ServerConfig()
    from poc import __version__

    ap = _Parser(prog="python model_server.py", description="The PoC model server (v1 and v2, NDJSON streaming).")
    ap.add_argument("--version", action="version", version=f"poc-server {__version__}")
    ap.add_argument("--host", default=env.get(ENV["host"], d.host), help=f"bind address (env {ENV['host']})")
    ap.add_argument("--port", default=env.get(ENV["port"], d.port), help=f"(env {ENV['port']})")
    ap.add_argument("--model", default=env.get(ENV["model"]) or None,
                    help="HF checkpoint dir, or a repo id in the local HF cache, for PoC v2; without it only v1 is "
                         f"served (env {ENV['model']})")
    ap.add_argument("--served-model-name", nargs="+",
                    default=[n.strip() for n in env.get(ENV["served_model_name"], "").split(",") if n.strip()],
                    help="names params.model may use besides the checkpoint's path, e.g. the Hub repo id "
                         f"(env {ENV['served_model_name']}, comma-separated)")
    ap.add_argument("--dtype", default=env.get(ENV["dtype"], d.dtype), help=f"{'|'.join(DTYPE_CHOICES)} (env {ENV['dtype']})")
    ap.add_argument("--device", default=env.get(ENV["device"]) or None, help=f"cpu, cuda or cuda:N (env {ENV['device']})")
    ap.add_argument("--log-level", default=env.get(ENV["log_level"], d.log_level), help=f"(env {ENV['log_level']})")
    ap.add_argument("--spool-dir", default=env.get(ENV["spool_dir"]) or DEFAULT_SPOOL_DIR,
                    help=f"where undelivered callbacks and orchestrator results wait (env {ENV['spool_dir']})")
    for k, default in (("tp", d.tp), ("pp", d.pp), ("replicas", d.replicas)):
        ap.add_argument(f"--{k}", default=env.get(ENV[k], default), help=f"(env {ENV[k]})")
    ap.add_argument("--layout", default=env.get(ENV["layout"], d.layout), metavar="auto",
                    help="auto: the fastest layout of replicas x pp x tp that fits the model on the visible GPUs, "
                         f"instead of --tp/--pp/--replicas (env {ENV['layout']})")
    ap.add_argument("--compile", default=env.get(ENV["compile"], d.compile),
                    help=f"torch.compile on CUDA (same bits as eager, ~2.7x faster v2): auto = on, off (env {ENV['compile']})")
    helps = {"fp8_experts": "with POC_FP8=dequant, FP8 MoE experts: keep (FP8 in memory) or dequant (at load)",
             "fp8_scales": "an FP8 checkpoint's W8A8 scales: ue8m0 (power-of-two, what vLLM computes on Hopper: the "
                           "network's validators) or float32 (vLLM without DeepGEMM)",
             "attention": "the attention recipe: auto (what the validators compute: fp8 for an FP8 MiniMax-M2, bf16 "
                          "otherwise), fp8 (Q, K, V and P in e4m3: vLLM 0.25 with an fp8 KV cache on Hopper), fp8kv "
                          "(K and V in e4m3: vLLM 0.20), bf16"}
    for name, meta in MODEL_FLAGS.items():  # their environment variables are read by ModelOptions.from_env
        ap.add_argument(meta["flag"], dest=name, default=None, help=f"{helps[name]} (env {meta['env']})")
    ap.add_argument("--compile-at-start", default=env.get(ENV["compile_at_start"], ""), metavar="SPEC",
                    help="shapes to compile before the readiness line: v2:BATCH:SEQ_LEN, v1:BATCH (MainNet params) or "
                         f"a JSON list of {{batch_size, params}} (env {ENV['compile_at_start']}; warm_start.py)")
    a = ap.parse_args(argv)
    try:
        port = int(a.port)
    except ValueError:
        raise InputError(f"--port must be an integer, got {a.port!r}", "port") from None
    par = {}
    for k in ("tp", "pp", "replicas"):
        try:
            par[k] = int(getattr(a, k))
        except ValueError:
            raise InputError(f"--{k} must be an integer, got {getattr(a, k)!r}", k) from None
    level = str(a.log_level).upper()
    if level not in ("DEBUG", "INFO", "WARNING", "ERROR"):
        raise InputError(f"--log-level must be debug, info, warning or error, got {a.log_level!r}", "log_level")
    keepalive = env_flag(env, "POC_FATAL_KEEPALIVE", d.fatal_keepalive, "fatal_keepalive")
    options = ModelOptions.from_env(env, **{name: getattr(a, name) for name in MODEL_FLAGS})
    from poc.server import warm_start

    shapes = warm_start.parse(a.compile_at_start, a.model)

    def env_list(name: str) -> tuple[str, ...]:
        return tuple(x.strip() for x in env.get(name, "").split(",") if x.strip())

    idle = env.get("POC_V1_CACHE_IDLE", "").strip() or str(d.v1_cache_idle)
    try:
        v1_cache_idle = float(idle)
    except ValueError:
        raise InputError(f"POC_V1_CACHE_IDLE must be a number of seconds, got {idle!r}", "v1_cache_idle") from None
    return ServerConfig(api_token=env.get("POC_API_TOKEN") or None, signer_pubkey=env.get("SIGNER_PUBKEY") or None,
                        allowed_origins=env_list("POC_ALLOWED_ORIGINS"), outbound_allow=env_list("POC_OUTBOUND_ALLOW"),
                        allowed_clients=env_list("POC_ALLOWED_CLIENTS"), v1_cache_idle=v1_cache_idle,
                        host=a.host, port=port, model=a.model, served_model_name=tuple(a.served_model_name),
                        dtype=a.dtype, device=a.device, log_level=level,
                        spool_dir=a.spool_dir, compile=str(a.compile), layout=str(a.layout).strip().lower(),
                        fatal_keepalive=keepalive, options=options, diagnostics=RankDiagnostics.from_env(env),
                        compile_at_start=shapes, **par)
