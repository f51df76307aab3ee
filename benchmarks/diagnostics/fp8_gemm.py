"""FP8 GEMMs against dequantise-then-bf16 on the expert shapes of Qwen3-MoE.

    python benchmarks/diagnostics/fp8_gemm.py [--out benchmarks/h100/fp8_gemm.json]

For each (tokens per expert M, K, N): bf16 torch.mm; the FP8 weights dequantised (128x128 block scales, one fused
kernel as the engine does per layer) and then the bf16 GEMM; torch._scaled_mm with per-row / per-column scales
(the activations quantised dynamically per token); and, where this torch/cuBLAS has it, the blockwise form
(1x128 activation groups x 128x128 weight blocks, which is what the FP8 checkpoints are). TFLOP/s by CUDA events,
plus the relative error of each FP8 result against the bf16 GEMM of the dequantised weights.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


from poc.bench import cuda_time  # noqa: E402
from poc.model.fp8 import dequantize_blocks  # noqa: E402

E4M3_MAX = 448.0


def timed(fn, iters: int = 20) -> float:
    return cuda_time(fn, iters)


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row dynamic FP8: (M, K) -> fp8 (M, K), fp32 scales (M, 1)."""
    s = x.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / E4M3_MAX
    return (x.float() / s).to(torch.float8_e4m3fn), s


def quant_groups(x: torch.Tensor, g: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-(row, 128 columns) dynamic FP8: scales (M, K/128)."""
    M, K = x.shape
    xg = x.float().view(M, K // g, g)
    s = xg.abs().amax(dim=2).clamp_min(1e-12) / E4M3_MAX
    return (xg / s[..., None]).to(torch.float8_e4m3fn).view(M, K), s


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def case(M: int, K: int, N: int) -> dict:
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(M, K, device=dev, generator=g).bfloat16()
    wq = torch.randn(N, K, device=dev, generator=g).mul_(64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    ws = torch.rand(-(-N // 128), -(-K // 128), device=dev, generator=g) * (0.02 / 64)
    w = dequantize_blocks(wq, ws, torch.bfloat16)
    flops = 2.0 * M * K * N
    ref = x @ w.t()
    row = {"M": M, "K": K, "N": N}
    row["bf16_mm_tflops"] = flops / timed(lambda: x @ w.t()) / 1e12
    row["dequant_then_bf16_tflops"] = flops / timed(lambda: x @ dequantize_blocks(wq, ws, torch.bfloat16).t()) / 1e12
    # rowwise FP8: the weights re-quantised per output channel (not the checkpoint's blocks)
    wr, wrs = quant_rows(w)
    try:
        def rowwise():
            xq, xs = quant_rows(x)
            return torch._scaled_mm(xq, wr.t(), scale_a=xs, scale_b=wrs.t(), out_dtype=torch.bfloat16)
        row["fp8_rowwise_incl_act_quant_tflops"] = flops / timed(rowwise) / 1e12
        xq, xs = quant_rows(x)
        row["fp8_rowwise_gemm_only_tflops"] = flops / timed(
            lambda: torch._scaled_mm(xq, wr.t(), scale_a=xs, scale_b=wrs.t(), out_dtype=torch.bfloat16)) / 1e12
        row["fp8_rowwise_rel_err"] = rel(rowwise(), ref)
    except (RuntimeError, TypeError) as e:
        row["fp8_rowwise_error"] = str(e).splitlines()[0][:200]
    # blockwise: 1x128 activation groups x the checkpoint's own 128x128 weight blocks
    try:
        def blockwise():
            xq, xs = quant_groups(x)
            return torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16)
        row["fp8_blockwise_rel_err"] = rel(blockwise(), ref)
        row["fp8_blockwise_incl_act_quant_tflops"] = flops / timed(blockwise) / 1e12
    except (RuntimeError, TypeError, ValueError) as e:
        row["fp8_blockwise_error"] = str(e).splitlines()[0][:200]
    print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/h100/fp8_gemm.json")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    # 30B-A3B experts: D 2048, F 768 (gate+up 1536); 235B-A22B: D 4096, F 1536 (gate+up 3072). M: tokens per expert
    # at batch 16 x 1024 tokens x top-8 / 128 experts = 1024 (30B on one GPU) and more at larger batches
    shapes = [(m, k, n) for m in (1024, 4096) for (k, n) in ((2048, 1536), (768, 2048), (4096, 3072), (1536, 4096))]
    rows = [case(*s) for s in shapes]
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
