"""Soak: a Gonka node's PoC path for a long run, in segments, against a callback receiver that misbehaves. It starts
model_server.py and drives it as the node does: per segment POST /api/v1/inference/pow/init/generate with a new
block_height and block_hash (no batch_size, a callback url on a receiver in this script), then after
--segment-minutes POST /api/v1/inference/pow/stop, then the next segment's init. The receiver takes
{url}/generated; in fault windows it answers 503 (`refuse`, the node outside its PoC window), answers late
(`slow`, --slow-seconds) or resets every other connection without an answer (`reset`), one kind after another.

    python benchmarks/diagnostics/soak.py --device cpu --minutes 3 --segment-minutes 1 --sample-seconds 10 \\
        --fault-start 20 --fault-every 40 --fault-seconds 15 --out benchmarks/cpu/soak_smoke.json   # a CPU smoke run
    python benchmarks/diagnostics/soak.py --device cuda --model random:qwen3-8b --dtype bfloat16 --seq-len 1024 \\
        --minutes 60 --segment-minutes 5 --server-arg=--compile-at-start --server-arg=v2:64:1024 \\
        --out benchmarks/h100/soak.json                                                               # an hour
    python benchmarks/diagnostics/soak.py --device cpu --minutes 60 --segment-minutes 5 --sample-seconds 30 \\
        --fault-start 120 --fault-every 600 --fault-seconds 60 --control-core 0 --server-cores 0 \\
        --out benchmarks/cpu/soak_control_core.json          # an hour on the CPU, the server and its twin on core 0

Every --sample-seconds: nonces computed (/metrics) and received since the last sample, RSS, open fds and CPU time of
the server and of each process it started (the rank processes), each of the server's threads' OS name and CPU time
(its computing threads carry COMPUTING_THREADS' names: the rest serve), the spool's size on disk, the callbacks pending
(/metrics), the machine's CPU seconds (busy, idle, stolen), on the CPU the time of a fixed single-thread probe (how
fast the cores are at that moment: on a shared machine they move) or, with --control-core, what a control process
pinned to that core has counted so far and its CPU seconds (by default the server's twin: the same model computing
batches of the server's shape with no serving; with --server-cores holding the control's core, the two share that
core, so the server's nonces per CPU second divided by the twin's cancel the core's speed), and per GPU (nvidia-smi,
where there is one) memory used, SM clock, temperature and power. Per segment: time from the init to the first callback
POST and to the first one taken, nonces computed (/metrics poc_nonces_computed_total) against delivered, every
callback's block_height against its segment's (the block_hash says which segment computed it), duplicates, and gaps
(the node's lattice positions below the highest delivered that were not delivered: with one engine there are none;
with replicas a stop may leave dealt batches uncomputed). After the last stop the faults end and the script waits
for the spool to drain (--drain-seconds). Writes JSON (the command inside) and a PNG beside it (matplotlib).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from array import array
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from first_result import children, started_server  # noqa: E402  (its folder: this script's)

FAULTS = ("refuse", "slow", "reset")


class Receiver:
    """The node's callback server on loopback, with fault windows [(start, end, kind)] in monotonic time."""

    def __init__(self, slow_seconds: float):
        self.slow_seconds = slow_seconds
        self.windows: list[tuple[float, float, str]] = []
        self.taken: list[dict] = []  # {"t", "height", "hash", "nonces"} of each POST answered 200
        self.attempts: list[tuple[float, int, str]] = []  # (arrival, block_height, outcome) of every POST
        self.lock = threading.Lock()
        self.n = 0
        rx = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                t = time.monotonic()
                if not self.path.endswith("/generated"):
                    return self.answer(200)
                b = json.loads(body)
                fault = rx.fault(t)
                with rx.lock:
                    rx.n += 1
                    n = rx.n
                if fault == "refuse":
                    rx.attempts.append((t, b["block_height"], "refused"))
                    return self.answer(503)
                if fault == "reset" and n % 2:
                    rx.attempts.append((t, b["block_height"], "reset"))
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    self.close_connection = True
                    self.connection.close()  # an RST, no answer: the server cannot know it arrived
                    return None
                if fault == "slow":
                    time.sleep(rx.slow_seconds)
                with rx.lock:
                    rx.attempts.append((t, b["block_height"], "taken"))
                    rx.taken.append({"t": t, "height": b["block_height"], "hash": b["block_hash"],
                                     "nonces": array("q", [a["nonce"] for a in b.get("artifacts") or []])})
                return self.answer(200)

            def answer(self, code: int):
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):
                pass  # the connections this receiver resets on purpose

        self.server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/poc"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def fault(self, t: float) -> str | None:
        return next((k for a, b, k in self.windows if a <= t < b), None)

    def received(self) -> int:
        with self.lock:
            return sum(len(x["nonces"]) for x in self.taken)


