"""The FP8 W8A8 forward on one GPU: kernel exactness, artifact distances against the float32 emulation, speed.

    bash benchmarks/run.sh --tag kernels h100 w8a8 -- kernels            # -> benchmarks/h100/w8a8_kernels.json
    bash benchmarks/run.sh --tag accuracy h100 w8a8 -- accuracy --compile --nonces 512 --deep-nonces 256
    bash benchmarks/run.sh --tag ue8m0 h100 w8a8 -- ue8m0                  # -> benchmarks/h100/w8a8_ue8m0.json
    python benchmarks/diagnostics/w8a8.py kernels --out FILE               # the same, by hand
    speed: the poc.bench workloads W6F (dequantise forward), W6Q (W8A8, UE8M0 scales) and W6Q32 (W8A8, float32
    scales), e.g. bash benchmarks/run.sh h100 W6Q

ue8m0: the UE8M0 activation quantiser (the CUDA kernel, both 16-bit and float32 inputs) and the load-time
re-quantisation of the dense weights against the formulas transcribed here in float64 (2^ceil(log2(.)) as frexp's
exponent, less one where the mantissa is exactly 1/2: exact, independent of fp8.pow2_ceil's reading of the float32
bits; CUDA's float64 log2 is not exact at powers of two: log2(0.125) ceils to -2 there), on the activation widths
and the q|k|v and o weights of Qwen3-30B-A3B and Qwen3-235B-A22B, random and adversarial.
kernels: on Qwen3-30B-A3B-FP8 layer sizes (`--shape qwen3-235b-a22b`: that model's), seq 1024 batches, the activation
quantiser against the spec's formula written in plain torch ops (bit-identical or not, plus adversarial groups), the
dense and grouped block-scaled GEMMs against the float32 emulation (relative Frobenius error) with a sweep of the
expert kernels' tiles (the fused w13 kernel against its three steps run apart, bit for bit), the whole expert block,
and the FP8 / bf16 matmul ceilings at 8192^3.
accuracy: v2 artifacts (seq 1024) of a random-weight Qwen3-30B-A3B-FP8 shape, first 4 layers and all 48
(--deep-nonces 0: 4 only), the model in the UE8M0 scale format (what the Hopper validators compute): ours (the served
W8A8 path) vs the float32 emulation of the UE8M0 recipe, the emulation against itself with another attention kernel,
the dequantise forward vs the emulation; beside them the same weights in the float32 scale format (served, and its
own emulation) against the UE8M0 emulation: L2 of the decoded fp16 artifacts (mean, p98, max), as the validators
measure.
Writes JSON (the command inside) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from poc.bench import cuda_time, pyplot
from poc.engine.compute import V2Compute
from poc.model import experts, fp8
from poc.model.config import PRESETS
from poc.model.options import FP8_SCALES, ModelOptions
from poc.model.kernels import fp8_triton
from poc.model.random_weights import fp8_payload, random_model
from poc.protocol import v2

grouped_gemm = partial(fp8_triton.grouped_gemm, group_rows=experts.GROUP_ROWS)
w13_swiglu_quant = partial(fp8_triton.w13_swiglu_quant, group_rows=experts.GROUP_ROWS)

BH = "ba5b00876d55f32856a5fbae8b4ebd79c5a90c763b23c15b7ec813cda54965ab"
PK = "03b9be7b7bcc197eadcd6cd0ab62d129aa39b94e53ea72ecacc4d95ccec859435c"
SHAPE = "qwen3-30b-a3b"


def fp8_weight(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(n, k, device="cuda", generator=g).mul_(64).clamp_(-448, 448).to(fp8.FP8)
    s = torch.rand(fp8.cdiv(n, 128), fp8.cdiv(k, 128), device="cuda", generator=g).mul_(0.2).add_(0.9) * (0.02 / 64)
    return w, s


def emulate(q, s, w, ws) -> torch.Tensor:
    return fp8.dequantize_act(q, s) @ fp8.dequantize_blocks(w, ws).t()


def adversarial(g: torch.Generator) -> torch.Tensor:
    """Rows of 128-column groups the quantiser can get wrong: all zero, denormal, on FP8 rounding ties after
    scaling, past 448 before the clamp, one huge outlier, mixed signs, bf16 extremes."""
    rows = []
    z = torch.zeros(256)
    rows.append(z)
    rows.append(torch.full((256,), 1e-40))  # float32 denormals
    rows.append(torch.tensor([(-1) ** i * 2.0 ** -140 for i in range(256)]))
    fp8_vals = torch.arange(0, 256, dtype=torch.uint8).view(fp8.FP8).float()
    fin = fp8_vals[torch.isfinite(fp8_vals) & (fp8_vals > 0)].sort().values
    ties = (fin[:-1] + fin[1:]) / 2  # midpoints of neighbouring e4m3 values
    t = torch.cat([torch.tensor([448.0]), ties[-127:]])  # amax 448: scale ~1, the rest on ties
    t = torch.cat([t, torch.zeros(128 - t.numel())])
    rows.append(torch.cat([t, -t]))
    for amax in (448.00003, 447.99997, 1e4, 3.4e38 / 2, 1e-30):
        r = torch.randn(256, generator=g) * (amax / 8)
        r[5], r[200] = amax, -amax
        rows.append(r)
    out = torch.randn(256, generator=g) * 1e-3
    out[17], out[150] = 3e4, -2e5  # one huge outlier per group
    rows.append(out)
    return torch.stack(rows).cuda()


@torch.no_grad()
def kernels(args) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    cfg = PRESETS[args.shape]
    res: dict = {"quantiser": [], "gemm": [], "grouped": []}
    # the quantiser, on activations of the model's widths (seq 1024 batches) and on adversarial groups
    for dtype in (torch.bfloat16, torch.float32):
        cases = {"adversarial": adversarial(torch.Generator().manual_seed(1)).to(dtype)}
        for K in (cfg.dim, cfg.n_heads * cfg.head_dim, cfg.moe_ffn_dim):
            cases[f"8x1024x{K}"] = (torch.randn(8 * 1024, K, device="cuda", generator=g) * 3).to(dtype)
        for name, x in cases.items():
            q1, s1 = fp8.quantize_act(x)
            q2, s2 = fp8.quantize_act_torch(x)
            same = torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
            n_q = int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum())
            n_s = int((s1 != s2).sum())
            res["quantiser"].append({"input": name, "dtype": str(dtype), "bit_identical": same, "q_diff": n_q,
                                     "s_diff": n_s})
            print(json.dumps(res["quantiser"][-1]), flush=True)
    x = torch.randn(64 * 1024, cfg.dim, device="cuda", dtype=torch.bfloat16)
    t = cuda_time(lambda: fp8.quantize_act(x))
    res["quantiser_gbps"] = x.numel() * (2 + 1) / t / 1e9
    # dense GEMMs: q|k|v and o of attention, on seq-1024 batches, and row counts that are not tile multiples
    qkv = cfg.n_heads * cfg.head_dim + 2 * cfg.n_kv_heads * cfg.head_dim
    for M, N, K in ((8192, qkv, cfg.dim), (8192, cfg.dim, cfg.n_heads * cfg.head_dim), (1000, qkv, cfg.dim),
                    (17, cfg.dim, cfg.n_heads * cfg.head_dim), (1, qkv, cfg.dim)):
        x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        w, ws = fp8_weight(N, K, g)
        q, s = fp8.quantize_act(x)
        y = fp8.fp8_mm(q, s, w, ws, torch.bfloat16)
        ref = emulate(q, s, w, ws)
        rel = float((y.float() - ref).norm() / ref.norm())
        tt = cuda_time(lambda: fp8.fp8_mm(q, s, w, ws, torch.bfloat16)) if M >= 1000 else None
        row = {"M": M, "N": N, "K": K, "rel_err": rel, "tensor_cores": fp8.SCALED_MM,
               "tflops": 2 * M * N * K / tt / 1e12 if tt else None}
        res["gemm"].append(row)
        print(json.dumps(row), flush=True)
    # the experts (both grouped GEMMs, the quantisations and SwiGLU between): 128 experts, top 8, uneven groups,
    # seq-1024 batches of 8 and 32 nonces, against the float32 emulation
    E, F, D = cfg.n_experts, cfg.moe_ffn_dim, cfg.dim
    w13, s13 = (torch.stack(t) for t in zip(*[fp8_weight(2 * F, D, g) for _ in range(E)]))
    w2, s2 = (torch.stack(t) for t in zip(*[fp8_weight(D, F, g) for _ in range(E)]))
    s13, s2 = s13 * 0.05, s2 * 0.05  # keeps the SwiGLU input in a realistic range

    glu = experts.gluon_kernels(x.device)  # the Hopper kernels where they apply (fp8_gluon), else None
    act = experts.swiglu  # the model's SwiGLU (its roundings are what the fused kernel must reproduce)
    # the grouped GEMM alone (one Triton kernel over all experts, the padded row layout) against the emulation,
    # and a sweep of its tile configurations; then the w13 kernel with SwiGLU and the quantiser in its epilogue
    # against the three steps run apart (bit for bit), and a sweep of its tiles
    for name, (w, ws, K) in {"w13": (w13, s13, D), "w2": (w2, s2, F)}.items():
        counts = torch.distributions.Multinomial(32 * 1024 * 8, torch.ones(E)).sample().long().cuda()
        padded = (counts + experts.GROUP_ROWS - 1) // experts.GROUP_ROWS * experts.GROUP_ROWS
        pends = padded.cumsum(0)
        n = int(pends[-1])
        x = torch.randn(n, K, device="cuda", generator=g).bfloat16()
        row_e = torch.searchsorted(pends, torch.arange(n, device="cuda"), right=True)
        x[(torch.arange(n, device="cuda") - (pends - padded)[row_e]) >= counts[row_e]] = 0  # padding rows
        q, sc = fp8.quantize_act(x)
        tile_e = torch.searchsorted(pends, torch.arange(0, n, experts.GROUP_ROWS, device="cuda"), right=True).int()
        bounds = pends.tolist()
        ref = torch.cat([emulate(q[a:b], sc[a:b], w[j], ws[j]) for j, (a, b) in enumerate(zip([0] + bounds[:-1], bounds))])
        for bm, warps, stages in ((128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 4, 4), (64, 4, 3), (128, 8, 2)):
            fp8_triton.GROUPED_CONFIG.update(BM=bm, num_warps=warps, num_stages=stages)
            try:
                y = grouped_gemm(q, sc, w, ws, tile_e, torch.bfloat16)
                rel = float((y.float() - ref).norm() / ref.norm())
                tt = cuda_time(lambda: grouped_gemm(q, sc, w, ws, tile_e, torch.bfloat16), iters=5)
                row = {"gemm": f"grouped {name}", "rows": n, "experts": E, "N": w.shape[1], "K": K, "rel_err": rel,
                       "config": dict(fp8_triton.GROUPED_CONFIG), "tflops": 2 * n * w.shape[1] * K / tt / 1e12}
            except Exception as e:  # noqa: BLE001 - a config the compiler refuses: record it
                row = {"gemm": f"grouped {name}", "config": dict(fp8_triton.GROUPED_CONFIG), "error": str(e)[:200],
                       "tflops": None, "N": w.shape[1], "K": K}
            res["grouped"].append(row)
            print(json.dumps(row), flush=True)
        best = max((r for r in res["grouped"] if r.get("tflops") and r["gemm"] == f"grouped {name}"),
                   key=lambda r: r["tflops"])
        res[f"grouped_config_{name}"] = best["config"]
        if name == "w13":  # the fused kernel on the same rows
            fp8_triton.GROUPED_CONFIG.update(best["config"])
            want_q, want_s = fp8.quantize_act(act(grouped_gemm(q, sc, w, ws, tile_e, torch.bfloat16)))
            for bm, warps, stages in ((128, 8, 3), (128, 8, 4), (64, 8, 3), (64, 4, 3), (128, 8, 2)):
                fp8_triton.W13_CONFIG.update(BM=bm, num_warps=warps, num_stages=stages)
                try:
                    fq, fs = w13_swiglu_quant(q, sc, w, ws, tile_e, torch.bfloat16)
                    same = (torch.equal(fq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(fs, want_s))
                    tt = cuda_time(lambda: w13_swiglu_quant(q, sc, w, ws, tile_e, torch.bfloat16), iters=5)
                    row = {"gemm": "w13 + SwiGLU + quantiser", "rows": n, "experts": E, "N": w.shape[1], "K": K,
                           "bit_identical_to_unfused": same, "config": dict(fp8_triton.W13_CONFIG),
                           "tflops": 2 * n * w.shape[1] * K / tt / 1e12}
                except Exception as e:  # noqa: BLE001
                    row = {"gemm": "w13 + SwiGLU + quantiser", "config": dict(fp8_triton.W13_CONFIG),
                           "error": str(e)[:200], "tflops": None}
                res["grouped"].append(row)
                print(json.dumps(row), flush=True)
            best13 = max((r for r in res["grouped"] if r.get("tflops") and r["gemm"] == "w13 + SwiGLU + quantiser"),
                         key=lambda r: r["tflops"])
            fp8_triton.W13_CONFIG.update(best13["config"])
            res["w13_config"] = best13["config"]
        if glu is not None:  # the Hopper kernels (served on sm_90) on the same rows: the Triton kernels' bits
            fp8_triton.GROUPED_CONFIG.update(best["config"])
            y_t = grouped_gemm(q, sc, w, ws, tile_e, torch.bfloat16)
            y = glu.grouped_gemm(q, sc.t(), w, ws, tile_e, torch.bfloat16)
            tt = cuda_time(lambda: glu.grouped_gemm(q, sc.t(), w, ws, tile_e, torch.bfloat16), iters=5)
            row = {"gemm": f"grouped {name} (gluon)", "rows": n, "experts": E, "N": w.shape[1], "K": K,
                   "rel_err": float((y.float() - ref).norm() / ref.norm()), "bit_identical_to_triton":
                   torch.equal(y, y_t), "tflops": 2 * n * w.shape[1] * K / tt / 1e12}
            res["grouped"].append(row)
            print(json.dumps(row), flush=True)
            if name == "w13":
                fq, fs = glu.w13_swiglu_quant(q, sc.t(), w, ws, tile_e, torch.bfloat16)
                same = torch.equal(fq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(fs.t(), want_s)
                tt = cuda_time(lambda: glu.w13_swiglu_quant(q, sc.t(), w, ws, tile_e, torch.bfloat16), iters=5)
                row = {"gemm": "w13 + SwiGLU + quantiser (gluon)", "rows": n, "experts": E, "N": w.shape[1], "K": K,
                       "bit_identical_to_unfused": same, "tflops": 2 * n * w.shape[1] * K / tt / 1e12}
                res["grouped"].append(row)
                print(json.dumps(row), flush=True)
                # as served for 16-bit models: A gathered in the loads (each row its own "token"; padding rows -1)
                live = torch.ones(n, dtype=torch.bool, device="cuda")
                live[(torch.arange(n, device="cuda") - (pends - padded)[row_e]) >= counts[row_e]] = False
                a_rows = torch.where(live, torch.arange(n, device="cuda"), -1).int()
                fq, fs = glu.w13_swiglu_quant(q, sc.t(), w, ws, tile_e, torch.bfloat16, a_rows)
                same = torch.equal(fq.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(fs.t(), want_s)
                tt = cuda_time(lambda: glu.w13_swiglu_quant(q, sc.t(), w, ws, tile_e, torch.bfloat16, a_rows), iters=5)
                row = {"gemm": "w13 + SwiGLU + quantiser (gluon, A gathered)", "rows": n, "experts": E,
                       "N": w.shape[1], "K": K, "bit_identical_to_unfused": same,
                       "tflops": 2 * n * w.shape[1] * K / tt / 1e12}
                res["grouped"].append(row)
                print(json.dumps(row), flush=True)
    fp8_triton.GROUPED_CONFIG.update(res["grouped_config_w2"])  # the expert block below: w2 is the grouped kernel

    for T in (8 * 1024, 32 * 1024, 64 * 1024):
        k = cfg.n_experts_per_tok
        x = torch.randn(T, D, device="cuda", generator=g).bfloat16()
        idx = torch.randint(0, E, (T * k,), device="cuda", generator=g)
        rows = idx.argsort(stable=True)
        ends = torch.searchsorted(idx[rows], torch.arange(1, E + 1, device="cuda"))
        y, dest = experts.grouped_w8a8(x, rows, k, ends, w13, s13, w2, s2, act)
        y = y[dest]
        with fp8.diagnostic_emulation("float32"):
            ref, dest = experts.grouped_w8a8(x, rows, k, ends, w13, s13, w2, s2, act)
            ref = ref[dest].float()
        rel = float((y.float() - ref).norm() / ref.norm())
        tt = cuda_time(lambda: experts.grouped_w8a8(x, rows, k, ends, w13, s13, w2, s2, act), iters=5)
        row = {"gemm": "experts", "kernels": "gluon" if glu is not None else "triton", "tokens": T, "rows": T * k,
               "experts": E, "N": 2 * F, "K": D, "rel_err": rel,
               "tflops": 2 * T * k * 3 * F * D / tt / 1e12, "seconds": tt}
        res["grouped"].append(row)
        print(json.dumps(row), flush=True)
    res["ceilings"] = ceilings(g)
    print(json.dumps(res["ceilings"]), flush=True)
    return res


def ceilings(g, n: int = 8192) -> dict:
    """TFLOP/s at n^3: block-scaled FP8 (the W8A8 GEMM), tensor-wise FP8, bf16."""
    out = {}
    x = torch.randn(n, n, device="cuda", generator=g).bfloat16()
    w, ws = fp8_weight(n, n, g)
    q, s = fp8.quantize_act(x)
    out["fp8_blockwise"] = 2 * n ** 3 / cuda_time(lambda: fp8.fp8_mm(q, s, w, ws, torch.bfloat16)) / 1e12
    one = torch.ones((), device="cuda")
    wt = w.t()
    out["fp8_tensorwise"] = 2 * n ** 3 / cuda_time(
        lambda: torch._scaled_mm(q, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)) / 1e12
    wb = torch.randn(n, n, device="cuda", generator=g).bfloat16()
    out["bf16"] = 2 * n ** 3 / cuda_time(lambda: x @ wb) / 1e12
    return out


def artifacts(comp: V2Compute, nonces: list[int], batch: int, ctx=nullcontext) -> dict[int, np.ndarray]:
    out = {}
    with ctx():
        for i in range(0, len(nonces), batch):
            prep = comp.prepare(BH, PK, nonces[i:i + batch], 1024, 12)
            out.update({a["nonce"]: v2.decode(a["vector_b64"]) for a in comp.run(prep)[0]})
    return out


def dist(a: dict, b: dict) -> dict:
    d = np.array([float(np.linalg.norm(a[n].astype(np.float64) - b[n].astype(np.float64))) for n in a])
    return {"mean": float(d.mean()), "p98": float(np.percentile(d, 98)), "max": float(d.max()), "n": len(d),
            "over_0.1737": float((d > 0.1737).mean())}


@torch.no_grad()
def accuracy(args) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    res = {}
    for layers, n in ((4, args.nonces), (48, args.deep_nonces)):
        if not n:
            continue
        cfg = replace(PRESETS[SHAPE], n_layers=layers)
        nonces = list(range(n))
        ours, emu = {}, {}
        for fmt in FP8_SCALES:  # the same checkpoint-like weights (seed 0), each scale format
            model = random_model(cfg, torch.bfloat16, "cuda", fp8_ckpt=True, seed=0,
                                 options=ModelOptions(fp8="w8a8", fp8_scales=fmt, compiled=args.compile))
            comp = V2Compute(model, cfg, torch.bfloat16, torch.device("cuda"), SHAPE, compile=args.compile)
            t0 = time.perf_counter()
            ours[fmt] = artifacts(comp, nonces, args.batch)
            t_ours = t_ours if fmt == "float32" else time.perf_counter() - t0
            emu[fmt] = artifacts(comp, nonces, args.batch, lambda: fp8.diagnostic_emulation("float32"))
            if fmt == "ue8m0":
                emu_other = artifacts(comp, nonces, args.batch, lambda: _both(
                    fp8.diagnostic_emulation("float32"),
                    sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])))
                deq = artifacts(comp, nonces, args.batch, lambda: fp8.diagnostic_emulation("dequantised"))
            del model, comp
            torch.cuda.empty_cache()
        row = {"layers": layers, "nonces": n, "batch": args.batch, "compile": args.compile, "scales": "ue8m0",
               "ours_vs_emulation": dist(ours["ue8m0"], emu["ue8m0"]),
               "emulation_vs_emulation_other_attention": dist(emu_other, emu["ue8m0"]),
               "dequant_vs_emulation": dist(deq, emu["ue8m0"]),
               "float32_scales_vs_emulation": dist(ours["float32"], emu["ue8m0"]),
               "float32_emulation_vs_emulation": dist(emu["float32"], emu["ue8m0"]),
               "float32_scales_vs_float32_emulation": dist(ours["float32"], emu["float32"]),
               "ours_seconds": t_ours}
        res[f"layers_{layers}"] = row
        print(json.dumps(row), flush=True)
    return res


def pow2_ceil64(y: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(y)) for positive float64 y, exactly: y = m 2^e with m in [1/2, 1), so the answer is 2^(e-1)
    when m is exactly 1/2 and 2^e otherwise."""
    m, e = torch.frexp(y)
    return torch.ldexp(torch.ones_like(y), torch.where(m == 0.5, e - 1, e))


