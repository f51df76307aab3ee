"""Logging for the server and the rank processes: one line per event, and nothing that the Vast PyWorker would
read as a crash.

The PyWorker marks the worker dead for good when a log line contains one of its on_error substrings
("Traceback (most recent call last):", "Error:", "RuntimeError:", "OutOfMemoryError", "CUDA error"; see
spec/pyworker.md and spec-v1 §6 F13). Handled events are logged as `job failed (ValueError): ...`; the
formatter below also folds any traceback into one line and defuses those substrings in handled messages,
so a third-party `log.exception` cannot kill the worker either. A real CUDA error ("CUDA error") is left
visible: after one the device is unusable and the worker should be replaced.
"""

from __future__ import annotations

import faulthandler
import logging
import re
import signal
import sys

FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATEFMT = "%Y-%m-%d %H:%M:%S"

# "ValueError: x" -> "ValueError - x"; "Traceback" -> "traceback"; "OutOfMemoryError" -> "OutOfMemory"
_DEFUSE = [(re.compile(r"Error:"), "Error -"), (re.compile(r"Traceback"), "traceback"),
           (re.compile(r"OutOfMemoryError"), "OutOfMemory")]


def defuse(text: str) -> str:
    """`text` without the PyWorker's crash markers (except "CUDA error")."""
    for pat, rep in _DEFUSE:
        text = pat.sub(rep, text)
    return text


def describe(e: BaseException) -> str:
    """`(TypeName) message` on one line, for handled failures."""
    return describe_parts(type(e).__name__, str(e))


def describe_parts(type_name: str | None, message: str | None) -> str:
    msg = " ".join(str(message or "").split()) or "-"
    return defuse(f"({type_name or 'Exception'}) {msg}")


class OneLineFormatter(logging.Formatter):
    """`2026-11-22 10:00:00 INFO poc.server: ...`; an exception becomes ` [TypeName: message]` on the same line."""

    def __init__(self, fmt: str = FORMAT):
        super().__init__(fmt, DATEFMT)

    def format(self, record: logging.LogRecord) -> str:
        record.message = record.getMessage()
        record.asctime = self.formatTime(record, self.datefmt)
        s = self.formatMessage(record)
        if record.exc_info and record.exc_info[1] is not None:
            s += " " + describe(record.exc_info[1])
        return defuse(" ".join(s.splitlines()))


def setup_logging(level: str = "INFO") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(OneLineFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)
    # one access line per request is noise next to the rate lines; --log-level debug brings it back
    logging.getLogger("aiohttp.access").setLevel(logging.DEBUG if level == "DEBUG" else logging.WARNING)


def name_os_thread(name: str) -> bool:
    """Give the calling thread `name` (its first 15 bytes) where the OS shows thread names (Linux: `top -H`, `ps -L`,
    /proc/PID/task/TID/comm), so that an operator and the soak benchmark can tell the server's computing threads
    from its serving ones. Python's own thread names stay inside Python. False where this is not Linux's prctl."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(15, name.encode()[:15], 0, 0, 0) == 0  # PR_SET_NAME
    except (OSError, AttributeError):
        return False


def os_thread_name() -> str | None:
    """The calling thread's name as the OS shows it (name_os_thread), or None where it cannot be read."""
    import threading

    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def stacks_on_sigusr1() -> None:
    """`kill -USR1 <pid>` writes every thread's Python stack to stderr (the log) and the process goes on: what a
    hung server or rank process is doing, without stopping it. faulthandler's text ("Thread 0x... (most recent
    call first)") carries none of the PyWorker's crash markers."""
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True, chain=False)