def request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 120.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
    return json.loads(text) if path != "/metrics" else text


def metric(text: str, name: str, label: str = "") -> float:
    """The sum of a metric's samples (those whose labels contain `label`)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in (" ", "{") and label in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------------------------------
# the processes and the GPUs


def server_pid() -> int:
    for c in children(os.getpid()):
        try:
            if "model_server.py" in Path(f"/proc/{c}/cmdline").read_bytes().decode(errors="replace"):
                return c
        except OSError:
            continue
    raise RuntimeError("model_server.py is not a child of this process")


TICK = os.sysconf("SC_CLK_TCK")


# The server's threads that compute (their OS names, set by the server: poc.server.stream.JOB_THREAD while a job
# runs, poc.engine.engine.PREPARE_THREAD); the rest of its threads serve (the event loop, the spool, the JSON
# parser). The rank processes it starts compute too.
COMPUTING_THREADS = ("poc-job", "poc-prepare")


def stat_cpu(path: str) -> float:
    """User + system CPU seconds from a /proc .../stat file (a process's: all its threads, the ended ones too)."""
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def proc_stats(pid: int) -> dict | None:
    """RSS, open fds and the CPU time (user + system, all threads) of one process, and per living thread its OS name
    and CPU time (threads: {tid: [name, cpu_s]})."""
    try:
        rss = next(int(x.split()[1]) for x in Path(f"/proc/{pid}/status").read_text().splitlines()
                   if x.startswith("VmRSS:"))
        out = {"pid": pid, "rss_mb": round(rss / 1024, 1), "fds": len(os.listdir(f"/proc/{pid}/fd")),
               "cpu_s": round(stat_cpu(f"/proc/{pid}/stat"), 2)}
        tids = os.listdir(f"/proc/{pid}/task")
    except (OSError, StopIteration, IndexError, ValueError):
        return None
    out["threads"] = {}
    for tid in tids:
        try:
            out["threads"][tid] = [Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip(),
                                   round(stat_cpu(f"/proc/{pid}/task/{tid}/stat"), 2)]
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            pass
    return out


def machine_cpu() -> dict | None:
    """The whole machine's CPU seconds since boot (all cores): busy, idle (with iowait) and stolen by the host."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    except (OSError, ValueError, IndexError):
        return None
    user, nice, system, idle, iowait, irq, softirq, steal = v
    return {"busy_s": round((user + nice + system + irq + softirq) / TICK, 2),
            "idle_s": round((idle + iowait) / TICK, 2),
            "steal_s": round(steal / TICK, 2)}


def dir_bytes(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def gpus() -> list[dict] | None:
    """Per GPU: memory used (MiB), SM clock (MHz), temperature (C), power (W) as nvidia-smi reports them; None
    without nvidia-smi. A field the GPU does not report is null."""
    if not shutil.which("nvidia-smi"):
        return None
    q = "index,memory.used,clocks.sm,temperature.gpu,power.draw"
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None

    def num(x: str):
        try:
            return float(x)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"

    return [dict(zip(("index", "memory_used_mib", "sm_clock_mhz", "temperature_c", "power_w"),
                     (num(v.strip()) for v in line.split(",")))) for line in out.strip().splitlines()]


# --------------------------------------------------------------------------------------------------
# the run


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=60.0, help="the whole run (segments)")
    ap.add_argument("--segment-minutes", type=float, default=5.0, help="from one init to its stop")
    ap.add_argument("--sample-seconds", type=float, default=60.0)
    ap.add_argument("--fault-start", type=float, default=60.0, help="seconds into the run of the first fault")
    ap.add_argument("--fault-every", type=float, default=240.0, help="seconds from one fault's start to the next")
    ap.add_argument("--fault-seconds", type=float, default=60.0, help="how long each fault lasts")
    ap.add_argument("--slow-seconds", type=float, default=3.0, help="a slow answer's delay")
    ap.add_argument("--drain-seconds", type=float, default=300.0, help="after the last stop, for the spool to empty")
    ap.add_argument("--probe-reps", type=int, default=None,
                    help="256x256 matmuls in the core-speed probe a sample (default: 600 on the CPU, none on CUDA)")
    ap.add_argument("--control-core", type=int, default=None, metavar="CPU",
                    help="CPU only: a control process pinned to this core runs fixed work (--control-work) the "
                         "whole run, the server and its processes on --server-cores, this script on the rest; the "
                         "server's rate divided by the control's is its rate at constant core speed")
    ap.add_argument("--server-cores", default=None, metavar="LIST",
                    help="with --control-core: the server's cores, comma-separated (default: all but the control's); "
                         "one of them the control's: the two share it, and this script runs on the rest")
    ap.add_argument("--control-work", choices=("matmul", "twin"), default="twin",
                    help="the control's work: twin, the server's model computing PoC batches of the server's shape "
                         "with no serving (default); matmul, 256x256 float32 matmuls")
    ap.add_argument("--server-arg", action="append", default=[], help="one more model_server.py argument")
    ap.add_argument("--timeout", type=float, default=1800.0, help="the server's start")
    ap.add_argument("--out", default="benchmarks/soak.json")
    ap.add_argument("--summarize", default=None, metavar="JSON",
                    help="no run: recompute the stability summary and the plot of a soak JSON (rewritten in place)")
    a = ap.parse_args(argv)
    if a.probe_reps is None:
        a.probe_reps = 0 if a.device.startswith("cuda") or a.control_core is not None else 600
    if a.summarize:
        path = Path(a.summarize)
        res = json.loads(path.read_text())
        res["stability"] = stability(res["segments"], res["samples"], res.get("faults", []))
        path.write_text(json.dumps(res, indent=1))
        plot(res, path.with_suffix(".png"))
        print(json.dumps(res["stability"], indent=1))
        return
    cmd = " ".join(["python benchmarks/diagnostics/soak.py", shlex.join(argv if argv is not None else sys.argv[1:])])
    seg_s = 60 * a.segment_minutes
    n_seg = max(1, math.ceil(60 * a.minutes / seg_s))
    server_cores = {int(c) for c in a.server_cores.split(",")} if a.server_cores else None
    control = (Control(a.control_core, a.control_work, a.model, a.dtype, a.seq_len, server_cores)  # pins the server
               if a.control_core is not None else None)
    rx = Receiver(a.slow_seconds)
    samples, segments = [], []
    with tempfile.TemporaryDirectory(prefix="poc-soak-") as tmp:
        spool = Path(tmp) / "spool"
        args = ["--device", a.device, "--model", a.model, "--dtype", a.dtype, "--spool-dir", str(spool),
                *a.server_arg]
        with started_server(args, Path(tmp) / "server.log", a.timeout) as (port, startup):
            pid = server_pid()
            if control:
                control.move_harness()
            t0 = time.monotonic()
            end = t0 + n_seg * seg_s
            k, t = 0, t0 + a.fault_start
            while t + a.fault_seconds <= end:  # every fault ends inside the run: the drain meets a well receiver
                rx.windows.append((t, t + a.fault_seconds, FAULTS[k % len(FAULTS)]))
                k, t = k + 1, t + a.fault_every
            done = threading.Event()
            sampler = threading.Thread(target=sample, args=(a, port, pid, spool, rx, t0, samples, done, control),
                                       daemon=True)
            sampler.start()
            for i in range(n_seg):
                segments.append(segment(a, port, rx, t0, i, t0 + (i + 1) * seg_s))
                print(json.dumps(segments[-1]), flush=True)
            t_drain = time.monotonic()
            while metric(request(port, "GET", "/metrics"), "poc_callbacks_pending") > 0:
                if time.monotonic() - t_drain > a.drain_seconds:
                    break
                time.sleep(1.0)
            drain_s = time.monotonic() - t_drain
            done.set()
            sampler.join()
            final = request(port, "GET", "/metrics")
            log_tail = (Path(tmp) / "server.log").read_text(errors="replace").splitlines()[-40:]
    if control:
        control.close()
    res = report(a, rx, segments, samples, t0, final, startup, drain_s, cmd, log_tail)
    if control:
        res["control_cores"] = control.cores
        res["control_work"] = control.work
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    s = res["summary"]
    print(f"wrote {out}: computed {s['computed']}, delivered {s['delivered']}, duplicates {s['duplicates']}, "
          f"gaps {s['gaps']}, callbacks under another segment's height {s['wrong_height']}; ok={s['ok']}")


def segment(a, port: int, rx: Receiver, t0: float, i: int, until: float) -> dict:
    """One segment: init with its block_height, run until `until`, stop; the computed count from /metrics."""
    height, bh = 1000 + i, f"soak-{i}"
    before = metric(request(port, "GET", "/metrics"), "poc_nonces_computed_total")
    body = {"block_hash": bh, "block_height": height, "public_key": "soak", "node_id": 0, "node_count": 1,
            "params": {"model": a.model, "seq_len": a.seq_len}, "url": f"{rx.url}/m"}
    t_init = time.monotonic()
    answer = request(port, "POST", "/api/v1/inference/pow/init/generate", body)
    t_answer = time.monotonic() - t_init
    if answer.get("status") != "OK":
        raise RuntimeError(f"init/generate: {answer}")
    time.sleep(max(0.0, until - time.monotonic()))
    request(port, "POST", "/api/v1/inference/pow/stop", {})
    t_stop = time.monotonic()
    computed = metric(request(port, "GET", "/metrics"), "poc_nonces_computed_total") - before
    return {"segment": i, "block_height": height, "block_hash": bh, "init_at_s": round(t_init - t0, 2),
            "stop_at_s": round(t_stop - t0, 2), "init_answer_s": round(t_answer, 3), "computed": int(computed),
            "fault_at_init": rx.fault(t_init)}


# A fixed piece of work (one thread, float32 matmuls) timed at every sample in a process of its own: the speed of the
# machine's cores at that moment. On a shared virtual machine it moves by several percent from minute to minute, and
# the server's rate with it; the rate times this time is the rate on a core of constant speed.
PROBE = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(256, 256), torch.randn(256, 256)
for line in sys.stdin:
    t = time.perf_counter()
    for _ in range(int(line)):
        a @ b
    print(time.perf_counter() - t, flush=True)
"""


class Probe:
    def __init__(self, reps: int):
        self.reps = reps
        self.proc = subprocess.Popen([sys.executable, "-c", PROBE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})

    def time(self) -> float | None:
        try:
            self.proc.stdin.write(f"{self.reps}\n")
            self.proc.stdin.flush()
            return round(float(self.proc.stdout.readline()), 5)
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# A control runs the whole run in a process pinned to one core (--control-core): its count at each sample gives the
# core speed over every sample's whole span, not over a moment of it. Both controls: pinned to the core in argv[1],
# one thread, a line a second with the time, the count n so far and the process's CPU seconds. --control-work matmul:
# the probe's work without pauses.
COUNTER = """
import os, sys, threading, time
os.sched_setaffinity(0, {int(sys.argv[1])})
import torch
torch.set_num_threads(1)
n = 0
def count():
    while True:
        time.sleep(1.0)
        print(time.monotonic(), n, time.process_time(), flush=True)
threading.Thread(target=count, daemon=True).start()
"""
CONTROL = COUNTER + """
a, b = torch.randn(256, 256), torch.randn(256, 256)
while True:
    for _ in range(50):
        a @ b
    n += 50
"""


# --control-work twin: the control is the server's own work without the serving: the same model built the same way
# (poc.engine.Engine), computing PoC v2 batches of the server's batch size and seq_len back to back, counting nonces.
# It reads and writes memory as the server's forward does, so what slows that work on a shared machine (the memory
# system, the caches other tenants share) slows both; what slows only the serving (the HTTP path, the callbacks, the
# spool, a leak in the server) shows in the server's rate divided by the twin's. On a core of its own it misses what
# slows only the server's core (on a 2-core virtual machine each core's speed wanders by itself); sharing the server's
# core (--server-cores holding --control-core) it runs in the same core's slices as the server, at the same speed.
TWIN = COUNTER + """
from poc.engine.engine import Engine
from poc.protocol import v2
model, dtype, seq_len = sys.argv[2], sys.argv[3], int(sys.argv[4])
e = Engine(device="cpu", model_dir=model, dtype=dtype)
e.load()
batch = e.default_v2_batch(seq_len)
while True:
    e.v2_artifacts("control", "control", range(n, n + batch), seq_len, v2.DEFAULT_K_DIM, batch_size=batch)
    n += batch
"""


class Control:
    """The control loop on `core` (`work`: "matmul", CONTROL; "twin", TWIN on the soak's model, dtype and seq_len).
    The server it starts and that server's processes go to `server_cores` (default: the other cores): this process
    moves there now, so that the server inherits them, and to the remaining cores once the server runs
    (`move_harness`). A control on a core of the server's shares that core with it, slice by slice, so that both see
    the same core speed: the server's nonces per CPU second divided by the control's moves only with the server.
    latest(): (monotonic time, loops or nonces so far, the control's CPU seconds) from its last report, at most a
    second old."""

    def __init__(self, core: int, work: str = "matmul", model: str = "random:tiny", dtype: str = "float32",
                 seq_len: int = 16, server_cores: set[int] | None = None):
        cores = os.sched_getaffinity(0)
        server = set(server_cores) if server_cores else cores - {core}
        if core not in cores or not server or not server <= cores:
            raise SystemExit(f"--control-core {core} --server-cores {sorted(server)}: needs those among this "
                             f"process's cores {sorted(cores)}, and at least one for the server")
        os.sched_setaffinity(0, server)
        self.harness_cores = (cores - server - {core}) or (cores - server) or server
        self.cores = {"control": core, "server": sorted(server), "harness": sorted(self.harness_cores)}
        self.work = work
        script = [CONTROL, str(core)] if work == "matmul" else [TWIN, str(core), model, dtype, str(seq_len)]
        src = str(Path(__file__).resolve().parents[2] / "src")
        path = os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen([sys.executable, "-c", *script], stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path})
        self.last: tuple[float, int] | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            t, n, cpu = line.split()
            self.last = (float(t), int(n), float(cpu))

    def latest(self) -> tuple[float, int, float] | None:
        return self.last

    def move_harness(self) -> None:
        """Every thread of this process (the receiver's, the sampler's) to the cores neither the server nor the
        control was given, where there are any; threads started later inherit their starter's cores."""
        for tid in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(tid), self.harness_cores)
            except OSError:  # a thread that ended meanwhile
                pass

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def sample(a, port: int, pid: int, spool: Path, rx: Receiver, t0: float, out: list, done: threading.Event,
           control: Control | None = None) -> None:
    probe = Probe(a.probe_reps) if a.probe_reps else None
    try:
        sample_loop(a, port, pid, spool, rx, t0, out, done, probe, control)
    finally:
        if probe:
            probe.close()


