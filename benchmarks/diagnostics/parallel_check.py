"""tp=2, pp=2 and two replicas against one GPU, on a box with two GPUs: equality and nonces/s.

    python benchmarks/diagnostics/parallel_check.py [--out benchmarks/h200x2/parallel_check.json]
    python benchmarks/diagnostics/parallel_check.py --floor-only --out benchmarks/h100/parallel_check_floor.json

1. float32 on the golden tiny qwen3/llama checkpoints (../shared/golden or ./shared/golden): L2 < 1e-5
2. a random-weight Qwen3-0.6B-shaped checkpoint (28 layers, float32 safetensors in a temp dir): float32 L2 < 1e-5
   and bfloat16 L2 < 0.02 against the single-GPU engine on the same nonces, for every layout; and the bf16 noise
   floor of that comparison (one input element of every nonce moved by one ulp, on one GPU; --floor-only: only it)
3. nonces/s of 2 replicas over one GPU, W4-like (seq_len 1024, batch 64, bf16): >= 1.9x (tp=2 and pp=2 printed)
Prints one JSON summary and writes it to --out; exit code 1 when a check fails. --device cpu: a small dry run of
the same code over gloo.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file


from poc.bench import one_ulp  # noqa: E402
from poc.engine.engine import Engine  # noqa: E402
from poc.engine.jobs import Limits, V2Job  # noqa: E402
from poc.model.config import PRESETS  # noqa: E402
from poc.model.transformer import Transformer  # noqa: E402
from poc.engine.dist import DistEngine  # noqa: E402
from poc.protocol import v1  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--out", default="benchmarks/h200x2/parallel_check.json")
ap.add_argument("--device", default="cuda", help="cuda, or cpu for a small dry run")
ap.add_argument("--seq", type=int, help="seq_len of the throughput runs (1024; cpu 32)")
ap.add_argument("--batch", type=int, help="batch size of the throughput runs (64; cpu 4)")
ap.add_argument("--batches", type=int, help="timed batches per throughput run (24; cpu 4)")
ap.add_argument("--layers", type=int, help="layers of the Qwen3-0.6B-shaped checkpoint (28; cpu 2)")
ap.add_argument("--big-nonces", type=int, default=16, help="nonces of the Qwen3-0.6B-shape comparisons")
ap.add_argument("--floor-only", action="store_true", help="only the bf16 noise floor, on one GPU")
args = ap.parse_args()
DEVICE = args.device
CPU = DEVICE == "cpu"
SEQ = args.seq or (32 if CPU else 1024)
BATCH = args.batch or (4 if CPU else 64)
BATCHES = args.batches or (4 if CPU else 24)
LAYERS = args.layers or (2 if CPU else 28)
BH, PK, K = "ab" * 32, "03" + "cd" * 32, 12
LAYOUTS = {"tp2": dict(tp=2, pp=1), "pp2": dict(tp=1, pp=2), "rep2": dict(tp=1, pp=1)}
summary = {"device": torch.cuda.get_device_name() if not CPU else "cpu", "torch": torch.__version__,
           "gpus": torch.cuda.device_count() if not CPU else 0, "seq_len": SEQ, "batch": BATCH, "checks": {}}


def golden_dir() -> Path:
    for p in (Path("../shared/golden"), Path("shared/golden"), Path("tests/golden_copy")):
        if p.is_dir():
            return p
    raise SystemExit("no shared/golden here")


def write_qwen3(path: Path) -> Path:
    """Qwen3-0.6B's shape with N(0, 0.02) weights (norms 1), float32, one safetensors shard per layer."""
    cfg = PRESETS["qwen3-0.6b"]
    hf = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": cfg.dim,
          "num_hidden_layers": LAYERS, "num_attention_heads": cfg.n_heads, "num_key_value_heads": cfg.n_kv_heads,
          "head_dim": cfg.head_dim, "intermediate_size": cfg.ffn_dim, "vocab_size": cfg.vocab_size,
          "rms_norm_eps": cfg.norm_eps, "rope_theta": cfg.rope_theta, "max_position_embeddings": 40960,
          "tie_word_embeddings": True, "torch_dtype": "float32", "hidden_act": "silu"}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Transformer(cfg).state_dict().items()}
    gen = torch.Generator(DEVICE).manual_seed(0)
    weight_map = {}
    for i in range(LAYERS + 1):
        prefix = f"layers.{i}." if i < LAYERS else "norm."
        sd = {}
        for k, s in shapes.items():
            if not k.startswith(prefix):
                continue
            t = (torch.ones(s) if k.endswith("norm.weight") else
                 torch.randn(s, generator=gen, device=DEVICE).mul_(0.02).cpu())
            sd[f"model.{k}"] = t.contiguous()
        name = f"model-{i:05d}.safetensors"
        save_file(sd, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def single_vectors(model_dir, dtype, nonces, seq, batch, perturbed=False) -> np.ndarray:
    e = Engine(DEVICE, model_dir=str(model_dir), dtype=dtype, v1_input_workers=0)
    e.load()
    if perturbed:  # one input element of every nonce moved by one ulp: the model's own rounding noise floor
        one_ulp(e.v2)
    v = np.concatenate([e.v2.vectors(e.v2.prepare(BH, PK, nonces[i:i + batch], seq, K)).numpy()
                        for i in range(0, len(nonces), batch)])
    e.close()
    del e
    torch.cuda.empty_cache() if not CPU else None
    return v


def rate(engine, seq, batch, n_batches) -> float:
    """nonces/s of a /generate-like job (endless nonce stream, max_nonces), after a warm-up job."""
    def job(n):
        return V2Job(BH, PK, 1, seq, K, v1.worker_nonces(0, 0, 1), batch,
                     limits=Limits(max_nonces=n * batch, max_duration=None))
    engine.run(job(3), lambda b: None, threading.Event())
    s = engine.run(job(n_batches), lambda b: None, threading.Event())
    return s.computed / s.elapsed


def check(name, value, limit, at_least=False):
    ok = bool(value >= limit if at_least else value < limit)
    summary["checks"][name] = {"value": float(value), ">=" if at_least else "<": limit, "ok": ok}
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3g} ({'>=' if at_least else '<'} {limit})", file=sys.stderr)


