"""`python -m poc.bench` with a kernel variant set first, in the same process: the A/B of a kernel change on a whole
forward, on one card in one call (the variant's bits are the served kernels' own: see attention_fp8.py and
minimax_experts.py, which check them).

    PYTHONPATH=src:. python benchmarks/diagnostics/variant_bench.py --attn 128x8x3 --fold 0 -- \\
        --workload W8L8 --compile --out W8L8_before.json

--attn BLOCK_M x num_warps x num_stages of the FP8 attention kernel (attn_fp8_triton.CONFIG), or `best:FILE`: the
fastest config in an attention_fp8.py JSON whose bits equal CONFIG's, at its largest batch; --fold 0/1: the Gluon
expert kernels' one-FMA promotion for power-of-two activation scales (fp8_gluon.FOLD_POW2). The JSON poc.bench
writes gets a `variant` key with what was set.
"""

from __future__ import annotations

import argparse
import json
import sys


def best_attention(path: str) -> dict:
    timings = [r for r in json.load(open(path))["timings"]
               if r.get("what") == "fp8 kernel" and r.get("same_bits_as_CONFIG") and "ms" in r]
    big = max(r["B"] for r in timings)
    return min((r for r in timings if r["B"] == big), key=lambda r: r["ms"])["config"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, bench = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attn", default=None)
    ap.add_argument("--fold", type=int, choices=[0, 1], default=None)
    a = ap.parse_args(ours)
    from poc import bench as poc_bench
    from poc.model.kernels import attn_fp8_triton, fp8_gluon

    variant = {}
    if a.attn:
        if a.attn.startswith("best:"):
            cfg = best_attention(a.attn[5:])
        else:
            m, w, s = (int(x) for x in a.attn.split("x"))
            cfg = {"BLOCK_M": m, "num_warps": w, "num_stages": s}
        attn_fp8_triton.CONFIG.update(cfg)
        variant["attention"] = dict(attn_fp8_triton.CONFIG)
    if a.fold is not None:
        fp8_gluon.FOLD_POW2 = bool(a.fold)
        variant["fold_pow2"] = fp8_gluon.FOLD_POW2
    print(f"variant: {variant}", flush=True)
    rc = poc_bench.main(bench)
    out = bench[bench.index("--out") + 1] if "--out" in bench else None
    if out:
        d = json.load(open(out))
        d["variant"] = variant
        d["command"] = "python benchmarks/diagnostics/variant_bench.py " + " ".join(argv)
        json.dump(d, open(out, "w"), indent=1)
    return rc or 0


if __name__ == "__main__":
    sys.exit(main())