def sample_loop(a, port, pid, spool, rx, t0, out, done, probe, control=None) -> None:
    last, last_computed = 0, None
    while not done.wait(a.sample_seconds):
        got = rx.received()
        try:
            text = request(port, "GET", "/metrics", timeout=30)
            pending, computed = metric(text, "poc_callbacks_pending"), metric(text, "poc_nonces_computed_total")
        except OSError:
            pending = computed = None
        step = None if computed is None or last_computed is None else int(computed - last_computed)
        last_computed = computed if computed is not None else last_computed
        out.append({"t_s": round(time.monotonic() - t0, 1), "nonces_received": got - last, "nonces_computed": step,
                    "fault": rx.fault(time.monotonic()), "server": proc_stats(pid),
                    "children": [s for s in map(proc_stats, children(pid)) if s], "spool_bytes": dir_bytes(spool),
                    "callbacks_pending": pending, "gpus": gpus(), "machine": machine_cpu(),
                    "harness": proc_stats(os.getpid()), "probe_s": probe.time() if probe else None})
        c = control.latest() if control else None
        if c:  # the control's loops so far and when it counted them (seconds since t0)
            out[-1]["control"] = {"t_s": round(c[0] - t0, 2), "loops": c[1], "cpu_s": round(c[2], 3)}
        last = got


