"""Layouts through a fresh server each, against the engine alone in that server: nonces/s through the /generate
stream and through /api/v1/pow/init/generate with callbacks to a receiver in this script, the time to the first
callback, each rank's busy share; for the layouts beside one GPU, the v2 artifacts' L2 against one GPU (and one GPU's
own noise), and PoC v1 with two replicas.

    python benchmarks/diagnostics/serve_layouts.py --model random:qwen3-235b-a22b:fp8 --batch 64 \\
        --layouts pp4 tp4 auto rep2tp2 --v1 none --out "$OUT/h100x4/serve_layouts.json"          # four GPUs
    bash benchmarks/run.sh h200x2 serve_layouts   # two GPUs: one, tp2, pp2, rep2 (random:qwen3-8b, bf16) and v1
    python benchmarks/diagnostics/serve_layouts.py --smoke --out /tmp/serve_layouts.json         # CPU, gloo

Each layout starts model_server.py (the flags in LAYOUTS; `auto` is `--layout auto`, named here by the layout it
resolves to: one already measured in this run is not measured again) with `--compile-at-start` of the job's shape
run for N batches: before the readiness line the server's engine runs N batches with nothing consuming them and logs
its own rate (warm_start: timed as poc.bench times it, on the same rank processes the routes then use; with
--bench-process also poc.bench's run_engine in a process of its own, before the server). Then, in this order (the
first job is the node's: a fresh server whose shape was compiled at start):
- /api/v1/pow/init/generate with `batch_size` and `url` (a receiver here counts the artifacts POSTed to it):
  generation runs until /api/v1/pow/status says N batches were processed, then /stop; the rate from its status
  polls, the time from the request to the first callback POST, the artifacts delivered;
- /generate of N batches: the rate from the arrival of the first batch line to the last.
Rates are over the batches after each replica's first (the compile, or a pipeline's fill), timed from the arrival
of the last of those firsts; N = (1 + --timed) x replicas. Each
job's `job K pipeline: {...}` log line gives the ranks' busy share (forward time over their span) and the batches in
flight. The compile caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR) are shared by every server of the run.
A layout whose weights and batch cannot fit the GPUs (poc.engine.auto's estimate) is skipped with its numbers; for a
layout that runs, the most memory nvidia-smi saw in use on each GPU while its server ran, beside that estimate.
The JSON (the command inside) is rewritten after each layout; a PNG beside it at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np


from first_result import WORKLOADS, started_server  # noqa: E402

from poc.bench import pyplot  # noqa: E402
from poc.engine.jobs import steady_rate  # noqa: E402
from poc.protocol import v2  # noqa: E402

LAYOUTS = {"one": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "rep2": ["--replicas", "2"],
           "tp4": ["--tp", "4"], "pp4": ["--pp", "4"], "rep2tp2": ["--tp", "2", "--replicas", "2"],
           "rep2pp2": ["--pp", "2", "--replicas", "2"], "rep4": ["--replicas", "4"], "tp2pp2": ["--tp", "2", "--pp", "2"],
           "auto": ["--layout", "auto"]}
DIMS = {"one": (1, 1, 1), "tp2": (2, 1, 1), "pp2": (1, 2, 1), "rep2": (1, 1, 2), "tp4": (4, 1, 1), "pp4": (1, 4, 1),
        "rep2tp2": (2, 1, 2), "rep2pp2": (1, 2, 2), "rep4": (1, 1, 4), "tp2pp2": (2, 2, 1)}  # (tp, pp, replicas)
SMOKE = dict(device="cpu", model="random:tiny-4l", dtype="float32", seq=16, batch=4, timed=4, compare=16,
             layouts=["one", "pp4", "tp2", "rep2pp2", "auto"], v1="tiny", bench_process=True)
PIPELINE = re.compile(r"job (\d+) pipeline: (\{.*\})\s*$")
ENGINE_ALONE = re.compile(r"compile at start: .*, ([\d.]+) s.*the engine alone after each replica's first batch: "
                          r"([\d.]+) nonces/s")


class GpuMemory:
    """The most memory nvidia-smi reports in use on each GPU while the block runs (sampled every 0.5 s): what a
    layout really takes (CUDA contexts, NCCL buffers, the caching allocator's reserve), against its estimate."""

    def __init__(self):
        self.peak: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                                     capture_output=True, text=True, timeout=10).stdout
                used = [int(x) / 1024 for x in out.split()]  # MiB -> GiB
            except (OSError, ValueError, subprocess.SubprocessError):
                return  # no nvidia-smi (the CPU smoke run): no figure
            self.peak = [max(a, b) for a, b in zip(self.peak, used)] if self.peak else used
            self._stop.wait(0.5)

    def __enter__(self) -> "GpuMemory":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Receiver:
    """POST {url}/generated (and /validated) on 127.0.0.1: the arrival time and artifact count of each."""

    def __init__(self):
        self.posts: list[tuple[float, int]] = []
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    n = len(json.loads(body).get("artifacts", []))
                except ValueError:
                    n = 0
                rx.posts.append((time.monotonic(), n))
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cb"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.posts = []

    def artifacts(self) -> int:
        return sum(n for _, n in self.posts)

    def close(self) -> None:
        self.server.shutdown()


