"""MiniMax-M2.7's router GEMM on one GPU at a served batch's shape (64 nonces x seq 1024 = 65,536 tokens, hidden
3072, 256 experts, top 8): the validators' true float32 GEMM (FFMA) against the split we serve (route.split_logits:
the float32 gate as three exact bfloat16 parts, one bfloat16 GEMM with a float32 output on the tensor cores), each
timed (CUDA events, median of 20) and measured against the float64 product: the mean and largest error of the logits,
the largest error as a share of the float32 dot-product bound (D u sum|x w|), and the share of tokens whose top 8 of
sigma + bias differ from float64's. Beside them what the spec rules out: TF32, two bfloat16 parts, the bfloat16 gate.

    PYTHONPATH=src:. python benchmarks/diagnostics/router_gemm.py --out benchmarks/h200/router_gemm.json

The input is the router's: a bfloat16 hidden state (unit normal, as the post-attention norm leaves it at random
weights), the gate and bias drawn as random_weights draws them (normal, 0.02). JSON (the command inside) and a PNG.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

E, D, TOPK = 256, 3072, 8  # MiniMax-M2.7's router (config.PRESETS["minimax-m2.7"])


def plot(res: dict, path: Path) -> None:
    """Time and the logits' mean error against float64, one bar each, per method."""
    from poc.bench import pyplot, save_figure

    plt = pyplot()
    if plt is None:
        return
    rows = res["rows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["method"] for r in rows]
    colors = ["#2a7" if r["method"].startswith("split (served)") else "#37b" if "FFMA" in r["method"] else "#c54"
              for r in rows]
    a1.barh(range(len(rows)), [r["ms"] for r in rows], color=colors)
    for i, r in enumerate(rows):
        a1.text(r["ms"], i, f" {r['ms']:.2f} ms", va="center", fontsize=7)
    a1.set_yticks(range(len(rows)), names, fontsize=7)
    a1.set_xlabel("ms a layer")
    a1.invert_yaxis()
    a2.barh(range(len(rows)), [max(r["mean_abs_err"], 1e-12) for r in rows], color=colors)
    for i, r in enumerate(rows):
        a2.text(max(r["mean_abs_err"], 1e-12), i, f" {r['mean_abs_err']:.1e}; top 8 differs for "
                f"{round(r['topk_differs'] * res['tokens'])} tokens", va="center", fontsize=7)
    a2.set_xscale("log")
    a2.set_yticks(range(len(rows)), [""] * len(rows))
    a2.set_xlabel("mean |logit - float64|")
    a2.invert_yaxis()
    fig.suptitle(f"MiniMax-M2.7 router, {res['tokens']} tokens x {D} -> {E}, {res.get('device', '')}", fontsize=9)
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
    import torch.nn.functional as F

    from poc.bench import cuda_time, write_result
    from poc.model import route
    from poc.model.config import PRESETS

    if not torch.cuda.is_available():
        raise SystemExit("router_gemm needs a GPU: nothing was run")
    cfg = PRESETS["minimax-m2.7"]
    assert (cfg.n_experts, cfg.dim, cfg.n_experts_per_tok) == (E, D, TOPK)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    T = a.tokens
    x = torch.randn(T, D, device=dev, generator=g).bfloat16()
    w = torch.randn(E, D, device=dev, generator=g) * 0.02
    bias = torch.randn(E, device=dev, generator=g) * 0.02
    exact = x.double() @ w.double().t()  # (T, E) float64
    bound = D * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())
    want = torch.topk(1 / (1 + torch.exp(-exact)) + bias.double(), TOPK).indices.sort(-1).values
    parts3 = route.split3(w)
    hi, mid = parts3[:E], parts3[E:2 * E]
    parts2 = torch.cat([hi, mid])
    xf = x.float()

    def two_parts():
        z = torch.mm(x, parts2.t(), out_dtype=torch.float32)
        return z[:, :E] + z[:, E:]

    def tf32():
        torch.backends.cuda.matmul.allow_tf32 = True
        try:
            return F.linear(xf, w)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False

    methods = {
        "float32 GEMM, FFMA (the validators')": (lambda: F.linear(xf, w), 1),
        "split (served): 3 bf16 parts, one GEMM": (lambda: route.split_logits(x, parts3), 3),
        "2 bf16 parts (16 of 24 bits)": (two_parts, 2),
        "TF32 (ruled out by the spec)": (tf32, 1),
        "bf16 gate (ruled out)": (lambda: torch.mm(x, hi.t(), out_dtype=torch.float32), 1),
    }
    flop = 2 * T * D * E
    res: dict = {"tokens": T, "hidden": D, "experts": E, "topk": TOPK, "rows": []}
    for name, (fn, mult) in methods.items():
        z = fn().double()
        err = (z - exact).abs()
        top = torch.topk(1 / (1 + torch.exp(-z)) + bias.double(), TOPK).indices.sort(-1).values
        t = cuda_time(fn, iters=20)
        r = {"method": name, "ms": round(t * 1e3, 4), "gemm_tflops": round(mult * flop / t / 1e12, 1),
             "router_tflops": round(flop / t / 1e12, 1), "mean_abs_err": float(err.mean()),
             "max_abs_err": float(err.max()), "max_err_over_float32_bound": float((err / bound).max()),
             "topk_differs": float((top != want).any(-1).float().mean())}
        res["rows"].append(r)
        print(json.dumps(r), flush=True)
        del z, err, top
    if a.out:
        write_result(a.out, "benchmarks/diagnostics/router_gemm.py", argv, res, plot, device=torch.cuda.get_device_name(),
                     torch=torch.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())