def report(a, rx: Receiver, segments: list, samples: list, t0: float, final: str, startup: float, drain_s: float,
           cmd: str, log_tail: list) -> dict:
    by_hash = {s["block_hash"]: s for s in segments}
    faults = [{"from_s": round(s - t0, 1), "to_s": round(e - t0, 1), "kind": k} for s, e, k in rx.windows]
    wrong = sum(1 for x in rx.taken if by_hash.get(x["hash"], {}).get("block_height") != x["height"])
    for s in segments:
        mine = [x for x in rx.taken if x["hash"] == s["block_hash"]]
        nonces = [n for x in mine for n in x["nonces"]]
        uniq = set(nonces)
        tries = [t for t, h, _ in rx.attempts if h == s["block_height"]]
        t_init = t0 + s["init_at_s"]
        s.update(delivered=len(uniq), duplicates=len(nonces) - len(uniq),
                 gaps=(max(uniq) + 1 - len(uniq)) if uniq else 0,
                 callbacks=len(mine), first_post_s=round(min(tries) - t_init, 3) if tries else None,
                 first_taken_s=round(min(x["t"] for x in mine) - t_init, 3) if mine else None,
                 every_height_its_own=all(x["height"] == s["block_height"] for x in mine))
    outcomes = {}
    for _, _, o in rx.attempts:
        outcomes[o] = outcomes.get(o, 0) + 1
    total = {k: sum(s[k] for s in segments) for k in ("computed", "delivered", "duplicates", "gaps")}
    import torch

    device = torch.cuda.get_device_name() if a.device.startswith("cuda") and torch.cuda.is_available() else a.device
    return {"command": cmd, "device": device, "torch": torch.__version__, "model": a.model, "dtype": a.dtype,
            "seq_len": a.seq_len, "minutes": a.minutes, "segment_minutes": a.segment_minutes,
            "startup_s": round(startup, 2), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "faults": faults, "segments": segments, "samples": samples, "receiver": outcomes,
            "callbacks": {o: metric(final, "poc_callbacks_total", f'outcome="{o}"')
                          for o in ("sent", "retried", "dropped", "dead_letter")},
            "drain_s": round(drain_s, 1), "pending_at_end": metric(final, "poc_callbacks_pending"),
            "summary": {**total, "wrong_height": wrong,
                        "ok": total["computed"] == total["delivered"] and not total["duplicates"] and not wrong},
            "stability": stability(segments, samples, faults),
            "server_log_tail": log_tail}


