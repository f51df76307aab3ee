"""The fused norm + quantiser kernel (fp8_triton.rmsnorm_quant) in Triton's interpreter, on a CPU, against the
unfused ops it replaces in eager torch: the residual add, the model's RMSNorm, then the quantiser (quantize_act's
torch form, the spec's formula).

    pip install triton   # into an environment with this repo's requirements; no GPU needed
    python benchmarks/diagnostics/triton_interpret.py [--out benchmarks/cpu/triton_interpret.json] [--sm90]

It checks the kernel before a GPU sees it: masks, the residual and keep variants, every tile config, widths that
are not a power of two, bf16 and fp16, r, y, q and s bit for bit. The interpreter's own float32 -> bf16 cast
truncates and its float32 -> float8 cast rounds half up, where the GPU rounds both to nearest even; those two casts
are replaced here by torch's (round to nearest even), as the GPU computes them. The interpreter has no libdevice:
the kernel's rsqrt runs as tl.math.rsqrt (numpy's 1/sqrt, as torch's CPU rsqrt). The bits on the GPU are
tests/test_w8a8.py's CUDA tests.

--sm90: instead build the kernel for sm_90 (no GPU needed) in every config the autotuner keeps, at the model widths
2048, 4096 and 5120, and count the register spills (local loads/stores in its SASS, from the wheel's cuobjdump).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import types
from pathlib import Path

if "--sm90" not in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported (a build for sm_90 needs the compiler)

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402


from poc.model import fp8  # noqa: E402
from poc.model.kernels import fp8_triton  # noqa: E402
from poc.model.transformer import RMSNorm  # noqa: E402


@triton.jit
def _rsqrt(x):
    return tl.math.rsqrt(x)


def round_as_the_gpu() -> None:
    """The interpreter's float32 -> bf16 and float32 -> float8_e4m3fn casts replaced by torch's (nearest even)."""
    import numpy as np
    from triton.runtime import interpreter as interp

    cast, to_fp = interp.InterpreterBuilder.cast_impl, interp.InterpreterBuilder.create_fp_to_fp

    def by_torch(src, dst_type, dtype, view):
        t = torch.from_numpy(np.ascontiguousarray(src.data, dtype=np.float32)).to(dtype).view(view)
        return interp.TensorHandle(t.numpy(), dst_type.scalar)

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return by_torch(src, dst_type, torch.bfloat16, torch.int16)
        return cast(self, src, dst_type)

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.float8e4nv:
            return by_torch(src, dst_type, torch.float8_e4m3fn, torch.uint8)
        return to_fp(self, src, dst_type, rounding_mode)

    interp.InterpreterBuilder.cast_impl = cast_impl
    interp.InterpreterBuilder.create_fp_to_fp = create_fp_to_fp


def case(dtype: torch.dtype, D: int, M: int, seed: int, ue8m0: bool) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    norm = RMSNorm(D, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_((torch.randn(D, generator=g) * 0.5 + 1).to(dtype))
    x = (torch.randn(M, D, generator=g) * 3).to(dtype)
    res = (torch.randn(M, D, generator=g) * 10).to(dtype)
    x[0] = 0  # a zero row (without the residual)
    x[1, 5] = 300  # an outlier
    x[2] = 1  # (without the residual) normalises to the weight itself: FP8 rounding ties are likely
    out = []
    variants = ((None, False), (res, True), (res, False), (None, True))
    for residual, keep in variants:
        for cfg in fp8_triton.NORM_CONFIGS:
            r, y, q, s = fp8_triton.rmsnorm_quant(x, residual, norm.weight, norm.eps, keep, ld_align=4, config=cfg,
                                                  ue8m0=ue8m0)
            rr = x if residual is None else residual + x
            yy = norm(rr)
            wq, ws = fp8.quantize_act_torch(yy, ue8m0)
            checks = {
                "q": torch.equal(q.view(torch.uint8), wq.view(torch.uint8)),
                "s": torch.equal(s[:, :M].t(), ws),
                "r": torch.equal(r, rr) if residual is not None else r.numel() == 0,
                "y": torch.equal(y, yy) if keep else y.numel() == 0,
            }
            out.append({"dtype": str(dtype).removeprefix("torch."), "D": D, "M": M, "residual": residual is not None,
                        "keep": keep, "scales": "ue8m0" if ue8m0 else "float32",
                        "config": {"ROWS": cfg.kwargs["ROWS"], "num_warps": cfg.num_warps}, **checks,
                        "equal": all(checks.values())})
    return out


def quantiser_cases() -> list[dict]:
    """fp8_triton.quantize (fp8_act_quant) on adversarial rows against the torch formula, both scale formats: zero
    and tiny groups, amaxes on and one ulp beside 448 x 2^-5, FP8 ties, a partial last group, float32 and bf16."""
    g = torch.Generator().manual_seed(5)
    base = torch.tensor(448.0 * 2.0 ** -5)
    rows = [torch.zeros(300), torch.full((300,), 1e-30)]
    for amax in (base, torch.nextafter(base, base * 2), torch.nextafter(base, base * 0), torch.tensor(448.0)):
        r = torch.randn(300, generator=g) * float(amax) / 4
        r[3], r[200] = amax, -amax
        rows.append(r)
    rows.append(torch.arange(300) * 0.75 - 100)  # halves and quarters: ties under a scale of 1 or 2
    x = torch.stack(rows)
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for ue8m0 in (False, True):
            xd = x.to(dtype)
            q, s = fp8_triton.quantize(xd, 300, ld_align=4, ue8m0=ue8m0)
            wq, ws = fp8.quantize_act_torch(xd, ue8m0)
            checks = {"q": torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), "s": torch.equal(s, ws)}
            out.append({"dtype": str(dtype).removeprefix("torch."), "D": 300, "M": x.shape[0], "residual": False,
                        "keep": False, "scales": "ue8m0" if ue8m0 else "float32", "config": "quantize", **checks,
                        "equal": all(checks.values())})
    return out


def sm90_builds() -> list[dict]:
    """The kernel built for sm_90 in each config the autotuner keeps: register spills (SASS LDL/STL) per width."""
    import re
    import subprocess
    import tempfile

    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cuobjdump = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    fn = fp8_triton.fp8_rmsnorm_quant.fn
    sig = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", r_ptr="*bf16", y_ptr="*bf16", q_ptr="*fp8e4nv",
               s_ptr="*fp32", M="i32", eps="fp32", stride_sg="i32")
    out = []
    for D in (2048, 4096, 5120):
        block = triton.next_power_of_2(D)
        for cfg in fp8_triton.norm_configs_that_fit(fp8_triton.NORM_CONFIGS, {}, BLOCK_D=block):
            const = dict(D=D, RES=True, KEEP=True, ROWS=cfg.kwargs["ROWS"], BLOCK_D=block, BLOCK=fp8_triton.GROUP)
            k = triton.compile(ASTSource(fn, {**sig, **{c: "constexpr" for c in const}}, const),
                               target=GPUTarget("cuda", 90, 32),
                               options={"num_warps": cfg.num_warps, "enable_fp_fusion": False})
            with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
                f.write(k.asm["cubin"])
                f.flush()
                sass = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True,
                                      check=True).stdout
            spills = len(re.findall(r"\b(?:LDL|STL)\b", sass))
            out.append({"D": D, "config": {"ROWS": cfg.kwargs["ROWS"], "num_warps": cfg.num_warps},
                        "spill_instructions": spills})
            print(f"sm_90 D {D} {out[-1]['config']}: {spills} spill instructions")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--sm90", action="store_true", help="instead, build the kernel for sm_90 and count spills")
    args = ap.parse_args()
    if args.sm90:
        builds = sm90_builds()
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv),
                                                  "triton": triton.__version__, "builds": builds}, indent=1) + "\n")
        return 1 if any(b["spill_instructions"] for b in builds) else 0
    fp8_triton.libdevice = types.SimpleNamespace(rsqrt=_rsqrt)  # the interpreter has no libdevice
    round_as_the_gpu()
    rows = []
    for ue8m0 in (False, True):
        for dtype in (torch.bfloat16, torch.float16):
            for i, (D, M) in enumerate(((256, 5), (384, 3), (640, 3), (2048, 4))):
                rows += case(dtype, D, M, seed=i, ue8m0=ue8m0)
    rows += quantiser_cases()
    bad = [r for r in rows if not r["equal"]]
    for r in rows:
        print(f"{r['scales']:7} {r['dtype']:8} D {r['D']:5d} M {r['M']} residual {r['residual']!s:5} "
              f"keep {r['keep']!s:5} {r['config']}: "
              f"{'equal' if r['equal'] else 'DIFFERENT ' + str({k: r.get(k) for k in 'qsry'})}")
    print(f"{len(rows) - len(bad)} of {len(rows)} cases equal")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "command": "python " + " ".join(sys.argv), "triton": triton.__version__, "torch": torch.__version__,
            "cases": rows, "all_equal": not bad}, indent=1) + "\n")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
