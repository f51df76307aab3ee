"""MiniMax-M2.7's experts on one Hopper GPU at one layer of a served batch (64 nonces x seq 1024 = 65,536 tokens,
256 experts, top 8, hidden 3072, expert width 1536, W8A8 with UE8M0 activation scales, the routing weight in w2's
epilogue): the Gluon kernels (w13 with SwiGLU and the quantiser, A gathered from the tokens' rows; w2) in each
variant, timed (CUDA events, median of 10) and checked bit for bit against the Triton kernels (`fp8_triton`, the
validators' arithmetic), then the whole expert block (`experts.grouped_w8a8`) as the model calls it.

    PYTHONPATH=src:. python benchmarks/diagnostics/minimax_experts.py --out benchmarks/h200/minimax_experts.json

Variants: `fold` (fp8_gluon.FOLD_POW2: with power-of-two activation scales the promotion is one FMA an element,
fma(p, s_a s_b, acc), instead of a product and an FMA; the same bits) on and off, for each kernel called with
a_pow2 and for the expert block as experts.py calls them (a_pow2 on w13 only: w2 measured slower folded). TFLOP/s count the routed rows'
useful FLOPs (2 x rows x N x K; the padding rows are not counted), as the profile's 890 TFLOP/s did. Beside them
the same FLOPs as one dense GEMM in cuBLAS (every routed row against one expert's weight): block-scaled, as the dense
layers run, and tensor-wise (no per-block promotion): what these shapes reach on this card without the experts.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

E, D, F, TOPK = 256, 3072, 1536, 8  # MiniMax-M2.7's experts (config.PRESETS["minimax-m2.7"])


def plot(res: dict, path: Path) -> None:
    """TFLOP/s of each row, the Triton kernels (the validators' arithmetic) beside the Gluon variants."""
    from poc.bench import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    rows = res["rows"]
    labels = [r["what"].replace(" (", "\n(") + ("" if "fold" not in r else f"\nfold {'on' if r['fold'] else 'off'}")
              for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4.8))
    bars = ax.bar(range(len(rows)), [r["tflops"] for r in rows],
                  color=["#999" if "triton" in r["what"] else ("#2a7" if r.get("fold") else "#37b") for r in rows])
    for b, r in zip(bars, rows):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{r['tflops']:.0f}\n{r['ms']:.2f} ms", ha="center",
                va="bottom", fontsize=7)
    ax.set_xticks(range(len(rows)), labels, fontsize=6)
    ax.set_ylabel("TFLOP/s (routed rows)")
    ax.set_title(f"MiniMax-M2.7 experts, {res['tokens']} tokens x top {res['topk']}, {res.get('device', '')}",
                 fontsize=9)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64 * 1024)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, metavar="JSON", help="only draw the plot of a result file beside it")
    a = ap.parse_args(argv)
    from poc.bench import redraw

    if a.plot:
        redraw(a.plot, plot)
        return 0

    import torch

    from poc.bench import cuda_time, write_result
    from poc.model import experts, fp8
    from poc.model.config import PRESETS
    from poc.model.kernels import fp8_gluon, fp8_triton

    if not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9):
        raise SystemExit("minimax_experts needs a Hopper GPU (the Gluon kernels are sm_90a): nothing was run")
    cfg = PRESETS["minimax-m2.7"]
    assert (cfg.n_experts, cfg.dim, cfg.moe_ffn_dim, cfg.n_experts_per_tok) == (E, D, F, TOPK)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T = a.tokens
    x = (torch.randn(T, D, device=dev, generator=g) * 2).bfloat16()
    idx = torch.rand(T, E, device=dev, generator=g).topk(TOPK, dim=1).indices.reshape(-1)  # distinct per token
    rows = idx.argsort(stable=True)
    ends = torch.searchsorted(idx[rows], torch.arange(1, E + 1, device=dev))
    weights = torch.rand(T * TOPK, device=dev, generator=g)  # the routing weights, in routed (rows) order

    def fp8_weights(n, k):
        w = (torch.randn(E, n, k, device=dev, generator=g) * 64).clamp_(-448, 448).to(fp8.FP8)
        s = torch.rand(E, n // 128, k // 128, device=dev, generator=g).mul_(0.2).add_(0.9) * (0.001 / 64)
        return w, s

    w13, s13 = fp8_weights(2 * F, D)
    w2, s2 = fp8_weights(D, F)
    qt, st = fp8.quantize_act(x, ue8m0=True)
    dest, tile_e, a_rows = experts.padded_layout(rows, TOPK, ends)
    rw = torch.zeros(a_rows.numel(), dtype=torch.float32, device=dev)
    rw[dest] = weights
    n_routed = T * TOPK
    flop13, flop2 = 2 * n_routed * 2 * F * D, 2 * n_routed * D * F
    res: dict = {"tokens": T, "experts": E, "topk": TOPK, "hidden": D, "expert_width": F, "rows_routed": n_routed,
                 "rows_padded": int(a_rows.numel()), "rows": []}

    def row(what, fn, flop, **extra):
        t = cuda_time(fn, iters=10)
        r = {"what": what, **extra, "ms": round(t * 1e3, 3), "tflops": round(flop / t / 1e12, 1)}
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
        return r

    # the validators' arithmetic: the Triton kernels
    kw = dict(group_rows=experts.GROUP_ROWS)
    want_q, want_s = fp8_triton.w13_swiglu_quant(qt, fp8.col_major(st), w13, s13, tile_e, torch.bfloat16, a_rows,
                                                 ue8m0=True, **kw)
    want_y = fp8_triton.grouped_gemm(want_q, want_s, w2, s2, tile_e, torch.bfloat16, row_weight=rw, **kw)
    row("w13 + SwiGLU + quantiser (triton)", lambda: fp8_triton.w13_swiglu_quant(
        qt, fp8.col_major(st), w13, s13, tile_e, torch.bfloat16, a_rows, ue8m0=True, **kw), flop13)
    row("w2 + routing weight (triton)", lambda: fp8_triton.grouped_gemm(
        want_q, want_s, w2, s2, tile_e, torch.bfloat16, row_weight=rw, **kw), flop2)
    live = dest
    for fold in (False, True):
        fp8_gluon.FOLD_POW2 = fold
        aq, as_ = fp8_gluon.w13_swiglu_quant(qt, st.t(), w13, s13, tile_e, torch.bfloat16, a_rows, ue8m0=True,
                                             a_pow2=True)
        same13 = (torch.equal(aq[live].view(torch.uint8), want_q[live].view(torch.uint8))
                  and torch.equal(as_.t()[live], want_s[live]))
        row("w13 + SwiGLU + quantiser (gluon, A gathered)", lambda: fp8_gluon.w13_swiglu_quant(
            qt, st.t(), w13, s13, tile_e, torch.bfloat16, a_rows, ue8m0=True, a_pow2=True), flop13, fold=fold,
            triton_bits=same13)
        y = fp8_gluon.grouped_gemm(aq, as_, w2, s2, tile_e, torch.bfloat16, row_weight=rw, a_pow2=True)
        row("w2 + routing weight (gluon)", lambda: fp8_gluon.grouped_gemm(
            aq, as_, w2, s2, tile_e, torch.bfloat16, row_weight=rw, a_pow2=True), flop2, fold=fold,
            triton_bits=torch.equal(y[live], want_y[live]))
        yb, db = experts.grouped_w8a8(x, rows, TOPK, ends, w13, s13, w2, s2, ue8m0=True, row_weight=weights)
        row("expert block (grouped_w8a8: layout, w13, w2)", lambda: experts.grouped_w8a8(
            x, rows, TOPK, ends, w13, s13, w2, s2, ue8m0=True, row_weight=weights), flop13 + flop2, fold=fold,
            triton_bits=torch.equal(yb[db], want_y[dest]))
        del aq, as_, y, yb
    fp8_gluon.FOLD_POW2 = True
    # what a GEMM of these shapes reaches without the experts: every routed row against one weight, dense, in
    # cuBLAS (block-scaled as the dense layers run it, and tensor-wise: no per-block promotion at all)
    one = torch.ones((), device=dev)
    refused: list[str] = []
    catch = logging.Handler()
    catch.emit = lambda rec: refused.append(rec.getMessage()) if "_scaled_mm failed" in rec.getMessage() else None
    logging.getLogger(fp8.__name__).addHandler(catch)
    for name, (n, k) in {"w13": (2 * F, D), "w2": (D, F)}.items():
        xa = (torch.randn(n_routed, k, device=dev, generator=g) * 2).bfloat16()
        qa, sa = fp8.quantize_act(xa, ue8m0=True)
        del xa
        w, ws = (w13[0], s13[0]) if name == "w13" else (w2[0], s2[0])
        flop = 2 * n_routed * n * k
        fp8.fp8_mm(qa, sa, w, ws, torch.bfloat16)  # where _scaled_mm refuses, fp8 logs it and emulates: no figure
        row(f"dense {name} shape (cuBLAS, block-scaled)", lambda: fp8.fp8_mm(qa, sa, w, ws, torch.bfloat16), flop,
            emulated=bool(refused))
        wt = w.t()
        row(f"dense {name} shape (cuBLAS, tensor-wise)", lambda: torch._scaled_mm(
            qa, wt, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), flop)
        del qa, sa
    if a.out:
        import triton
        write_result(a.out, "benchmarks/diagnostics/minimax_experts.py", argv, res, plot,
                     device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