with tempfile.TemporaryDirectory() as tmp:
    g = golden_dir()
    tiny = {name: g / "v2_tiny" / name for name in ("qwen3", "llama")}
    t0 = time.perf_counter()
    big = write_qwen3(Path(tmp) / "qwen3-0.6b-random")
    summary["checkpoint_write_s"] = round(time.perf_counter() - t0, 1)
    small_nonces, big_nonces = list(range(12)), list(range(args.big_nonces))
    ref = {}
    for name, d in tiny.items():
        ref[(name, "float32")] = single_vectors(d, "float32", small_nonces, 16, 4)
    for dtype in ("float32", "bfloat16"):
        ref[("big", dtype)] = single_vectors(big, dtype, big_nonces, min(SEQ, 256), 8)
    floor = np.linalg.norm(single_vectors(big, "bfloat16", big_nonces, min(SEQ, 256), 8, perturbed=True)
                           - ref[("big", "bfloat16")], axis=1)
    summary["bf16_one_input_ulp_vs_one_gpu_L2"] = {"mean": float(floor.mean()), "max": float(floor.max()),
                                                   "n": len(big_nonces)}
    print(f"bf16 noise floor (one input ulp): mean {floor.mean():.3g} max {floor.max():.3g}", file=sys.stderr)
    if args.floor_only:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        sys.exit(0)
    single = Engine(DEVICE, model_dir=str(big), dtype="bfloat16", v1_input_workers=0)
    single.load()
    summary["single_nonces_per_s"] = round(rate(single, SEQ, BATCH, BATCHES), 2)
    single.close()
    del single
    rates = {}
    for label, lay in LAYOUTS.items():
        t0 = time.perf_counter()
        e = DistEngine(DEVICE, model_dir=str(tiny["qwen3"]), dtype="float32", world=2, timeout=300, **lay)
        try:
            for name, d in tiny.items():
                e.model_dir, e.dtype_flag = str(d), "float32"
                e.load()
                v = e.v2_vectors(BH, PK, small_nonces, 16, K, batch_size=4)
                check(f"{label} tiny {name} float32 L2", np.linalg.norm(v - ref[(name, "float32")], axis=1).max(),
                      1e-5)
            for dtype, limit in (("float32", 1e-5), ("bfloat16", 0.02)):
                e.model_dir, e.dtype_flag = str(big), dtype
                e.load()
                v = e.v2_vectors(BH, PK, big_nonces, min(SEQ, 256), K, batch_size=8)
                d = np.linalg.norm(v - ref[("big", dtype)], axis=1)
                summary[f"{label} qwen3-0.6b-shape {dtype} mean L2"] = float(d.mean())
                check(f"{label} qwen3-0.6b-shape {dtype} L2", d.max(), limit)
            rates[label] = round(rate(e, SEQ, BATCH, BATCHES * (2 if label == "rep2" else 1)), 2)
        finally:
            e.close()
        summary[f"{label}_seconds"] = round(time.perf_counter() - t0, 1)
    summary["nonces_per_s"] = rates
    speedup = rates["rep2"] / summary["single_nonces_per_s"]
    summary["rep2_speedup"] = round(speedup, 3)
    check("rep2 nonces/s over one GPU", speedup, 1.9, at_least=True)
    summary["ok"] = all(c["ok"] for c in summary["checks"].values())

text = json.dumps(summary, indent=1)
print(text)
Path(args.out).parent.mkdir(parents=True, exist_ok=True)
Path(args.out).write_text(text)
sys.exit(0 if summary["ok"] else 1)
