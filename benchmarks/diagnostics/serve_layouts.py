"""One GPU, tp=2, pp=2 and two replicas, each measured through a fresh server's /generate stream: nonces/s, the
scaling against one GPU, and the v2 artifacts' L2 against one GPU beside one GPU's own noise; then PoC v1 with two
replicas against one GPU.

    bash benchmarks/run.sh h200x2 serve_layouts          # -> benchmarks/h200x2/serve_layouts.json (+ .png)
    python benchmarks/diagnostics/serve_layouts.py --device cpu --model random:tiny --dtype float32 --seq 16 \\
        --batch 4 --timed 3 --compare 8 --v1 tiny --out /tmp/serve_layouts.json          # a CPU smoke run (gloo)

Every run starts model_server.py (`--model`, default random:qwen3-8b in bf16; `--tp 2`, `--pp 2` or `--replicas 2`),
waits for its readiness line, POSTs one /generate job of (warm + timed) batches and times the batch lines as they
arrive: nonces/s over the timed batches (the warm ones absorb the compile). The v2 jobs start at nonce 0, so every
layout computes the same first `--compare` nonces; their decoded artifacts are compared with one GPU's (L2 per nonce:
mean, p98, max). One GPU's own noise: the same nonces at half the batch size (another batch split), beside them.
`random:<preset>` makes the same weights in every layout. v1: the MainNet parameters in fp16 (`--v1 tiny`: a small
model for the CPU), one GPU and `--replicas 2`, every nonce reported (r_target 2). Writes JSON (the command inside)
and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from first_result import WORKLOADS, started_server  # noqa: E402

from poc.bench import pyplot  # noqa: E402
from poc.protocol import v2  # noqa: E402

LAYOUTS = {"one": [], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"], "rep2": ["--replicas", "2"]}


def run_server(args: list[str], body: dict, log: Path, timeout: float, keep_below: int) -> dict:
    """Start model_server.py with args, run one /generate job, stop the server: start-up seconds, the batch lines'
    arrival times and sizes, and the v2 vectors of nonces below keep_below."""
    with started_server([*args, "--spool-dir", str(log.parent / f"spool-{log.stem}")], log, timeout) as (port, t_up):
        req = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        times, sizes, vectors, done = [], [], {}, {}
        t_req = time.monotonic()
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
            raise RuntimeError(f"job ended {done} ({shlex.join(args)}):\n{log.read_text(errors='replace')[-3000:]}")
        return {"startup_s": round(t_up, 2), "job_s": round(time.monotonic() - t_req, 2), "times": times,
                "sizes": sizes, "vectors": vectors, "computed": done.get("computed")}


def rate(run: dict, warm: int) -> float:
    """nonces/s from the end of the warm batches to the last batch line."""
    t, n = run["times"], run["sizes"]
    return sum(n[warm:]) / (t[-1] - t[warm - 1]) if len(t) > warm else float("nan")


def l2(a: dict, b: dict) -> dict:
    common = sorted(set(a) & set(b))
    d = np.array([np.linalg.norm(a[k].astype(np.float64) - b[k].astype(np.float64)) for k in common])
    return {"mean": float(d.mean()), "p98": float(np.percentile(d, 98)), "max": float(d.max()), "n": len(d)}


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    rows = [r for r in res["rows"] if r["protocol"] == "v2" and r["run"] != "one_half_batch"]
    axes[0].bar([r["run"] for r in rows], [r["nonces_per_s"] for r in rows])
    axes[0].set_ylabel("nonces/s (v2, through /generate)")
    names = list(res["l2_vs_one"])
    for i, stat in enumerate(("mean", "p98", "max")):
        axes[1].bar(np.arange(len(names)) + (i - 1) * 0.27, [res["l2_vs_one"][k][stat] for k in names], 0.27,
                    label=stat)
    axes[1].set_xticks(np.arange(len(names)), names, fontsize=7)
    axes[1].set_ylabel("L2 against one GPU")
    axes[1].legend(fontsize=7)
    fig.suptitle(f"{res['model']} seq {res['seq_len']} on {res['device']}", fontsize=9)
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
    ap.add_argument("--warm", type=int, default=2, help="batches per job before the timed ones")
    ap.add_argument("--timed", type=int, default=8, help="timed batches per job (per replica with --replicas 2)")
    ap.add_argument("--compare", type=int, default=256, help="nonces 0..N-1 compared across layouts")
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--v1", choices=("mainnet", "tiny", "none"), default="mainnet",
                    help="PoC v1 with two replicas against one GPU: MainNet params (fp16), a tiny model, or skip")
    ap.add_argument("--timeout", type=float, default=900.0)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"model": a.model, "dtype": a.dtype, "seq_len": a.seq, "batch": a.batch, "warm": a.warm, "timed": a.timed,
           "command": " ".join(["python benchmarks/diagnostics/serve_layouts.py",
                                shlex.join(argv if argv is not None else sys.argv[1:])]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": [], "l2_vs_one": {}, "scaling_vs_one": {}}
    try:
        import torch

        res["device"] = torch.cuda.get_device_name() if a.device.startswith("cuda") else a.device
        res["torch"] = torch.__version__
    except ImportError:
        res["device"] = a.device
    vectors = {}
    with tempfile.TemporaryDirectory(prefix="poc-serve-layouts-") as tmp:
        v2_runs = [(name, LAYOUTS[name], a.batch) for name in a.layouts]
        if "one" in a.layouts:  # one GPU's own noise: the same nonces in another batch split
            v2_runs.insert(1, ("one_half_batch", [], max(1, a.batch // 2)))
        for name, extra, batch in v2_runs:
            groups = 2 if name == "rep2" else 1
            n = max(a.compare, (a.warm + a.timed * groups) * batch)
            body = {"block_hash": "serve-layouts", "block_height": 1, "public_key": "bench", "node_id": 0,
                    "node_count": 1, "batch_size": batch, "max_nonces": n,
                    "params": {"model": a.model, "seq_len": a.seq, "k_dim": 12}}
            args = ["--device", a.device, "--model", a.model, "--dtype", a.dtype, *extra]
            r = run_server(args, body, Path(tmp) / f"{name}.log", a.timeout, a.compare)
            vectors[name] = r.pop("vectors")
            row = {"protocol": "v2", "run": name, "args": shlex.join(extra), "batch": batch,
                   "nonces_per_s": rate(r, a.warm), "startup_s": r["startup_s"], "job_s": r["job_s"],
                   "computed": r["computed"], "batches": len(r["sizes"])}
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
        if a.v1 != "none":
            params = (WORKLOADS["T1"]["v1_params"] if a.v1 == "tiny" else None)
            if params is None:
                from poc.protocol.v1 import PARAMS_V2  # gonka's MainNet v1 params

                params = PARAMS_V2.to_json()
            v1_batch = 8 if a.v1 == "tiny" else 64
            for name, extra in (("v1_one", []), ("v1_rep2", ["--replicas", "2"])):
                groups = 2 if extra else 1
                body = {"block_hash": "serve-layouts", "block_height": 1, "public_key": "bench", "r_target": 2.0,
                        "start_nonce": 0, "batch_size": v1_batch,
                        "dtype": "float16" if a.v1 == "mainnet" else "float32",
                        "params": params, "max_nonces": (a.warm + a.timed * groups) * v1_batch}
                r = run_server(["--device", a.device, *extra], body, Path(tmp) / f"{name}.log", a.timeout, 0)
                r.pop("vectors")
                row = {"protocol": "v1", "run": name, "args": shlex.join(extra), "batch": v1_batch,
                       "params": a.v1, "nonces_per_s": rate(r, a.warm), "startup_s": r["startup_s"],
                       "job_s": r["job_s"], "computed": r["computed"], "batches": len(r["sizes"])}
                res["rows"].append(row)
                print(json.dumps(row), flush=True)
    one = {r["run"]: r["nonces_per_s"] for r in res["rows"]}
    for name in ("tp2", "pp2", "rep2"):
        if name in one and "one" in one:
            res["scaling_vs_one"][name] = one[name] / one["one"]
    if "v1_rep2" in one:
        res["scaling_vs_one"]["v1_rep2"] = one["v1_rep2"] / one["v1_one"]
    if "one" in vectors:
        for name, vec in vectors.items():
            if name != "one":
                res["l2_vs_one"][name] = l2(vec, vectors["one"])
    text = json.dumps(res, indent=1)
    print(text)
    out.write_text(text)
    plot(res, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