def trend(t: list, rates: list) -> dict:
    """A slowdown under noise: the least-squares line through the in-segment sample rates over time, its slope as a
    share of the mean rate per hour with a 95% interval (a leak or a growing queue shows as a slope below zero whose
    interval excludes it; a machine whose speed wanders makes the interval wide, not the slope negative), and the
    fastest samples of each quarter of the run (their 90th percentile: what the server still reaches) against the
    first quarter's."""
    import numpy as np
    from scipy import stats

    fit = stats.linregress(np.asarray(t) / 3600.0, rates)
    mean = float(np.mean(rates))
    half = stats.t.ppf(0.975, len(rates) - 2) * fit.stderr
    q = np.array_split(np.asarray(rates, dtype=float), 4) if len(rates) >= 8 else []
    p90 = [float(np.percentile(part, 90)) for part in q]
    return {"slope_per_hour": round(float(fit.slope / mean), 4),
            "slope_95": [round(float((fit.slope - half) / mean), 4), round(float((fit.slope + half) / mean), 4)],
            "quarter_p90_vs_first": [round(v / p90[0], 4) for v in p90] if p90 else None, "n": len(rates)}


def cpu(x: dict) -> float | None:
    """A sample's CPU seconds so far of the server and its processes (None where the sample lacks them)."""
    procs = [x.get("server") or {}] + x.get("children", [])
    return None if any("cpu_s" not in p for p in procs) else sum(p["cpu_s"] for p in procs)


