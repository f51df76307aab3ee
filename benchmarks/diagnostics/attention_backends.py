"""SDPA (what the model runs) against FlashAttention-4 (`flash-attn-4` on PyPI: CuTeDSL on top of nvidia-cutlass-dsl,
Hopper/Blackwell) on the attention of the W3, W4 and W5 shapes (issue 17: keep the Dockerfile's flash-attn step only
if it is measured to help). Causal, GQA, bf16, one layer's attention call timed with CUDA events; the model's share
is that time x its layers, next to the engine's measured seconds per batch when --engine-rate is given.

    pip install flash-attn-4                       # (flash-attn-4[cu13] on CUDA 13)
    python benchmarks/diagnostics/attention_backends.py --out benchmarks/h100/attention_backends.json

Without flash-attn-4 installed it times SDPA alone and says so in the JSON.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

# (batch, seq_len, n_heads, n_kv_heads, head_dim, layers): Qwen3-0.6B at seq 64 and 1024, Qwen3-8B at 1024
SHAPES = {"W3": (512, 64, 16, 8, 128, 28), "W4": (64, 1024, 16, 8, 128, 28), "W5": (16, 1024, 32, 8, 128, 36)}


def cuda_time(fn, iters: int = 50, warmup: int = 10) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--out", default="benchmarks/attention_backends.json")
    a = ap.parse_args(argv)
    import torch
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        raise SystemExit("attention_backends needs a CUDA GPU: nothing was run")
    try:
        from flash_attn.cute import flash_attn_func
        fa4_error = None
    except Exception as e:  # not installed, or no kernel for this GPU/CUDA
        flash_attn_func, fa4_error = None, f"{type(e).__name__}: {e}"
    rows = []
    for name in a.workload:
        B, S, H, KV, D, L = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, generator=g)  # (B, H, S, D): SDPA's layout
        k = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, KV, S, D, device="cuda", dtype=torch.bfloat16, generator=g)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        row = {"workload": name, "batch": B, "seq_len": S, "n_heads": H, "n_kv_heads": KV, "head_dim": D,
               "layers": L, "sdpa_s": cuda_time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                         enable_gqa=True))}
        if flash_attn_func is not None:
            qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # (B, S, H, D): flash-attn's layout

            def fa4():
                out = flash_attn_func(qt, kt, vt, causal=True)
                return out[0] if isinstance(out, tuple) else out

            try:
                out = fa4().transpose(1, 2)
                row["fa4_s"] = cuda_time(fa4)
                row["fa4_max_abs_diff"] = float((out.float() - ref.float()).abs().max())
                row["fa4_speedup"] = row["sdpa_s"] / row["fa4_s"]
            except Exception as e:
                row["fa4_error"] = f"{type(e).__name__}: {e}"[:500]
        row["sdpa_model_s_per_batch"] = row["sdpa_s"] * L
        if "fa4_s" in row:
            row["fa4_model_s_per_batch"] = row["fa4_s"] * L
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "command": "python benchmarks/diagnostics/attention_backends.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "flash_attn_4": None if fa4_error else "imported", "flash_attn_4_error": fa4_error, "rows": rows,
        "date": time.strftime("%Y-%m-%d %H:%M:%S")}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