def requant_formula(w: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0 re-quantisation transcribed in float64: per 128x128 block w = fp32(w8) * s, amax = max(|w|, 1e-4),
    scale 2^ceil(log2(amax / 448)), w8' = RNE_e4m3(w / scale)."""
    R, C = w.shape
    wf = w.float() * s.repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]
    Rb, Cb = s.shape
    pad = torch.zeros(Rb * 128, Cb * 128, device=w.device)
    pad[:R, :C] = wf
    amax = pad.view(Rb, 128, Cb, 128).abs().amax(dim=(1, 3)).clamp(min=1e-4)
    scale = pow2_ceil64(amax.double() / 448.0)
    q = (pad.view(Rb, 128, Cb, 128).double() / scale[:, None, :, None]).float().to(fp8.FP8)
    return q.view(Rb * 128, Cb * 128)[:R, :C], scale.float()


def quant_formula(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """UE8M0 activation quantiser transcribed in float64: per row and 128 columns amax = max(|x|, 1e-10),
    scale 2^ceil(log2(amax / 448)), q = RNE_e4m3(clamp(x / scale))."""
    M, K = x.shape
    xf = torch.nn.functional.pad(x.float(), (0, -K % 128)).view(M, -1, 128)
    amax = xf.abs().amax(-1).clamp(min=1e-10)
    scale = pow2_ceil64(amax.double() / 448.0)
    q = (xf.double() / scale[..., None]).clamp(-448, 448).float().to(fp8.FP8).view(M, -1)[:, :K]
    return q, scale.float()


@torch.no_grad()
def ue8m0(args) -> dict:
    """The UE8M0 quantiser and weight re-quantisation against the float64 transcriptions, on the activation widths
    and dense weights of the Qwen3-30B-A3B and Qwen3-235B-A22B shapes."""
    g = torch.Generator(device="cuda").manual_seed(0)
    res: dict = {"quantiser": [], "requant": []}
    for shape in ("qwen3-30b-a3b", "qwen3-235b-a22b"):
        cfg = PRESETS[shape]
        q_w, kv_w = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        for dtype in (torch.bfloat16, torch.float32):
            cases = {"adversarial": adversarial(torch.Generator().manual_seed(1)).to(dtype)}
            for K in (cfg.dim, q_w, cfg.moe_ffn_dim):
                x = torch.randn(8 * 1024, K, device="cuda", generator=g) * 3
                x[::97] *= 1e-4  # small rows
                x[5, :128] = 448.0 * 2.0 ** -3  # a group whose amax is exactly 448 x a power of two
                cases[f"8x1024x{K}"] = x.to(dtype)
            for name, x in cases.items():
                q1, s1 = fp8.quantize_act(x, ue8m0=True)
                q2, s2 = quant_formula(x)
                row = {"shape": shape, "input": name, "dtype": str(dtype),
                       "bit_identical": torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2),
                       "q_diff": int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum()),
                       "s_diff": int((s1 != s2).sum())}
                res["quantiser"].append(row)
                print(json.dumps(row), flush=True)
        for name, (n, k) in {"qkv": (q_w + 2 * kv_w, cfg.dim), "o": (cfg.dim, q_w)}.items():
            w = fp8_payload((n, k), "cuda", g)
            s = torch.empty(fp8.cdiv(n, 128), fp8.cdiv(k, 128), device="cuda").uniform_(0.9, 1.1, generator=g) * 3e-4
            s[0, 0] = 1e-9  # a block under the 1e-4 amax floor
            s[0, 1] = 2.0 ** -12  # a power of two: with |w8| 448 in the block its amax is exactly 448 x 2^-12
            w[0, 128] = 448.0
            w[128:256, :128] = w[128:256, :128].float().clamp(-60, 60).to(fp8.FP8)  # largest |w8| below 448
            q1, s1 = fp8.requant_ue8m0(w, s)
            q2, s2 = requant_formula(w, s)
            row = {"shape": shape, "weight": name, "size": [n, k],
                   "bit_identical": torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2),
                   "q_diff": int((q1.view(torch.uint8) != q2.view(torch.uint8)).sum()), "s_diff": int((s1 != s2).sum()),
                   "blocks": s.numel(), "scales_changed": int((s1 != s).sum())}
            res["requant"].append(row)
            print(json.dumps(row), flush=True)
    x = torch.randn(64 * 1024, PRESETS[SHAPE].dim, device="cuda", dtype=torch.bfloat16)
    res["quantiser_gbps"] = {fmt: x.numel() * (2 + 1) / cuda_time(lambda: fp8.quantize_act(x, ue8m0=fmt == "ue8m0"))
                             / 1e9 for fmt in FP8_SCALES}
    print(json.dumps(res["quantiser_gbps"]), flush=True)
    return res