def cpu_split(a: dict, b: dict) -> tuple[float, float] | None:
    """(computing, serving) CPU seconds of the server between samples a and b: computing, its threads that bore a
    COMPUTING_THREADS name at b (their CPU since a; a thread born since, all of its CPU) and its processes'; serving,
    the rest of the server's. None where a sample lacks the threads."""
    sa, sb = a.get("server") or {}, b.get("server") or {}
    if "threads" not in sa or "threads" not in sb or cpu(a) is None or cpu(b) is None:
        return None
    mine = sum(c - (sa["threads"].get(tid) or [None, 0.0])[1] for tid, (name, c) in sb["threads"].items()
               if name in COMPUTING_THREADS)
    procs = (cpu(b) - sb["cpu_s"]) - (cpu(a) - sa["cpu_s"])
    return mine + procs, (sb["cpu_s"] - sa["cpu_s"]) - mine


def segment_holding(segments: list, lo: float, hi: float) -> int | None:
    """The segment whose init-to-stop span holds [lo, hi] (a sample's span), or None (a span across a switch)."""
    return next((i for i, s in enumerate(segments) if s["init_at_s"] <= lo and hi <= s["stop_at_s"]), None)


# A minute this long after a fault window still counts as touched by it: after a refusal the spool's backlog is re-sent
# and generation, paused at callback_max_pending, resumes.
FAULT_AFTER_S = 60.0


