"""tp=2 against one GPU on the same nonces: the L2 distribution between them beside one GPU's honest noise.

    bash benchmarks/run.sh h200x2 tp_numerics          # -> benchmarks/h200x2/tp_numerics.json (+ .png)
    python benchmarks/diagnostics/tp_numerics.py --out FILE [--model random:qwen3-30b-a3b:fp8] [--nonces 256]
    python benchmarks/diagnostics/tp_numerics.py --device cpu --model random:tiny-moe --nonces 8 --seq 16 --out F

The model (default: the Qwen3-30B-A3B-FP8 shape with random weights, the W8A8 forward, bf16) runs on one GPU and as
tp=2 over two (attention split by heads, experts by expert, one all-reduce per layer part). Both compute the v2
vectors (the unit vectors before the fp16 encoding) of the same nonces at seq_len 1024. Beside tp=2 vs one GPU
stand two honest-noise distributions of one GPU against itself: another attention kernel (SDPA's efficient or math
backend instead of the default), and another batch split (half the batch size). A tp=2 that only reorders sums sits
within them; a wrong shard would sit near L2 1.4 (unrelated unit vectors). Writes JSON (the command inside) and a
PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch


from poc.bench import pyplot  # noqa: E402
from poc.engine.engine import Engine  # noqa: E402
from poc.engine.dist import DistEngine  # noqa: E402

BH, PK, K = "ab" * 32, "03" + "cd" * 32, 12


def dist(a: np.ndarray, b: np.ndarray) -> dict:
    d = np.linalg.norm(a.astype(np.float64) - b.astype(np.float64), axis=1)
    return {"mean": float(d.mean()), "p98": float(np.percentile(d, 98)), "max": float(d.max()), "n": len(d)}


def single_vectors(engine: Engine, nonces: list[int], seq: int, batch: int, ctx=nullcontext) -> np.ndarray:
    with ctx():
        return np.concatenate([engine.v2.vectors(engine.v2.prepare(BH, PK, nonces[i:i + batch], seq, K)).numpy()
                               for i in range(0, len(nonces), batch)])


def other_attention():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    rows = [(k, v) for k, v in res["l2"].items()]
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, stat in enumerate(("mean", "p98", "max")):
        ax.bar(np.arange(len(rows)) + (i - 1) * 0.27, [v[stat] for _, v in rows], 0.27, label=stat)
    ax.set_xticks(np.arange(len(rows)), [k.replace("_", " ") for k, _ in rows], fontsize=7)
    ax.set_ylabel("L2 between v2 vectors")
    ax.set_title(f"{res['model']} on {res['device']}: tp=2 vs one GPU, {res['nonces']} nonces", fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/h200x2/tp_numerics.json")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a small dry run over gloo")
    ap.add_argument("--model", default="random:qwen3-30b-a3b:fp8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--nonces", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    cpu = args.device == "cpu"
    nonces = list(range(args.nonces))
    res = {"model": args.model, "dtype": args.dtype, "nonces": args.nonces, "seq_len": args.seq, "batch": args.batch,
           "device": "cpu" if cpu else torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python " + shlex.join(sys.argv), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "l2": {},
           "seconds": {}}
    t0 = time.perf_counter()
    one = Engine(args.device, model_dir=args.model, dtype=args.dtype, v1_input_workers=0)
    one.load()
    with torch.no_grad():
        ref = single_vectors(one, nonces, args.seq, args.batch)
        res["seconds"]["one_gpu"] = round(time.perf_counter() - t0, 1)
        if not cpu:
            res["l2"]["one_gpu_other_attention_vs_one_gpu"] = dist(
                single_vectors(one, nonces, args.seq, args.batch, other_attention), ref)
        res["l2"]["one_gpu_half_batch_vs_one_gpu"] = dist(single_vectors(one, nonces, args.seq, args.batch // 2), ref)
    one.close()
    del one
    if not cpu:
        torch.cuda.empty_cache()
    print(json.dumps(res["l2"]), flush=True)
    t0 = time.perf_counter()
    tp = DistEngine(args.device, model_dir=args.model, dtype=args.dtype, world=2, tp=2, pp=1, timeout=600)
    try:
        tp.load()
        got = tp.v2_vectors(BH, PK, nonces, args.seq, K, batch_size=args.batch)
    finally:
        tp.close()
    res["seconds"]["tp2"] = round(time.perf_counter() - t0, 1)
    res["l2"]["tp2_vs_one_gpu"] = dist(got, ref)
    noise = [v for k, v in res["l2"].items() if k.startswith("one_gpu_")]
    res["tp2_within_noise"] = {stat: res["l2"]["tp2_vs_one_gpu"][stat] <= max(v[stat] for v in noise)
                               for stat in ("mean", "p98", "max")}
    text = json.dumps(res, indent=1)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    plot(res, out.with_suffix(".png"))


if __name__ == "__main__":
    main()