class _both:
    def __init__(self, *cms):
        self.cms = cms

    def __enter__(self):
        for c in self.cms:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self.cms):
            c.__exit__(*exc)


def plot(res: dict, path: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    if res["what"] == "ue8m0":
        fig, ax = plt.subplots(figsize=(7, 3.6))
        rows = res["result"]["quantiser"] + res["result"]["requant"]
        labels = [f"{r['shape']} {r.get('input', r.get('weight'))} {r.get('dtype', '')}" for r in rows]
        ax.barh(labels, [r["q_diff"] + r["s_diff"] for r in rows])
        ax.set_xlabel("values or scales differing from the float64 formula")
        ax.set_title(f"bit-identical: {sum(r['bit_identical'] for r in rows)} of {len(rows)}", fontsize=9)
    elif res["what"] == "accuracy":
        keys = [k for k in ("ours_vs_emulation", "emulation_vs_emulation_other_attention", "dequant_vs_emulation",
                            "float32_scales_vs_emulation") if k in next(iter(res["result"].values()))]
        rows = list(res["result"].items())
        fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.8), squeeze=False)
        width = 0.8 / len(keys)
        for ax, (name, row) in zip(axes[0], rows):
            for i, k in enumerate(keys):
                vals = [row[k]["mean"], row[k]["p98"], row[k]["max"]]
                ax.bar([j + i * width for j in range(3)], vals, width=width, label=k.replace("_", " "))
            ax.axhline(0.1737, color="r", ls="--", lw=1, label="network threshold 0.1737")
            ax.set_xticks([j + 0.4 - width / 2 for j in range(3)], ["mean", "p98", "max"])
            ax.set_title(f"{name}: {row['nonces']} nonces, seq 1024")
            ax.set_ylabel("artifact L2")
            ax.legend(fontsize=7)
    else:
        fig, ax = plt.subplots(figsize=(6, 3.6))
        c = res["result"]["ceilings"]
        rows = res["result"]["gemm"] + res["result"]["grouped"]
        labels = [f"{r.get('gemm', 'dense')} {r.get('M', r.get('rows'))}x{r['N']}x{r['K']} {r.get('config', '')}"
                  for r in rows if r["tflops"]]
        ax.barh(labels, [r["tflops"] for r in rows if r["tflops"]])
        for k, v in c.items():
            ax.axvline(v, ls="--", lw=1, label=f"{k} 8192^3: {v:.0f}")
        ax.set_xlabel("TFLOP/s")
        ax.legend(fontsize=7)
    fig.suptitle(res["device"], fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["kernels", "accuracy", "ue8m0"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--nonces", type=int, default=512, help="nonces of the 4-layer model")
    ap.add_argument("--deep-nonces", type=int, default=256, help="nonces of the 48-layer model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--compile", action="store_true", help="the served (compiled) path for ours")
    ap.add_argument("--shape", default=SHAPE, choices=sorted(k for k, c in PRESETS.items() if c.n_experts),
                    help="kernels: the MoE preset whose layer sizes are measured (e.g. qwen3-235b-a22b, one rank's "
                         "experts at expert parallel are the same shapes)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.perf_counter()
    result = {"kernels": kernels, "accuracy": accuracy, "ue8m0": ue8m0}[args.what](args)
    res = {"what": args.what, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "command": "python benchmarks/diagnostics/w8a8.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.perf_counter() - t0, "result": result}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    plot(res, out.with_suffix(".png"))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