def stability(segments: list, samples: list, faults: list = ()) -> dict:
    """Whether the run slowed down or grew: each segment's rate (computed over its init-to-stop span) against the
    first's; the computing rate of each sample whose whole span lies inside one segment (a span across a stop and the
    next init measures the switch, which the segments' first-callback times show, not the rate) against the first
    such sample's, and the same over whole minutes of such samples, per CPU second of the server and its processes,
    at the probe's constant core speed, and divided by the control's speed over the same minute (--control-core; the
    nonces per CPU second divided by the control's per its CPU second too, and that again over the minutes clear of
    the receiver's faults: no fault window in them or in the FAULT_AFTER_S before, with their trend; and over those
    minutes, where the samples name the server's threads, its CPU split as cpu_split does: the nonces per computing
    CPU second at the control's speed, which a server that computes slower lowers, and the serving CPU per nonce at
    the control's speed, which a serving path that costs more per nonce raises, each with its trend); the machine's
    CPU shares; the server's and its processes' RSS and the server's open fds from the first steady sample (the
    second: the first holds the start) to the last; the spool's largest size and its size at the end; the trend of
    the sample rates over the run (`trend`)."""
    out = {}
    rates = [s["computed"] / max(1e-9, s["stop_at_s"] - s["init_at_s"]) for s in segments]
    if rates:
        out["segment_nonces_per_s"] = [round(r, 1) for r in rates]
        out["segment_rate_vs_first"] = {"min": round(min(rates) / rates[0], 4), "max": round(max(rates) / rates[0], 4)}

    inside, when, minutes, per_cpu, steady_core, prev, prev_x = [], [], [], [], [], 0.0, None
    at_control, per_cpu_control, clear_control, clear_when = [], [], [], []
    clear_computing, clear_serving, split_when = [], [], []
    # [segment, nonces, seconds, server CPU seconds or None, probe times, the control's reading before the minute,
    #  [computing, serving] CPU seconds or None]
    acc = None
    for x in samples:
        lo, hi = prev, x["t_s"]
        prev, before = hi, prev_x
        prev_x = x
        seg = segment_holding(segments, lo, hi)
        if x.get("nonces_computed") is None or hi <= lo or seg is None:
            acc = None
            continue
        inside.append(x["nonces_computed"] / (hi - lo))
        when.append((lo + hi) / 2)
        used = None if before is None or cpu(x) is None or cpu(before) is None else cpu(x) - cpu(before)
        # whole minutes of consecutive in-segment samples (a sample holds a few batches: one batch more or less moves
        # a short sample's rate by several percent, a minute's by less)
        split = None if before is None else cpu_split(before, x)
        if acc is None or acc[0] != seg:
            acc = [seg, 0, 0.0, 0.0, [], (before or {}).get("control"), [0.0, 0.0]]
        acc[1] += x["nonces_computed"]
        acc[2] += hi - lo
        acc[3] = None if used is None or acc[3] is None else acc[3] + used
        acc[6] = None if split is None or acc[6] is None else [acc[6][0] + split[0], acc[6][1] + split[1]]
        if x.get("probe_s"):
            acc[4].append(x["probe_s"])
        if acc[2] >= 59.0:
            minutes.append(acc[1] / acc[2])
            if acc[3]:
                per_cpu.append(acc[1] / acc[3])
            if acc[4]:  # nonces/s times the probe's time: the rate on a core of the probe's constant speed
                steady_core.append(acc[1] / acc[2] * sum(acc[4]) / len(acc[4]))
            c0, c1 = acc[5], x.get("control")
            if c0 and c1 and c1["t_s"] > c0["t_s"] and c1["loops"] > c0["loops"]:
                # the rate per control loop: the control's loops a second are the core speed over this minute (per
                # its own CPU second where it reports them: on a core it shares with the server)
                speed = (c1["loops"] - c0["loops"]) / (c1["t_s"] - c0["t_s"])
                at_control.append(acc[1] / acc[2] / speed)
                if "cpu_s" in c0 and "cpu_s" in c1 and c1["cpu_s"] > c0["cpu_s"]:
                    speed = (c1["loops"] - c0["loops"]) / (c1["cpu_s"] - c0["cpu_s"])
                if acc[3]:
                    per_cpu_control.append(acc[1] / acc[3] / speed)
                    start = hi - acc[2]
                    if not any(f["from_s"] < hi and start < f["to_s"] + FAULT_AFTER_S for f in faults):
                        clear_control.append(acc[1] / acc[3] / speed)
                        clear_when.append(hi - acc[2] / 2)
                        if acc[6] and acc[6][0] > 0:  # the two parts of the server's CPU, each at the twin's speed
                            clear_computing.append(acc[1] / acc[6][0] / speed)
                            clear_serving.append(acc[6][1] / acc[1] * speed)
                            split_when.append(hi - acc[2] / 2)
            acc = None
    # on a CPU that other work shares, the wall-clock rate moves with what the others take; the nonces per CPU second
    # of the server and its processes move only with the server's own work per nonce (and the core's speed)
    for key, rates in (("sample_rate_vs_first_steady", inside), ("minute_rate_vs_first_steady", minutes),
                       ("minute_nonces_per_cpu_s_vs_first_steady", per_cpu),
                       ("minute_rate_at_constant_core_speed_vs_first_steady", steady_core),
                       ("minute_rate_at_control_speed_vs_first_steady", at_control),
                       ("minute_nonces_per_cpu_s_at_control_speed_vs_first_steady", per_cpu_control),
                       ("clear_minute_nonces_per_cpu_s_at_control_speed_vs_first_steady", clear_control),
                       ("clear_minute_nonces_per_computing_cpu_s_at_control_speed_vs_first_steady", clear_computing),
                       ("clear_minute_serving_cpu_per_nonce_at_control_speed_vs_first_steady", clear_serving)):
        if len(rates) > 1 and rates[0]:
            out[key] = {"min": round(min(rates[1:]) / rates[0], 4), "max": round(max(rates[1:]) / rates[0], 4),
                        "first": round(rates[0], 1 if rates[0] >= 10 else 4), "n": len(rates)}
    if len(inside) > 2:
        out["trend"] = trend(when, inside)
    if len(clear_control) > 2:  # the same line through the clear minutes at the control's speed
        out["clear_minute_trend_at_control_speed"] = trend(clear_when, clear_control)
    if len(clear_computing) > 2:  # the same for each part of the server's CPU
        out["clear_minute_computing_trend_at_control_speed"] = trend(split_when, clear_computing)
        out["clear_minute_serving_trend_at_control_speed"] = trend(split_when, clear_serving)
    steady = samples[1:]
    m = [x.get("machine") for x in steady]
    if len(m) > 1 and all(m):
        total = sum(m[-1].values()) - sum(m[0].values())
        out["machine_cpu_share"] = {k: round((m[-1][k] - m[0][k]) / total, 4) for k in ("busy_s", "idle_s", "steal_s")}

    def rss(x):
        return (x["server"] or {}).get("rss_mb", 0.0) + sum(c["rss_mb"] for c in x["children"])

    if len(steady) > 1:
        a, b = steady[0], steady[-1]
        out["rss_mb"] = {"first_steady": round(rss(a), 1), "last": round(rss(b), 1),
                         "max": round(max(map(rss, steady)), 1)}
        out["server_fds"] = {"first_steady": (a["server"] or {}).get("fds"), "last": (b["server"] or {}).get("fds"),
                             "max": max((x["server"] or {}).get("fds") or 0 for x in steady)}
        out["spool_mb"] = {"max": round(max(x["spool_bytes"] for x in steady) / 1e6, 2),
                           "last": round(b["spool_bytes"] / 1e6, 2)}
    return out


