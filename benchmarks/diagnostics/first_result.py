"""Time to the first result in a fresh server process: cold, with the shape compiled at start, and with a warm
compile cache on disk (issue 17). For each workload and mode it starts model_server.py, waits for "Application
startup complete.", POSTs one /generate job, and times the first batch line from the request; then stops the server.

    python benchmarks/diagnostics/first_result.py --workload W3 W5 --out benchmarks/h100/first_result.json
    python benchmarks/diagnostics/first_result.py --workload W1 --out benchmarks/h100/first_result_w1.json   # PoC v1 MainNet
    python benchmarks/diagnostics/first_result.py --workload T --device cpu --out /tmp/first_result.json   # a CPU smoke run

Modes, in this order, per workload (one compile cache directory per workload, empty at its start):
  cold             empty cache, no --compile-at-start: the first batch compiles
  compile_at_start empty cache, --compile-at-start with the job's shape: compiled before the readiness line
  warm_cache       the cache the runs above filled, no --compile-at-start: the first batch loads kernels from disk
  warm_cache_cas   that cache and --compile-at-start: how long the start takes when the cache survives a restart
Writes JSON (the command, device, torch, one row per run: start-up seconds, first-result seconds, the whole job).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
READY = "Application startup complete."
# bench.py's W3/W5 shapes (random weights of the real models, bf16); T: a tiny model for a CPU smoke run
WORKLOADS = {
    "W1": {"model": None, "seq_len": 256, "batch": 64, "dtype": "float16"},  # v1 MainNet params (poc.protocol.v1)
    "W3": {"model": "random:qwen3-0.6b", "seq_len": 64, "batch": 512, "dtype": "bfloat16"},
    "W4": {"model": "random:qwen3-0.6b", "seq_len": 1024, "batch": 64, "dtype": "bfloat16"},
    "W5": {"model": "random:qwen3-8b", "seq_len": 1024, "batch": 16, "dtype": "bfloat16"},
    "T": {"model": "random:tiny", "seq_len": 16, "batch": 8, "dtype": "float32"},
    "T1": {"model": None, "seq_len": 8, "batch": 8, "dtype": "float32",  # v1, a tiny model: a CPU smoke run
           "v1_params": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 256,
                         "ffn_dim_multiplier": None, "multiple_of": 32, "norm_eps": 1e-05, "rope_theta": 10000.0,
                         "use_scaled_rope": False, "seq_len": 8}},
}
MODES = ("cold", "compile_at_start", "warm_cache", "warm_cache_cas")


def children(pid: int) -> list[int]:
    """The processes whose parent is pid (a server's rank processes), from /proc."""
    out = []
    for p in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(p.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(p.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    return sorted(out)


def dump_stacks(pid: int) -> None:
    """SIGUSR1 to a server and the processes it started (its ranks), one after the other (their texts would
    interleave in the shared log): each writes its threads' stacks there (poc.logs.stacks_on_sigusr1)."""
    for p in [pid, *children(pid)]:
        try:
            os.kill(p, signal.SIGUSR1)
        except OSError:
            continue
        time.sleep(1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def v1_params(w: dict) -> dict:
    from poc.protocol.v1 import PARAMS_V2  # gonka's MainNet v1 params

    return w.get("v1_params") or PARAMS_V2.to_json()


@contextmanager
def started_server(args: list[str], log: Path, timeout: float, env: dict | None = None) -> Iterator[tuple[int, float]]:
    """model_server.py with args (plus --port) on a free loopback port, its output in log: yields (port, start-up
    seconds) once its readiness line is out, and stops it (SIGTERM, then kill) on exit."""
    port = free_port()
    cmd = [sys.executable, "-u", str(ROOT / "model_server.py"), "--port", str(port), *args]
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, cwd=ROOT)
    try:
        while READY not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() - t0 > timeout:
                raise RuntimeError(f"server did not start ({shlex.join(args)}):\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        yield port, time.monotonic() - t0
    except BaseException:  # a job failed or hung: every thread's stack of the server and its ranks into the log
        try:  # whether the server's event loop still answers
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                health = r.read()[:500]
        except Exception as e:  # noqa: BLE001 - a diagnosis, whatever it is
            health = f"{type(e).__name__}: {e}"
        print(f"server failed or hung; /health: {health}", file=sys.stderr, flush=True)
        dump_stacks(proc.pid)
        raise
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def one_run(w: dict, mode: str, cache: Path, device: str, log: Path, timeout: float) -> dict:
    v1 = w["model"] is None
    shape = (json.dumps([{"batch_size": w["batch"], "params": v1_params(w), "dtype": w["dtype"]}]) if v1 else
             f"v2:{w['batch']}:{w['seq_len']}")
    args = ["--device", device, "--spool-dir", str(cache.parent / "spool"),
            "--compile-at-start", shape if mode in ("compile_at_start", "warm_cache_cas") else ""]
    if not v1:
        args += ["--model", w["model"], "--dtype", w["dtype"]]
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    with started_server(args, log, timeout, env) as (port, startup):
        body = {"block_hash": f"first-result-{mode}", "block_height": 1, "public_key": "bench",
                "batch_size": w["batch"], "max_nonces": 3 * w["batch"]}
        if v1:  # r_target 2.0: every nonce is reported, so every batch has its line
            body.update(r_target=2.0, start_nonce=0, dtype=w["dtype"], params=v1_params(w))
        else:
            body.update(node_id=0, node_count=1, params={"model": w["model"], "seq_len": w["seq_len"], "k_dim": 12})
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t_req = time.monotonic()
        first = None
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = json.loads(raw)
                if first is None and ("artifacts" in line or "dist" in line):  # a batch line (v2 or v1)
                    first = time.monotonic() - t_req
                if line.get("status") == "done":
                    done = line
        total = time.monotonic() - t_req
        if first is None or done.get("computed") != 3 * w["batch"]:
            raise RuntimeError(f"job incomplete ({mode}): {done}")
        return {"mode": mode, "startup_s": round(startup, 2), "first_result_s": round(first, 3),
                "job_s": round(total, 3), "nonces": done["computed"], "compile_at_start": mode.endswith(("start", "cas")),
                "warm_log": [x for x in log.read_text(errors="replace").splitlines() if "compile at start:" in x]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=["W3", "W5"], choices=list(WORKLOADS))
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, help="override the workloads' batch size")
    ap.add_argument("--timeout", type=float, default=900.0, help="per server start and per job")
    ap.add_argument("--out", default="benchmarks/first_result.json")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="poc-first-result-") as tmp:
        for name in a.workload:
            w = dict(WORKLOADS[name], **({"batch": a.batch} if a.batch else {}))
            cache = Path(tmp) / name / "cache"
            cache.mkdir(parents=True)
            for mode in a.modes:
                row = {"workload": name, **w, **one_run(w, mode, cache, a.device, Path(tmp) / f"{name}-{mode}.log",
                                                         a.timeout)}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "warm_log"}), flush=True)
    device = a.device
    try:
        import torch

        if a.device.startswith("cuda") and torch.cuda.is_available():
            device = torch.cuda.get_device_name()
        torch_version = torch.__version__
    except ImportError:
        torch_version = None
    cmd = " ".join(["python benchmarks/diagnostics/first_result.py", shlex.join(argv if argv is not None else sys.argv[1:])])
    out.write_text(json.dumps({"command": cmd, "device": device, "torch": torch_version, "rows": rows,
                               "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
