"""Time from a Gonka node's PoC v2 start to its first callback, on a warm server: how early the node's artifact
store gets work (the chain judges a node by what it committed in the first third of the PoC window). It starts
model_server.py, runs one generation of the shape as a warm-up (compiles it on CUDA), then per run POSTs
/api/v1/inference/pow/init/generate as the node sends it (batch_size left to the MLNode default, 32) with a callback
url on a local receiver, times the first POST {url}/generated from the request, and stops (/api/v1/stop).

    python benchmarks/diagnostics/first_callback.py --device cpu --out benchmarks/cpu/first_callback.json
    python benchmarks/diagnostics/first_callback.py --device cuda --model random:qwen3-8b --dtype bfloat16 \\
        --seq-len 1024 --out benchmarks/h100/first_callback.json

Writes JSON (the command, device, torch, the shape, each run's seconds to the init answer and to the first
callback, and the nonces that callback carried).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from first_result import started_server  # noqa: E402  (its folder: this script's)


class Receiver:
    """The node's callback server on loopback: records when each POST {base}/generated arrived and its nonces."""

    def __init__(self):
        self.got: list[tuple[float, int]] = []  # (arrival, nonces in it)
        self.cond = threading.Condition()
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                t = time.monotonic()
                n = len(json.loads(body).get("artifacts") or []) if self.path.endswith("/generated") else 0
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()
                with rx.cond:
                    rx.got.append((t, n))
                    rx.cond.notify_all()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/poc"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_after(self, t0: float, timeout: float) -> tuple[float, int]:
        with self.cond:
            ok = self.cond.wait_for(lambda: any(t >= t0 for t, _ in self.got), timeout)
            if not ok:
                raise RuntimeError(f"no callback within {timeout} s")
            return next((t, n) for t, n in self.got if t >= t0)


def post(port: int, path: str, body: dict | None, timeout: float) -> dict:
    data = b"" if body is None else json.dumps(body).encode()
    with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=data, method="POST"),
                                timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def run(port: int, rx: Receiver, model: str, seq_len: int, label: str, timeout: float) -> dict:
    body = {"block_hash": f"first-callback-{label}", "block_height": 1, "public_key": "bench", "node_id": 0,
            "node_count": 1, "params": {"model": model, "seq_len": seq_len}, "url": f"{rx.url}/m"}
    t0 = time.monotonic()
    answer = post(port, "/api/v1/inference/pow/init/generate", body, timeout)
    t_answer = time.monotonic() - t0
    if answer.get("status") != "OK":
        raise RuntimeError(f"init/generate: {answer}")
    t_cb, n = rx.wait_after(t0, timeout)
    post(port, "/api/v1/stop", None, timeout)
    time.sleep(0.5)  # the stop's final merged callback, before the next run's clock starts
    return {"run": label, "init_answer_s": round(t_answer, 3), "first_callback_s": round(t_cb - t0, 3),
            "first_callback_nonces": n}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:tiny")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--server-arg", action="append", default=[], help="one more model_server.py argument")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default="benchmarks/first_callback.json")
    a = ap.parse_args(argv)
    rx = Receiver()
    rows = []
    with tempfile.TemporaryDirectory(prefix="poc-first-callback-") as tmp:
        args = ["--device", a.device, "--model", a.model, "--dtype", a.dtype, "--spool-dir", f"{tmp}/spool",
                *a.server_arg]
        with started_server(args, Path(tmp) / "server.log", a.timeout) as (port, startup):
            warm = run(port, rx, a.model, a.seq_len, "warm-up", a.timeout)  # the shape's first batch (compiles)
            print(json.dumps(warm), flush=True)
            for i in range(a.runs):
                rows.append(run(port, rx, a.model, a.seq_len, str(i + 1), a.timeout))
                print(json.dumps(rows[-1]), flush=True)
    import torch

    device = torch.cuda.get_device_name() if a.device.startswith("cuda") and torch.cuda.is_available() else a.device
    cmd = " ".join(["python benchmarks/diagnostics/first_callback.py",
                    shlex.join(argv if argv is not None else sys.argv[1:])])
    firsts = [r["first_callback_s"] for r in rows]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": cmd, "device": device, "torch": torch.__version__, "model": a.model,
                               "dtype": a.dtype, "seq_len": a.seq_len, "batch_size": 32, "startup_s": round(startup, 2),
                               "warm_up": warm, "runs": rows, "median_first_callback_s": statistics.median(firsts),
                               "max_first_callback_s": max(firsts), "date": time.strftime("%Y-%m-%d %H:%M:%S")},
                              indent=1))
    print(f"wrote {out}: median {statistics.median(firsts):.3f} s to the first callback")


if __name__ == "__main__":
    main()
