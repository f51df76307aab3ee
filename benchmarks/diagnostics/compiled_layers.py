"""Where, if anywhere, does the compiled bf16 decoder layer round differently from eager on the GPU?

    python benchmarks/diagnostics/compiled_layers.py [--out benchmarks/h100/compiled_layers.json] [--smoke]

Each piece of a Qwen3-0.6B-shaped layer runs eager and compiled (as the engine compiles: compute.eager_numerics)
on the same bf16 inputs; the fraction of output elements that differ says which op rounds differently. Then every
one of the 28 layers, and the sensitivity of the whole model: the final-norm state's change after one bf16 ulp on
one input element, against the bf16-vs-fp32 gap and the compiled-vs-eager gap; and what
allow_bf16_reduced_precision_reduction does to the eager GEMMs. --smoke: the tiny shape on the CPU.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


from poc.model.compile import maybe_compile  # noqa: E402
from poc.model.config import PRESETS  # noqa: E402
from poc.model.random_weights import random_model  # noqa: E402
from poc.model.numerics import reflect, sum_exact  # noqa: E402
from poc.model.transformer import Transformer, apply_rope  # noqa: E402


def diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float(), b.float()
    d = (a - b).abs()
    return {"frac_differ": (d > 0).float().mean().item(), "max_abs": d.max().item(),
            "rel_l2": ((a - b).norm() / a.norm().clamp_min(1e-30)).item()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/h100/compiled_layers.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (checks the script runs)")
    args = ap.parse_args()
    dev, dt = torch.device("cpu" if args.smoke else "cuda"), torch.bfloat16
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = PRESETS["tiny" if args.smoke else "qwen3-0.6b"]
    model = random_model(cfg, dt, dev)
    B, S, D = (2, 16, cfg.dim) if args.smoke else (8, 1024, cfg.dim)
    g = torch.Generator(device=dev).manual_seed(1)
    x = torch.randn(B, S, D, device=dev, generator=g).to(dt)
    blk = model.layers["0"]
    cos, sin = model.rope_cos[:S], model.rope_sin[:S]
    out: dict = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__, "ops": {}}
    gg = torch.randn(B * S, cfg.ffn_dim, device=dev, generator=g).to(dt) * 2
    uu = torch.randn(B * S, cfg.ffn_dim, device=dev, generator=g).to(dt)
    q = torch.randn(B, cfg.n_heads, S, cfg.head_dim, device=dev, generator=g).to(dt)
    v = F.normalize(torch.randn(D, device=dev, generator=g), dim=0).to(dt)
    pieces = {
        "silu_mul (F.silu)": (lambda a, b: F.silu(a) * b, (gg, uu)),  # as the model's MLP writes it
        "silu_mul (x/(1+exp(-x)))": (lambda a, b: (a.float() / (1 + torch.exp(-a.float()))).to(a.dtype) * b,
                                     (gg, uu)),
        "exp fp32": (lambda a: torch.exp(a.float()), (gg,)),
        "sigmoid fp32": (lambda a: torch.sigmoid(a.float()), (gg,)),
        "div fp32": (lambda a, b: a.float() / (b.float().abs() + 1), (gg, uu)),
        "rsqrt fp32": (lambda a: torch.rsqrt(a.float().abs() + 1e-6), (gg,)),
        "mean of squares fp32": (lambda a: a.float().pow(2).mean(-1, keepdim=True), (x,)),
        "sum_exact of squares (fp64)": (lambda a: sum_exact(a.float().pow(2)), (x,)),
        "rmsnorm": (lambda a: blk.input_layernorm(a), (x,)),
        "rope": (lambda a: apply_rope(a, cos, sin), (q,)),
        "reflect": (lambda a: reflect(a, v), (x,)),
        "attention block (norm, qkv, q/k norm, rope, sdpa, o)": (lambda a: blk.self_attn(blk.input_layernorm(a), cos,
                                                                                         sin), (x,)),
        "mlp": (lambda a: blk.mlp(a), (x,)),
        "layer_step": (lambda a: Transformer.layer_step(blk, a, cos, sin, v, False), (x,)),
        "layer_step, last position only": (lambda a: Transformer.layer_step(blk, a, cos, sin, v, True), (x,)),
    }
    with torch.inference_mode():
        for name, (fn, inp) in pieces.items():
            e = fn(*inp)
            c = maybe_compile(fn, True)(*inp)
            out["ops"][name] = diff(e, c)
            print(name, out["ops"][name], flush=True)
        # every layer, fed the eager input each time
        step = maybe_compile(Transformer.layer_step, True)
        h, per_layer = x, []
        vs = F.normalize(torch.randn(cfg.n_layers, D, device=dev, generator=g), dim=1).to(dt)
        for i in range(cfg.n_layers):
            b = model.layers[str(i)]
            e = Transformer.layer_step(b, h, cos, sin, vs[i], False)
            c = step(b, h, cos, sin, vs[i], False)
            per_layer.append(diff(e, c)["frac_differ"])
            h = e
        out["per_layer_frac_differ"] = per_layer
        print("per layer", per_layer, flush=True)
        # sensitivity: one ulp on one input element, and the bf16 vs fp32 gap, on the final-norm state
        base = model(x, reflections=vs)
        x1 = x.clone()
        x1[0, S // 2, 7] = torch.nextafter(x1[0, S // 2, 7].float(), torch.tensor(1e9, device=dev)).to(dt)
        x1[0, S // 2, 7] += x1[0, S // 2, 7] * 2 ** -7
        pert = model(x1, reflections=vs)
        m32 = random_model(cfg, torch.float32, dev)
        ref32 = m32(x.float(), reflections=vs.float())
        rel = lambda a, b: ((a.float() - b.float()).norm(dim=-1) / b.float().norm(dim=-1)).tolist()  # noqa: E731
        out["one_element_one_ulp_rel_change"] = rel(pert, base)
        out["bf16_vs_fp32_rel"] = rel(base, ref32)
        comp = model(x, reflections=vs, step=step)
        out["compiled_vs_eager_rel"] = rel(comp, base)
        print({k: out[k] for k in ("one_element_one_ulp_rel_change", "bf16_vs_fp32_rel", "compiled_vs_eager_rel")})
        # reduced-precision split-K reductions in cuBLAS
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        strict = model(x, reflections=vs)
        out["eager_no_reduced_precision_reduction_vs_default_rel"] = rel(strict, base)
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
        print("no-rpr", out["eager_no_reduced_precision_reduction_vs_default_rel"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
