"""The proof-of-compute model server (PoC v1 and v2 for the Gonka network), aiohttp, one process.

    python model_server.py [--host 127.0.0.1] [--port 18000] [--model DIR] [--served-model-name NAME ...] \
        [--dtype auto|float16|bfloat16|float32] [--device cpu|cuda|cuda:N] [--log-level info] [--spool-dir spool] \
        [--tp 1] [--pp 1] [--replicas 1] [--compile auto|on|off] [--fp8-experts keep|dequant]

Each flag can also be set by an environment variable (POC_HOST, POC_PORT, POC_MODEL, POC_SERVED_MODEL_NAME
(comma-separated), POC_DTYPE, POC_DEVICE, POC_LOG_LEVEL, POC_SPOOL_DIR, POC_TP, POC_PP, POC_REPLICAS, POC_COMPILE,
POC_FP8_EXPERTS); the flag wins. README.md's Configuration table says what each does. Without --model it serves PoC
v1 (the random model is built from each request's params); with --model it loads that Hugging Face checkpoint at
start and serves PoC v2 for it, and v1. It logs one "Application startup complete." line when it can take work.
SIGTERM stops the jobs, ends open streams with a final line and exits 0. An unrecoverable start-up failure (bad
flags, an unusable --spool-dir: exit 2; the port in use: exit 1; the --model checkpoint failing to load: the server
stays up, /health says broken) is one line on stderr starting with FATAL ("Error: POC-FATAL"), the on_error pattern
of worker.py, so that the Vast PyWorker marks the worker failed at once. The log formatter turns every "Error:" of a
logged event into "Error -", so no handled event (whatever text a request carries) can print it.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # runs from a checkout without `pip install -e .`

import asyncio  # noqa: E402
import socket  # noqa: E402

from aiohttp import web  # noqa: E402

from poc.errors import InputError  # noqa: E402
from poc.server.config import check_spool_dir, parse_args  # noqa: E402
from poc.logs import setup_logging  # noqa: E402

FATAL = "Error: POC-FATAL"  # worker.py's on_error pattern: printed only here


def fatal(message: str) -> None:
    print(f"{FATAL} model_server: {' '.join(message.split())}", file=sys.stderr, flush=True)  # one line


async def _fatal_if_load_fails(app: web.Application) -> None:
    """on_startup, after the engine's start-up began loading --model: a failed load is fatal for the PyWorker."""
    from poc.server.context import engine_key, tasks_key

    async def watch():
        await asyncio.shield(app[tasks_key]["load"])
        engine = app[engine_key]
        if engine.state == "broken":
            fatal(engine.broken_reason or "model load failed")

    app[tasks_key]["fatal-watch"] = asyncio.create_task(watch(), name="fatal-watch")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        check_spool_dir(cfg.spool_dir)
        setup_logging(cfg.log_level)
        from poc.server.app import create_app, mark_listening  # torch is imported here, after the flags

        app = create_app(cfg)
        app.on_startup.append(_fatal_if_load_fails)
    except InputError as e:
        fatal(f"bad input: {e.message}")  # the PyWorker marks the worker failed on it
        return 2
    try:
        web.run_app(app, host=cfg.host, port=cfg.port, print=lambda *_: mark_listening(app), shutdown_timeout=30,
                    access_log_format='%a "%r" %s %b %Tf s')
    except OSError as e:  # cannot listen (port in use, bad host), or start-up I/O failed: fatal, one line
        if isinstance(e, socket.gaierror) or "attempting to bind" in str(e):
            fatal(f"cannot serve on {cfg.host}:{cfg.port}: {e.strerror or e}")
        else:
            fatal(f"start-up failed: {type(e).__name__}: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
