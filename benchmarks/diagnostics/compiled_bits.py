"""Bit level: does the compiled (Triton) path round each elementwise step of the model as eager does?

    python benchmarks/diagnostics/compiled_bits.py [--out benchmarks/h100/compiled_bits.json]

Each step runs eager and compiled (with the engine's inductor settings, compute.eager_numerics) on the same bf16
inputs. For a step that differs: the fraction of elements, and the first differing elements with the eager value,
the compiled value and a float64 reference, so one can tell which side rounds correctly. Run it after a torch
upgrade: every step bit-identical is what lets `--compile` compute eager's bits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F


from poc.model.compile import eager_numerics, maybe_compile  # noqa: E402
from poc.model.numerics import reflect  # noqa: E402
from poc.model.transformer import RMSNorm, apply_rope, rope_table  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/h100/compiled_bits.json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    out: dict = {"torch": torch.__version__, "knobs": eager_numerics(), "steps": {}}
    g = torch.Generator(device=dev).manual_seed(1)
    x = (torch.randn(1 << 22, device=dev, generator=g) * 2).to(dt)
    u = torch.randn(1 << 22, device=dev, generator=g).to(dt)
    q = torch.randn(8, 16, 256, 128, device=dev, generator=g).to(dt)
    cos, sin = rope_table(128, 256, 1e6, device=dev)
    h = torch.randn(4096, 1024, device=dev, generator=g).to(dt)
    norm = RMSNorm(1024, 1e-6).to(dev, dt)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(1024, device=dev, generator=g) + 0.5)
    v = F.normalize(torch.randn(1024, device=dev, generator=g), dim=0).to(dt)
    f = lambda t: t.float()  # noqa: E731
    steps = {
        "exp(-x)": (lambda a: torch.exp(-f(a)), (x,), lambda a: torch.exp(-a.double())),
        "1+exp(-x)": (lambda a: 1 + torch.exp(-f(a)), (x,), lambda a: 1 + torch.exp(-a.double())),
        "x/(1+exp(-x))": (lambda a: f(a) / (1 + torch.exp(-f(a))), (x,), lambda a: a.double() / (1 + torch.exp(-a.double()))),
        "F.silu fp32": (lambda a: F.silu(f(a)), (x,), lambda a: a.double() / (1 + torch.exp(-a.double()))),
        "x/y fp32": (lambda a, b: f(a) / (f(b).abs() + 1), (x, u), lambda a, b: a.double() / (b.double().abs() + 1)),
        "silu_mul bf16": (lambda a, b: F.silu(a) * b, (x, u), None),  # as the model's MLP writes it
        "rope (table inputs)": (lambda a, c, s: apply_rope(a, c, s), (q, cos, sin), None),
        "q*cos fp32": (lambda a, c: f(a) * c.to(dt).float(), (q, cos), None),
        "q*cos+q*sin fp32": (lambda a, c, s: f(a) * c.to(dt).float() + f(a).flip(-1) * s.to(dt).float(), (q, cos, sin), None),
        "rmsnorm (random weight)": (lambda a: norm(a), (h,), None),
        "reflect": (lambda a: reflect(a, v), (h,), None),
    }
    with torch.inference_mode():
        for name, (fn, inp, ref) in steps.items():
            e = fn(*inp)
            torch._dynamo.reset()
            c = maybe_compile(fn, True)(*inp)
            d = (e != c)
            row = {"bit_identical": bool(torch.equal(e, c)), "frac_differ": d.float().mean().item()}
            if d.any():
                idx = d.reshape(-1).nonzero()[:4, 0]
                ev, cv = e.reshape(-1)[idx], c.reshape(-1)[idx]
                row["examples"] = [{"eager": float(a), "compiled": float(b)} for a, b in zip(ev, cv)]
                if ref is not None:
                    r = ref(*inp).reshape(-1)[idx]
                    for ex, rv in zip(row["examples"], r):
                        ex["float64"] = float(rv)
                    row["eager_closer"] = float(((ev.double() - r).abs() <= (cv.double() - r).abs()).float().mean())
            out["steps"][name] = row
            print(name, json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