def control_ratios(samples: list, segments: list = (), computing: bool = False) -> list[tuple[float, float]]:
    """Per sample (minutes, ratio): the server's nonces per CPU second (its processes' too) over the sample divided by
    the control's count per its CPU second over the same span, against the first such sample's; [] without a
    control that reports its CPU seconds. Given the segments, only samples inside one (as stability's). computing:
    per computing CPU second (cpu_split), [] where the samples lack the server's threads."""
    out = []
    for a, b in zip(samples, samples[1:]):
        if segments and segment_holding(segments, a["t_s"], b["t_s"]) is None:
            continue
        ca, cb = a.get("control") or {}, b.get("control") or {}
        if not ("cpu_s" in ca and "cpu_s" in cb) or not b.get("nonces_computed") or None in (cpu(a), cpu(b)):
            continue
        used = cpu(b) - cpu(a)
        if computing:
            split = cpu_split(a, b)
            if split is None:
                continue
            used = split[0]
        if used <= 0 or cb["cpu_s"] <= ca["cpu_s"]:
            continue
        speed = (cb["loops"] - ca["loops"]) / (cb["cpu_s"] - ca["cpu_s"])
        out.append((b["t_s"] / 60, b["nonces_computed"] / used / speed))
    return [(t, r / out[0][1]) for t, r in out]


def plot(res: dict, path: Path) -> None:
    from poc.bench import pyplot

    plt = pyplot()
    if plt is None or not res["samples"]:
        return
    s = res["samples"]
    t = [x["t_s"] / 60 for x in s]
    ratio = control_ratios(s, res["segments"])
    fig, axes = plt.subplots(4 if ratio else 3, 1, figsize=(10, 10 if ratio else 8), sharex=True)
    axes[0].bar(t, [x["nonces_received"] for x in s], width=0.8 * (t[1] - t[0] if len(t) > 1 else 1))
    if any(x.get("nonces_computed") is not None for x in s):
        axes[0].plot(t, [x.get("nonces_computed") for x in s], color="k", lw=1, label="computed")
        axes[0].legend(["computed", "received"], fontsize=7)
    axes[0].set_ylabel(f"nonces / {res['samples'][0]['t_s']:.0f} s")
    axes[1].plot(t, [(x["server"] or {}).get("rss_mb") for x in s], label="server RSS MB")
    axes[1].plot(t, [sum(c["rss_mb"] for c in x["children"]) for x in s], label="its processes' RSS MB")
    axes[1].legend(fontsize=7)
    axes[2].plot(t, [(x["server"] or {}).get("fds") for x in s], label="server open fds")
    axes[2].plot(t, [x["spool_bytes"] / 1e6 for x in s], label="spool MB")
    axes[2].plot(t, [x["callbacks_pending"] for x in s], label="callbacks pending")
    axes[2].legend(fontsize=7)
    if ratio:
        axes[3].plot([tt for tt, _ in ratio], [r for _, r in ratio], marker=".", lw=0.8,
                     label="server's nonces per CPU s / the control's per its CPU s, each sample against the first")
        part = control_ratios(s, res["segments"], computing=True)
        if part:
            axes[3].plot([tt for tt, _ in part], [r for _, r in part], marker=".", lw=0.8,
                         label="the same per computing CPU s (the server's poc-job and poc-prepare threads)")
        axes[3].axhspan(0.98, 1.02, color="green", alpha=0.1)
        axes[3].legend(fontsize=7)
    axes[-1].set_xlabel("minutes")
    colours = {"refuse": "red", "slow": "orange", "reset": "purple"}
    for ax in axes:
        for f in res["faults"]:
            ax.axvspan(f["from_s"] / 60, f["to_s"] / 60, color=colours[f["kind"]], alpha=0.12)
        for seg in res["segments"][1:]:
            ax.axvline(seg["init_at_s"] / 60, color="grey", lw=0.6)
    sm = res["summary"]
    fig.suptitle(f"soak {res['model']} seq {res['seq_len']} on {res['device']}: computed {sm['computed']}, delivered "
                 f"{sm['delivered']}, duplicates {sm['duplicates']} (faults: red 503, orange slow, purple reset)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
