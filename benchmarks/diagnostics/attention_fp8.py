"""The validators' all-FP8 attention (model/attention.py, recipe `fp8`: the Triton kernel on Hopper) against the
other recipes at the MiniMax-M2.7 attention shape (48 query heads, 8 kv heads, head_dim 128, seq 1024): time per
call (triton.testing.do_bench, median), TFLOP/s, and the kernel's distance to the torch emulation of the recipe.

    PYTHONPATH=src:. python benchmarks/diagnostics/attention_fp8.py --out benchmarks/h100/attention_fp8.json \\
        [--batch 16 64]

TFLOP/s count causal attention as 2 B H S^2 D FLOPs (QK^T and PV, 2 B H S^2 D each, half of each under the mask).
The inputs are what the model hands over: transposed views of one (B, S, (H + 2 Hkv) D) projection output, bf16.
Rows: `fp8` (the kernel, in CONFIG and each other tile configuration of --configs, each with whether its output
has CONFIG's bits, as it must), `fp8kv` (K and V rounded
through e4m3, then SDPA) and `bf16` (SDPA), each through attention.attend; the last-position pass of `fp8`. The
distances (share of elements that differ, max and RMS difference relative to the reference's) are measured on the
first --check-batch rows of each batch: the kernel against the emulation, and fp8kv and bf16 against it for scale;
then the kernel on robust inputs (tests/test_attention.py: no e4m3 rounding boundary near, c = 1), where it should
agree with the emulation in all but a few percent of elements.
"""

from __future__ import annotations

import argparse
import math
import sys
import time


H, HKV, D, S = 48, 8, 128, 1024  # MiniMax-M2.7: query heads, kv heads, head_dim; the chain's seq_len


