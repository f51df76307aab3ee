"""The Triton code inductor writes for the elementwise pieces that still round differently from eager.

    python benchmarks/diag_codegen.py [--out benchmarks/h100/diag_codegen.txt]

Prints, per piece, the lines of the generated kernel that do the arithmetic (exp, division, sigmoid, rsqrt, fma)
and whether the compiled output equals eager's bit for bit, plus the installed inductor's lines that decide FMA
contraction, division and sigmoid lowering.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from poc.engine.compute import eager_numerics, maybe_compile  # noqa: E402
from poc.model.transformer import RMSNorm, _mul, apply_rope  # noqa: E402

ARITH = re.compile(r"fma|div|exp|sigmoid|rsqrt|sqrt|libdevice|tl_math|math\.|inline_asm")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/h100/diag_codegen.txt")
    args = ap.parse_args()
    from torch._inductor.utils import run_and_get_code

    lines = [f"torch {torch.__version__} knobs {eager_numerics()}"]
    import torch._inductor.codegen.triton as tc
    src = inspect.getsource(tc)
    lines += ["inductor triton.py: " + ln.strip() for ln in src.splitlines()
              if re.search(r"enable_fp_fusion|def sigmoid|tl.sigmoid|div_rn|division_rounding", ln)]
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(1)
    a = (torch.randn(4096, 3072, device=dev, generator=g) * 2).to(dt)
    b = torch.randn(4096, 3072, device=dev, generator=g).to(dt)
    q = torch.randn(8, 16, 256, 128, device=dev, generator=g).to(dt)
    ang = torch.rand(256, 128, device=dev, generator=g) * 100
    norm = RMSNorm(1024, 1e-6).to(dev, dt)
    x = torch.randn(4096, 1024, device=dev, generator=g).to(dt)
    pieces = {
        "silu F.silu": (lambda u, v: _mul(F.silu(u.float()).to(u.dtype), v), (a, b)),
        "silu explicit": (lambda u, v: _mul((u.float() / (1 + torch.exp(-u.float()))).to(u.dtype), v), (a, b)),
        "sigmoid": (lambda u: torch.sigmoid(u.float()), (a,)),
        "rope": (lambda u: apply_rope(u, ang.cos(), ang.sin()), (q,)),
        "rmsnorm": (lambda u: norm(u), (x,)),
        "x*c + y*s fp32": (lambda u, v: u.float() * 0.3 + v.float() * 0.7, (a, b)),
    }
    with torch.inference_mode():
        for name, (fn, inp) in pieces.items():
            e = fn(*inp)
            torch._dynamo.reset()
            c, code = run_and_get_code(maybe_compile(fn, True), *inp)
            same = torch.equal(e, c)
            frac = (e != c).float().mean().item()
            lines.append(f"== {name}: bit-identical={same} frac_differ={frac:.4f}")
            for src_code in code:
                lines += ["   " + ln.strip() for ln in src_code.splitlines() if ARITH.search(ln) and "import" not in ln
                          and "def " not in ln][:40]
    text = "\n".join(lines)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
