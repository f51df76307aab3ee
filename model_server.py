"""The proof-of-compute model server (PoC v1 and v2 for the Gonka network), aiohttp, one process.

    python model_server.py [--host 127.0.0.1] [--port 18000] [--model DIR] [--dtype auto|float16|bfloat16|float32] \
        [--device cpu|cuda] [--log-level info]

Each flag can also be set by an environment variable (POC_HOST, POC_PORT, POC_MODEL, POC_DTYPE, POC_DEVICE,
POC_LOG_LEVEL). Without --model it serves PoC v1 (the random model is built from each request's params);
with --model it loads that Hugging Face checkpoint at start and serves PoC v2 for it, and v1. It logs one
"Application startup complete." line when it can take work. SIGTERM stops the jobs, ends open streams with
a final line and exits 0. A fatal start-up failure (bad flags: exit 2; the port in use: exit 1) is one line on
stderr starting with "Error:", so that the Vast PyWorker marks the worker failed at once.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))  # runs from a checkout without `pip install -e .`

from aiohttp import web  # noqa: E402

from poc.errors import InputError  # noqa: E402
from poc.server.config import parse_args  # noqa: E402
from poc.server.logs import setup_logging  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        setup_logging(cfg.log_level)
        from poc.server.app import create_app, mark_listening  # torch is imported here, after the flags

        app = create_app(cfg)
    except InputError as e:
        # fatal at start: the "Error:" prefix is meant for the PyWorker, which marks the worker failed on it
        print(f"Error: model_server: bad input: {e.message}", file=sys.stderr)
        return 2
    try:
        web.run_app(app, host=cfg.host, port=cfg.port, print=lambda *_: mark_listening(app), shutdown_timeout=30,
                    access_log_format='%a "%r" %s %b %Tf s')
    except OSError as e:  # cannot listen (port in use, bad host): fatal, one line
        print(f"Error: model_server: cannot serve on {cfg.host}:{cfg.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
