"""The model server's entry: flags -> ServerConfig -> create_app() -> web.run_app, and its fatal start-up line.

    python model_server.py [flags]     # from a checkout
    poc-server [flags]                 # the console script of an installed wheel (pyproject.toml)

model_server.py's docstring lists the flags and the exit codes; `--help` too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import sys

from aiohttp import web

from poc.errors import InputError
from poc.server.config import check_spool_dir, parse_args
from poc.logs import setup_logging, stacks_on_sigusr1

FATAL = "Error: POC-FATAL"  # worker.py's on_error pattern: printed only here
EXIT_LOAD_FAILED = 3  # the --model checkpoint failed to load (without POC_FATAL_KEEPALIVE)
_exit_code = 0  # set by the fatal watch before it stops the server


def fatal(message: str) -> None:
    print(f"{FATAL} model_server: {' '.join(message.split())}", file=sys.stderr, flush=True)  # one line


async def _fatal_if_load_fails(app: web.Application) -> None:
    """on_startup, after the engine's start-up began loading --model: a failed load is fatal for the PyWorker."""
    from poc.server.context import config_key, engine_key, tasks_key

    async def watch():
        await asyncio.shield(app[tasks_key]["load"])
        engine = app[engine_key]
        if engine.state == "broken":
            fatal(engine.broken_reason or "model load failed")
            if not app[config_key].fatal_keepalive:  # exit, so that a terminal or a restart policy sees it
                global _exit_code
                _exit_code = EXIT_LOAD_FAILED
                os.kill(os.getpid(), signal.SIGTERM)  # run_app's handler: a clean shutdown, then main returns

    app[tasks_key]["fatal-watch"] = asyncio.create_task(watch(), name="fatal-watch")


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse_args(argv)
        check_spool_dir(cfg.spool_dir)
        if cfg.model:  # a Hugging Face repo id -> its snapshot in the local cache (offline)
            from poc.hub import resolve_model

            cfg = dataclasses.replace(cfg, model=resolve_model(cfg.model))
        setup_logging(cfg.log_level)
        stacks_on_sigusr1()
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
    return _exit_code


if __name__ == "__main__":
    sys.exit(main())