def http(port: int, path: str, body: dict | None = None, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="GET" if body is None else "POST",
                                 data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def polled_rate(seen: list[tuple[float, int]], batch: int, replicas: int = 1) -> float:
    """nonces/s from status polls (time, nonces processed so far): from the poll that first sees every replica's
    first batch done to the last poll, over the nonces processed in between."""
    filled = next(((t, n) for t, n in seen if n >= batch * replicas), None)
    if not filled or seen[-1][0] <= filled[0]:
        return float("nan")
    return (seen[-1][1] - filled[1]) / (seen[-1][0] - filled[0])


def pow_job(port: int, rx: Receiver, body: dict, n_nonces: int, batch: int, timeout: float,
            replicas: int = 1) -> dict:
    """Generation with callbacks until the server has processed n_nonces, then /stop and the delivery. The rate is
    timed from the poll that first sees every replica's first batch done (as poc.engine.jobs.steady_rate)."""
    rx.reset()
    t0 = time.monotonic()
    http(port, "/api/v1/pow/init/generate", {**body, "url": rx.url})
    seen: list[tuple[float, int]] = []
    while True:
        st = http(port, "/api/v1/pow/status").get("stats") or {}
        done = st.get("total_processed", 0) + st.get("dropped_nonces", 0)
        if not seen or done != seen[-1][1]:
            seen.append((time.monotonic(), done))
        if done >= n_nonces:
            break
        if time.monotonic() - t0 > timeout:
            raise RuntimeError(f"pow generation: {done} of {n_nonces} nonces after {timeout:.0f} s")
        time.sleep(0.05)
    http(port, "/api/v1/pow/stop", {})
    t_stop = time.monotonic()
    while rx.artifacts() < done and time.monotonic() - t_stop < 30:
        time.sleep(0.05)
    first = next(((t, n) for t, n in seen if n >= batch), None)
    return {"nonces_per_s": polled_rate(seen, batch, replicas), "processed": done, "delivered": rx.artifacts(),
            "callback_posts": len(rx.posts),
            "first_callback_s": round(rx.posts[0][0] - t0, 3) if rx.posts else None,
            "first_batch_s": round(first[0] - t0, 3) if first else None}


def generate_job(port: int, body: dict, keep_below: int, timeout: float, replicas: int = 1) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    times, sizes, vectors, done = [], [], {}, {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = json.loads(raw)
            if "artifacts" in line:
                times.append(time.monotonic())
                sizes.append(len(line["artifacts"]) + len(line.get("dropped_nonces", [])))
                vectors.update({a["nonce"]: v2.decode(a["vector_b64"]) for a in line["artifacts"]
                                if a["nonce"] < keep_below})
            elif "dist" in line:
                times.append(time.monotonic())
                sizes.append(len(line["dist"]))
            elif line.get("status") == "done":
                done = line
    if done.get("reason") != "max_nonces":
        raise RuntimeError(f"/generate ended {done}")
    return {"nonces_per_s": steady_rate(times, sizes, replicas), "batches": len(sizes),
            "computed": done.get("computed"), "vectors": vectors}


def busy(stats: dict | None) -> list | None:
    if not stats:
        return None
    return [{"rank": x["rank"], "stage": x["stage"], "busy": x["busy"], "starved": x["starved"]}
            for x in sorted(stats["ranks"], key=lambda x: x["rank"])]


def probe(a) -> dict:
    """The device, torch, the GPUs and what --layout auto picks, read in a child process (this one stays off the
    GPUs); the model's weights and a batch's activations a GPU would hold in each layout asked for."""
    code = """
import json, sys
import torch
from poc.engine import auto
a = json.loads(sys.argv[1])
gpus = auto.detect_gpus() if a["device"].startswith("cuda") else []
out = {"torch": torch.__version__, "device": gpus[0].name if gpus else a["device"], "gpus": len(gpus)}
cfg, db, fp8 = auto.model_shape(a["model"], a["dtype"])
c = auto.choose(cfg, gpus, db, fp8)
out["auto"] = [c.tp, c.pp, c.replicas, c.why]
out["need_gib"] = {}
for name, (tp, pp, rep) in {**a["dims"], "auto": (c.tp, c.pp, c.replicas)}.items():
    w, act = auto.need_bytes(cfg, tp, pp, db, fp8, a["batch"], a["seq"])
    out["need_gib"][name] = [w / auto.GiB, act / auto.GiB, tp * pp * rep]
out["room_gib"] = auto.room_bytes(min(g.total_bytes for g in gpus), 0.95) / auto.GiB if gpus else None
print(json.dumps(out))
"""
    arg = json.dumps({"device": a.device, "model": a.model, "dtype": a.dtype, "batch": a.batch, "seq": a.seq,
                      "dims": {k: v for k, v in DIMS.items() if k in a.layouts}})
    out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=300)
    if out.returncode:
        raise RuntimeError(f"probe failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_process(a, dims: tuple[int, int, int], batch: int, env: dict) -> dict:
    """poc.bench's measurement (run_engine: the same batches, timed after the first `replicas` results, since each
    replica's first batch carries its compile) on make_engine of this layout in a process of its own: the model
    built and compiled (from the shared cache) once more."""
    code = """
import json, sys
from poc.bench import BH, PK, run_engine
from poc.engine.jobs import V2Job
from poc.engine.factory import make_engine
from poc.protocol import v1
a = json.loads(sys.argv[1])
tp, pp, rep = a["dims"]
e = make_engine(a["device"], model_dir=a["model"], dtype=a["dtype"], tp=tp, pp=pp, replicas=rep, compile="auto")
e.load()
r = run_engine(e, V2Job(BH, PK, 1, a["seq"], 12, v1.worker_nonces(0, 0, 1), a["batch"]), rep, a["n"] - rep)
r["pipeline"] = getattr(e, "last_job_stats", None)
e.close()
print(json.dumps(r))
"""
    arg = json.dumps({"device": a.device, "model": a.model, "dtype": a.dtype, "dims": dims, "seq": a.seq,
                      "batch": batch, "n": (1 + a.timed) * dims[2]})
    out = subprocess.run([sys.executable, "-c", code, arg], capture_output=True, text=True, timeout=a.timeout,
                         env={**os.environ, **env})
    if out.returncode:
        raise RuntimeError(f"poc.bench process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_layout(a, name: str, extra: list[str], batch: int, groups: int, tmp: Path, rx: Receiver, env: dict,
               keep_below: int) -> tuple[dict, dict]:
    n = (1 + a.timed) * groups
    # "batches" counts a replica's (warm_start): n in all
    shape = json.dumps([{"batch_size": batch, "params": {"seq_len": a.seq, "k_dim": 12}, "batches": n // groups}])
    args = ["--device", a.device, "--model", a.model, "--dtype", a.dtype, "--compile-at-start", shape,
            "--spool-dir", str(tmp / f"spool-{name}"), *extra]
    log = tmp / f"{name}.log"
    row = {"protocol": "v2", "run": name, "args": shlex.join(extra), "batch": batch, "batches": n}
    with started_server(args, log, a.timeout, env) as (port, t_up):
        row["startup_s"] = round(t_up, 2)
        text = log.read_text(errors="replace")
        m = ENGINE_ALONE.search(text)
        row["compile_at_start_s"] = float(m.group(1)) if m else None
        row["engine_nonces_per_s"] = float(m.group(2)) if m else float("nan")
        auto_line = [x for x in text.splitlines() if "--layout auto:" in x]
        if auto_line:
            row["auto"] = auto_line[0].split("--layout auto: ", 1)[1]
        body = {"block_hash": "serve-layouts", "block_height": 1, "public_key": "bench", "node_id": 0,
                "node_count": 1, "batch_size": batch, "params": {"model": a.model, "seq_len": a.seq, "k_dim": 12}}
        if a.pow:
            p = pow_job(port, rx, body, n * batch, batch, a.timeout, groups)
            row.update({f"pow_{k}": v for k, v in p.items()})
        g = generate_job(port, {**body, "max_nonces": max(keep_below, n * batch)}, keep_below, a.timeout, groups)
        vectors = g.pop("vectors")
        row.update(generate_nonces_per_s=g["nonces_per_s"], generate_batches=g["batches"], computed=g["computed"])
        jobs = [json.loads(mm.group(2)) for mm in map(PIPELINE.search, log.read_text(errors="replace").splitlines())
                if mm]
    # the jobs in order: compile at start, pow generation (with --pow), /generate
    row["pipeline"] = {"engine": jobs[0] if jobs else None, "pow": jobs[1] if a.pow and len(jobs) > 2 else None,
                       "generate": jobs[-1] if len(jobs) > 1 else None}
    row["busy"] = {k: busy(v) for k, v in row["pipeline"].items()}
    e = row["engine_nonces_per_s"]
    row["nonces_per_s"] = row["generate_nonces_per_s"]
    row["generate_share"] = row["generate_nonces_per_s"] / e if e == e and e > 0 else None
    if a.pow:
        row["pow_share"] = row["pow_nonces_per_s"] / e if e == e and e > 0 else None
    for k in ("engine_nonces_per_s", "generate_nonces_per_s", "pow_nonces_per_s"):
        if k in row and row[k] == row[k]:
            row[k.replace("_per_s", "_per_min")] = round(60 * row[k], 1)
    return row, vectors


def v1_run(a, name: str, extra: list[str], tmp: Path, env: dict) -> dict:
    params = WORKLOADS["T1"]["v1_params"] if a.v1 == "tiny" else None
    if params is None:
        from poc.protocol.v1 import PARAMS_V2  # gonka's MainNet v1 params

        params = PARAMS_V2.to_json()
    batch = 8 if a.v1 == "tiny" else 64
    groups = 2 if extra else 1
    n = (1 + a.timed) * groups
    body = {"block_hash": "serve-layouts", "block_height": 1, "public_key": "bench", "r_target": 2.0,
            "start_nonce": 0, "batch_size": batch, "dtype": "float16" if a.v1 == "mainnet" else "float32",
            "params": params, "max_nonces": n * batch}
    with started_server(["--device", a.device, "--spool-dir", str(tmp / f"spool-{name}"), *extra],
                        tmp / f"{name}.log", a.timeout, env) as (port, t_up):
        g = generate_job(port, body, 0, a.timeout, groups)
    return {"protocol": "v1", "run": name, "args": shlex.join(extra), "batch": batch, "params": a.v1,
            "nonces_per_s": g["nonces_per_s"], "startup_s": round(t_up, 2), "computed": g["computed"],
            "batches": g["batches"]}


def l2(a: dict, b: dict) -> dict:
    common = sorted(set(a) & set(b))
    d = np.array([np.linalg.norm(a[k].astype(np.float64) - b[k].astype(np.float64)) for k in common])
    return {"mean": float(d.mean()), "p98": float(np.percentile(d, 98)), "max": float(d.max()), "n": len(d)}


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [r for r in res["rows"] if r["protocol"] == "v2" and r["run"] != "one_half_batch" and "error" not in r
            and "skipped" not in r]
    if not rows:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    x = np.arange(len(rows))
    for i, (key, label) in enumerate((("engine_nonces_per_s", "engine alone (same server)"),
                                      ("generate_nonces_per_s", "/generate stream"),
                                      ("pow_nonces_per_s", "pow callbacks"))):
        axes[0].bar(x + (i - 1) * 0.27, [60 * (r.get(key) or 0) for r in rows], 0.27, label=label)
    axes[0].set_xticks(x, [r["run"] for r in rows], fontsize=8)
    axes[0].set_ylabel("nonces/min")
    axes[0].legend(fontsize=7)
    for i, r in enumerate(rows):
        b = (r.get("busy") or {}).get("generate") or []
        if b:
            w = 0.8 / len(b)
            axes[1].bar([i - 0.4 + w * (j + 0.5) for j in range(len(b))], [x["busy"] or 0 for x in b], w)
    axes[1].set_xticks(x, [r["run"] for r in rows], fontsize=8)
    axes[1].set_ylim(0, 1.05)
    axes[1].set_ylabel("rank busy share (/generate job), one bar a rank")
    fig.suptitle(f"{res['model']} seq {res['seq_len']} batch {res['batch']} on {res['device']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/h200x2/serve_layouts.json")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--model", default="random:qwen3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--timed", type=int, default=8, help="timed batches per job (per replica), after the first")
    ap.add_argument("--compare", type=int, default=256, help="nonces 0..N-1 compared against one GPU")
    ap.add_argument("--layouts", nargs="+", default=["one", "tp2", "pp2", "rep2"], choices=list(LAYOUTS))
    ap.add_argument("--no-pow", dest="pow", action="store_false", help="skip the callback path")
    ap.add_argument("--bench-process", action="store_true",
                    help="also poc.bench's run_engine on the layout in a process of its own (one more model build)")
    ap.add_argument("--v1", choices=("mainnet", "tiny", "none"), default="mainnet",
                    help="PoC v1 with two replicas against one GPU: MainNet params (fp16), a tiny model, or skip")
    ap.add_argument("--timeout", type=float, default=900.0, help="per server start and per job")
    ap.add_argument("--budget", type=float, default=None, help="seconds: start no layout after this")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, random:tiny-4l: every step, in minutes")
    a = ap.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            setattr(a, k, v)
    t_begin = time.monotonic()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    info = probe(a)
    cvd = os.environ.get("CUDA_VISIBLE_DEVICES")
    visible = [f"CUDA_VISIBLE_DEVICES={cvd}"] if cvd is not None else []  # the GPUs of a host this run had
    res = {"model": a.model, "dtype": a.dtype, "seq_len": a.seq, "batch": a.batch, "timed": a.timed,
           "command": " ".join(visible + ["python benchmarks/diagnostics/serve_layouts.py",
                                          shlex.join(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": info["device"], "gpus": info["gpus"],
           "torch": info["torch"], "auto": info["auto"][3], "rows": [], "l2_vs_one": {}, "scaling_vs_one": {}}
    print(json.dumps({k: v for k, v in res.items() if k != "rows"}), flush=True)

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    vectors, measured = {}, {}
    rx = Receiver()
    with tempfile.TemporaryDirectory(prefix="poc-serve-layouts-") as tmp:
        tmp = Path(tmp)
        env = {k: os.environ.get(k) or str(tmp / "cache" / d)
               for k, d in (("TORCHINDUCTOR_CACHE_DIR", "inductor"), ("TRITON_CACHE_DIR", "triton"))}
        runs = [(name, LAYOUTS[name], a.batch) for name in a.layouts]
        if "one" in a.layouts:  # one GPU's own noise: the same nonces in another batch split
            runs.insert(a.layouts.index("one") + 1, ("one_half_batch", [], max(1, a.batch // 2)))
        for name, extra, batch in runs:
            if a.budget and time.monotonic() - t_begin > a.budget:
                res["rows"].append({"protocol": "v2", "run": name, "skipped": f"past --budget {a.budget:.0f} s"})
                continue
            dims = tuple(info["auto"][:3]) if name == "auto" else DIMS.get(name.removesuffix("_half_batch"))
            if name == "auto" and dims in measured:
                row = dict(measured[dims], run="auto", same_as=measured[dims]["run"], auto=info["auto"][3])
                res["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("pipeline",)}), flush=True)
                save()
                continue
            need = info["need_gib"].get(name)
            room = info["room_gib"]
            if need and room is not None and (need[0] + need[1] > room or need[2] > info["gpus"]):
                why = (f"{need[2]} GPUs, {info['gpus']} visible" if need[2] > info["gpus"] else
                       f"{need[0]:.1f} GiB of weights + {need[1]:.1f} GiB for the batch a GPU, {room:.1f} GiB usable")
                res["rows"].append({"protocol": "v2", "run": name, "args": shlex.join(extra), "skipped": why})
                print(json.dumps(res["rows"][-1]), flush=True)
                save()
                continue
            groups = dims[2] if dims else 1
            keep = a.compare if name.startswith("one") or "one" in a.layouts else 0
            try:
                bench = bench_process(a, dims, batch, env) if a.bench_process and dims else None
                with GpuMemory() as mem:
                    row, vec = run_layout(a, name, extra, batch, groups, tmp, rx, env, keep)
                if mem.peak:
                    row["gpu_mem_peak_gib"] = [round(x, 2) for x in mem.peak]
                if need:  # poc.engine.auto's estimate for one GPU of this layout: weights + a batch's activations
                    row["estimate_gib"] = [round(need[0], 2), round(need[1], 2)]
                if bench is not None:
                    row["bench_nonces_per_s"] = bench["nonces_per_s"]
                    row["bench_busy"] = busy(bench.get("pipeline"))
            except Exception as e:  # noqa: BLE001 - one layout's failure is a row; the others still run
                log = tmp / f"{name}.log"
                row = {"protocol": "v2", "run": name, "args": shlex.join(extra),
                       "error": f"{type(e).__name__}: {e}"[:500],
                       "log_tail": log.read_text(errors="replace")[-60000:] if log.exists() else None}
                vec = {}
            vectors[name] = vec
            if dims and "error" not in row:
                measured.setdefault(dims, row)
            res["rows"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("pipeline", "log_tail")}), flush=True)
            save()
        if a.v1 != "none" and not (a.budget and time.monotonic() - t_begin > a.budget):
            for name, extra in (("v1_one", []), ("v1_rep2", ["--replicas", "2"])):
                row = v1_run(a, name, extra, tmp, env)
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
                save()
    rx.close()
    one = {r["run"]: r.get("nonces_per_s") for r in res["rows"] if r.get("nonces_per_s") is not None}
    for name in one:
        if name not in ("one", "one_half_batch", "v1_one", "v1_rep2") and "one" in one:
            res["scaling_vs_one"][name] = one[name] / one["one"]
    if "v1_rep2" in one and "v1_one" in one:
        res["scaling_vs_one"]["v1_rep2"] = one["v1_rep2"] / one["v1_one"]
    if vectors.get("one"):
        for name, vec in vectors.items():
            if name != "one" and vec:
                res["l2_vs_one"][name] = l2(vec, vectors["one"])
    res["wall_s"] = round(time.monotonic() - t_begin, 1)
    save()
    print(json.dumps({k: res[k] for k in ("l2_vs_one", "scaling_vs_one", "wall_s")}, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
