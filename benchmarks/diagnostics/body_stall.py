"""What large request bodies do to a running model server: how late its event loop runs while eight 16 MiB JSON
bodies arrive at once (the event loop's stall), and the server's resident memory while bodies arrive, are refused or
are aborted half-sent, and after. It starts model_server.py on the CPU (PoC v1 only) for each case, sends the bodies
from this process over loopback, probes /health every 10 ms from another process, samples the server's VmRSS, and
has the server time its own event loop (a task that sleeps 5 ms and records how late it wakes).

    python benchmarks/diagnostics/body_stall.py --out benchmarks/cpu/body_stall.json
    python benchmarks/diagnostics/body_stall.py --cases ints_bulk aborted --bodies 8 --mib 16

Cases (each on a fresh server):
  floor         no body: two processes spin on the CPU for 5 s (the machine's own scheduling noise in the figures)
  ints_bulk     {"nonces": [0, 1, ...]} to POST /api/v1/pow/generate (a route that takes large bodies)
  lists_bulk    {"nonces": [[], [], ...]} to the same route: the slowest JSON per byte for Python's parser
  string_small  {"block_hash": "xxxx..."} to POST /generate (a route whose real bodies are small)
  aborted       48 bodies announced with Content-Length 16 MiB, half sent, then the connection closed
  aborted_auth  the same against a server with POC_API_TOKEN set, sent without credentials
  parse_ints    no server, no sockets: the ints_bulk body parsed 8 times as the server parses it (bigjson on its
  parse_lists   thread, the server's value limits) while this process's event loop times itself; the same for lists
Writes JSON: the command, the machine, and per case the loop's lateness inside the server (max, p99, wakes later than
100 ms), the /health latencies a client saw (max, p99, median, count), the answers' status codes (or how the connection
ended), and the server's RSS before, at its peak and 3 s after the last body. On a 2-core machine shared with the
sender the client's figures carry the scheduler's noise: the `floor` case measures it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = "Application startup complete."
MiB = 1 << 20
CASES = ("floor", "ints_bulk", "lists_bulk", "string_small", "aborted", "aborted_auth", "parse_ints", "parse_lists")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


LAUNCH = r"""
import asyncio, json, os, sys, time
from aiohttp import web
from poc.server import app as appmod
make = appmod.create_app

def create_app(cfg):  # model_server.py's app, with a task that times the event loop
    app = make(cfg)
    lags = []

    async def watch():
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append((time.time(), time.perf_counter() - t - 0.005))

    async def start(app):
        app["lag_task"] = asyncio.get_running_loop().create_task(watch())

    async def report(app):
        app["lag_task"].cancel()
        with open(os.environ["LAG_FILE"], "w") as f:
            json.dump(lags, f)

    app.on_startup.append(start)
    app.on_shutdown.append(report)
    return app

appmod.create_app = create_app
from poc.serve import main
sys.exit(main(sys.argv[1:]))
"""


class Server:
    def __init__(self, env: dict, tmp: Path):
        self.port = free_port()
        self.log = tmp / f"server-{self.port}.log"
        self.lag_file = tmp / f"lag-{self.port}.json"
        e = {k: v for k, v in os.environ.items() if not k.startswith("POC_")}
        e.update(PYTHONUNBUFFERED="1", LAG_FILE=str(self.lag_file),
                 PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])), **env)
        self.out = open(self.log, "wb")
        self.proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "--port", str(self.port), "--device", "cpu",
                                      "--spool-dir", str(tmp / f"spool-{self.port}")],
                                     stdout=self.out, stderr=subprocess.STDOUT, cwd=ROOT, env=e)
        t0 = time.monotonic()
        while READY not in self.log.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() - t0 > 120:
                raise RuntimeError(f"server did not start:\n{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> list[list[float]]:
        """Stop it; the loop's lateness it recorded: [wall time, seconds late], one per 5 ms wake."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.out.close()
        return json.loads(self.lag_file.read_text()) if self.lag_file.exists() else []


PROBE = r"""
import json, sys, time, urllib.request
url, pid, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def rss():
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
lat, peak = [], 0
while True:
    peak = max(peak, rss())
    t0 = time.perf_counter()
    try:
        urllib.request.urlopen(url, timeout=30).read()
    except OSError:
        pass
    lat.append(time.perf_counter() - t0)
    peak = max(peak, rss())
    try:
        open(stop).close()
        break
    except OSError:
        time.sleep(0.01)
print(json.dumps({"latencies": lat, "peak": peak}))
"""


class Probe:
    """GET /health every 10 ms (a fresh connection each time) and the server's RSS, from a process of its own (a
    thread here would share this process's GIL with the sender and time its waits, not the server's)."""

    def __init__(self, port: int, pid: int, tmp: Path):
        self.stop_file = tmp / f"stop-{port}"
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE, f"http://127.0.0.1:{port}/health", str(pid),
                                      str(self.stop_file)], stdout=subprocess.PIPE, text=True)

    def finish(self) -> tuple[list[float], int]:
        self.stop_file.touch()
        out, _ = self.proc.communicate(timeout=60)
        d = json.loads(out)
        return d["latencies"], d["peak"]