def agreement(out, ref) -> dict:
    """Share of elements that differ, max and RMS difference relative to ref's max magnitude and RMS."""
    o, r = out.float(), ref.float()
    d = o - r
    return {"differ": round((o != r).float().mean().item(), 6),
            "max_rel": float(f"{(d.abs().max() / r.abs().max()).item():.3g}"),
            "rms_rel": float(f"{(d.pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item():.3g}")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--seq", type=int, default=S)
    ap.add_argument("--configs", default="128x8x2,64x4x2,64x4x3,64x4x4",
                    help="BLOCK_M x num_warps x num_stages of the kernel to time, besides CONFIG")
    ap.add_argument("--check-batch", type=int, default=4, help="batch rows on which distances are measured")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    a = ap.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("attention_fp8 needs a CUDA GPU: nothing was run")
    import triton
    import triton.testing

    from poc.bench import write_result
    from poc.model import attention
    from poc.model.kernels import attn_fp8_triton
    from tests.attention_inputs import UNIT_C, robust_inputs

    probe = torch.empty(1, 1, 1, D, device="cuda", dtype=torch.bfloat16)
    if not attention.use_kernel(probe):
        raise SystemExit(f"the fp8 kernel does not run on {torch.cuda.get_device_name()} (capability "
                         f"{torch.cuda.get_device_capability()}; needs 9+ and Triton): nothing was run")
    configs = [dict(attn_fp8_triton.CONFIG)]
    for c in a.configs.split(","):
        m, w, s = (int(x) for x in c.split("x"))
        if {"BLOCK_M": m, "num_warps": w, "num_stages": s} not in configs:
            configs.append({"BLOCK_M": m, "num_warps": w, "num_stages": s})
    scale = 1 / math.sqrt(D)
    Sq = a.seq
    rows, checks = [], []
    for B in a.batch:
        g = torch.Generator(device="cuda").manual_seed(B)
        x = torch.randn(B, Sq, (H + 2 * HKV) * D, device="cuda", generator=g).bfloat16()
        q, k, v = x.split([H * D, HKV * D, HKV * D], dim=-1)
        # (B, S, H*D) -> (B, S, H, D) -> (B, H, S, D): views, as Attention.forward hands them over
        q, k, v = (t.view(B, Sq, -1, D).transpose(1, 2) for t in (q, k, v))
        flops = 2 * B * H * Sq * Sq * D

        def timed(name, fn, config=None, flop=flops):
            fn()  # compile / warm up
            ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
            row = {"B": B, "S": Sq, "H": H, "Hkv": HKV, "D": D, "what": name, "config": config, "ms": round(ms, 4),
                   "tflops": round(flop / ms / 1e9, 1)}
            rows.append(row)
            print(f"B {B:3d} {name:28s} {str(config or ''):42s} {ms:8.3f} ms {row['tflops']:7.1f} TFLOP/s",
                  flush=True)

        want = attn_fp8_triton.attention(q, k, v, scale, config=configs[0])
        for cfg in configs:
            try:
                timed("fp8 kernel", lambda: attn_fp8_triton.attention(q, k, v, scale, config=cfg), cfg)
                rows[-1]["same_bits_as_CONFIG"] = torch.equal(attn_fp8_triton.attention(q, k, v, scale, config=cfg),
                                                              want)
            except Exception as e:  # e.g. out of shared memory in a deeper pipeline
                rows.append({"B": B, "what": "fp8 kernel", "config": cfg, "error": f"{type(e).__name__}: {e}"[:300]})
                print(f"B {B:3d} fp8 kernel {cfg}: {rows[-1]['error']}", flush=True)
        timed("fp8 (attend)", lambda: attention.attend(q, k, v, "fp8", scale))
        timed("fp8kv (attend: e4m3 K/V + SDPA)", lambda: attention.attend(q, k, v, "fp8kv", scale))
        timed("bf16 (attend: SDPA)", lambda: attention.attend(q, k, v, "bf16", scale))
        # the last position: 2 B H S D FLOPs each for QK^T and PV
        timed("fp8 last position", lambda: attention.attend(q[:, :, -1:], k, v, "fp8", scale),
              flop=4 * B * H * Sq * D)

        n = min(a.check_batch, B)
        qc, kc, vc = q[:n], k[:n], v[:n]
        t0 = time.perf_counter()
        ref = attention.fp8_attention_torch(qc, kc, vc, scale)
        emu_s = time.perf_counter() - t0
        out = attention.attend(qc, kc, vc, "fp8", scale)
        last = attention.attend(qc[:, :, -1:], kc, vc, "fp8", scale)
        check = {"B": B, "rows_checked": n, "emulation_s": round(emu_s, 2),
                 "kernel_vs_emulation": agreement(out, ref),
                 "kernel_last_vs_emulation": agreement(last, ref[:, :, -1:]),
                 "kernel_last_vs_kernel_full_last_row": agreement(last, out[:, :, -1:]),
                 "fp8kv_vs_emulation": agreement(attention.attend(qc, kc, vc, "fp8kv", scale), ref),
                 "bf16_vs_emulation": agreement(attention.attend(qc, kc, vc, "bf16", scale), ref)}
        checks.append(check)
        del x, q, k, v, ref, out
        torch.cuda.empty_cache()
    qr, kr, vr = robust_inputs(2, H, HKV, Sq, D, device="cuda", seed=1)
    ref = attention.fp8_attention_torch(qr, kr, vr, UNIT_C)
    robust = {"kernel_vs_emulation": agreement(attention.attend(qr, kr, vr, "fp8", UNIT_C), ref),
              "kernel_last_vs_emulation": agreement(attention.attend(qr[:, :, -1:], kr, vr, "fp8", UNIT_C),
                                                    ref[:, :, -1:])}

    print("\ndistances (share of elements differing, max and RMS difference relative to the reference):")
    for c in checks:
        for key, val in c.items():
            if isinstance(val, dict):
                print(f"  B {c['B']:3d} {key:38s} {val}")
    for key, val in robust.items():
        print(f"  robust inputs {key:32s} {val}")
    if a.out:
        write_result(a.out, "benchmarks/diagnostics/attention_fp8.py", argv,
                     {"timings": rows, "distances": checks, "robust_inputs": robust},
                     device=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
                     torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
                     kernel_config=attn_fp8_triton.CONFIG, flops="2 B H S^2 D (causal: QK^T and PV, half of each)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