def body_of(case: str, mib: int) -> tuple[str, bytes]:
    n = mib * MiB
    if case == "ints_bulk":
        head, tail = b'{"nonces": [', b"0]}"
        items = b"".join(b"%d, " % i for i in range(n // 8))
        return "/api/v1/pow/generate", head + items[: n - len(head) - len(tail)].rsplit(b",", 1)[0] + b", " + tail
    if case == "lists_bulk":
        head, tail = b'{"nonces": [', b"[]]}"
        return "/api/v1/pow/generate", head + b"[], " * ((n - len(head) - len(tail)) // 4) + tail
    head, tail = b'{"block_hash": "', b'"}'
    return "/generate", head + b"x" * (n - len(head) - len(tail)) + tail


async def post_all(port: int, path: str, body: bytes, count: int) -> list[int | str]:
    async def one() -> int | str:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        answer = asyncio.ensure_future(r.readline())  # read while sending: a refusal may come before the body
        try:
            w.write(f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
            for i in range(0, len(body), MiB):
                if answer.done():
                    break
                w.write(body[i:i + MiB])
                await w.drain()
        except ConnectionError:
            pass
        try:
            line = await asyncio.wait_for(answer, 120)
        except (ConnectionError, asyncio.TimeoutError) as e:
            return type(e).__name__
        finally:
            w.close()
        return int(line.split()[1]) if line else "closed"

    return list(await asyncio.gather(*(one() for _ in range(count))))


async def abort_all(port: int, count: int, mib: int, headers: str = "") -> list[str]:
    async def one() -> str:
        try:
            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(f"POST /api/v1/pow/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                    f"{headers}Content-Length: {mib * MiB}\r\n\r\n".encode())
            chunk = b"[" + b"0," * (MiB // 2 - 1)
            for _ in range(mib // 2):
                w.write(chunk)
                await asyncio.wait_for(w.drain(), 10)
            w.close()
            return "aborted"
        except (ConnectionError, asyncio.TimeoutError) as e:
            return type(e).__name__

    return list(await asyncio.gather(*(one() for _ in range(count))))


def parse_case(case: str, bodies: int, mib: int) -> dict:
    """The parse alone, in this process: what the server's own work does to its loop, without the machine's network
    and the sender competing for the two cores."""
    import gc

    from poc.server import bigjson
    from poc.server.config import ServerConfig

    _, body = body_of(case.replace("parse_", "") + "_bulk", mib)
    n = ServerConfig().max_request_nonces
    gc.freeze()  # as the server does once started

    async def run() -> tuple[list[float], list[str]]:
        lags, answers, done = [], [], asyncio.Event()

        async def watch():
            while not done.is_set():
                t = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - t - 0.005)

        w = asyncio.create_task(watch())
        for _ in range(bodies):
            try:
                await bigjson.parse_off_loop(body, None, 4 * n + 4096, n + 1024)
                answers.append("parsed")
            except ValueError as e:
                answers.append(str(e).split(" (")[0][:40])
        done.set()
        await w
        return sorted(lags), answers

    t0 = time.perf_counter()
    lags, answers = asyncio.run(run())
    return {"case": case, "sent": f"{bodies} x {len(body) / MiB:.1f} MiB parsed in this process",
            "seconds": round(time.perf_counter() - t0, 2), "answers": {a: answers.count(a) for a in set(answers)},
            "loop_lag_ms": {"max": round(lags[-1] * 1e3, 1), "p99": round(lags[int(0.99 * (len(lags) - 1))] * 1e3, 1),
                            "over_100ms": sum(x > 0.1 for x in lags), "wakes": len(lags)}}


def run_case(case: str, bodies: int, mib: int, tmp: Path) -> dict:
    if case.startswith("parse_"):
        return parse_case(case, bodies, mib)
    env = {"POC_API_TOKEN": "bench-token"} if case == "aborted_auth" else {}
    s = Server(env, tmp)
    try:
        time.sleep(1.0)
        base = rss(s.proc.pid)
        probe = Probe(s.port, s.proc.pid, tmp)
        time.sleep(0.5)
        t0, wall0 = time.perf_counter(), time.time()
        if case == "floor":
            hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
            time.sleep(5.0)
            for h in hogs:
                h.kill()
                h.wait()
            answers, sent = [], "nothing; two CPU-bound processes for 5 s"
        elif case.startswith("aborted"):
            answers = asyncio.run(abort_all(s.port, 48, mib))
            sent = "48 x half of %d MiB, then closed" % mib
        else:
            path, body = body_of(case, mib)
            answers = asyncio.run(post_all(s.port, path, body, bodies))
            sent = f"{bodies} x {len(body) / MiB:.1f} MiB to {path}"
            del body
        seconds = time.perf_counter() - t0
        time.sleep(3.0)
        wall1 = time.time()
        latencies, peak = probe.finish()
        after = rss(s.proc.pid)
    finally:
        lags = s.stop()
    lags = sorted(late for t, late in lags if wall0 <= t <= wall1)  # from the first body to 3 s after the last
    lat = sorted(latencies)
    return {"case": case, "sent": sent, "seconds": round(seconds, 2),
            "answers": {str(a): answers.count(a) for a in sorted(set(answers), key=str)},
            "loop_lag_ms": {"max": round(lags[-1] * 1e3, 1), "p99": round(lags[int(0.99 * (len(lags) - 1))] * 1e3, 1),
                            "over_100ms": sum(x > 0.1 for x in lags), "wakes": len(lags)} if lags else None,
            "health_ms": {"max": round(lat[-1] * 1e3, 1), "p99": round(lat[int(0.99 * (len(lat) - 1))] * 1e3, 1),
                          "median": round(statistics.median(lat) * 1e3, 1), "count": len(lat)},
            "rss_mb": {"before": round(base / 1e6), "peak": round(max(peak, after) / 1e6),
                       "after_3s": round(after / 1e6)}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    ap.add_argument("--bodies", type=int, default=8)
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in a.cases:
            row = run_case(case, a.bodies, a.mib, Path(tmp))
            print(json.dumps(row), flush=True)
            rows.append(row)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout
    out = {"command": "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
           "commit": rev.strip(), "cpus": os.cpu_count(), "python": platform.python_version(), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
