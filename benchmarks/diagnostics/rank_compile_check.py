"""The rank processes compile (torch.compile of the decoder layer with its NCCL all-reduces inside): v1 distances of
tp=2 compiled against one GPU eager, fp16 (bound |delta| <= 1e-4, as for the single-device compiled path).

    python benchmarks/diagnostics/rank_compile_check.py [--out benchmarks/h200x4/rank_compile_check.json]

Needs two GPUs.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


from poc.bench import BH, PK  # noqa: E402
from poc.engine.engine import Engine  # noqa: E402
from poc.engine.dist import DistEngine  # noqa: E402
from poc.protocol import v1  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/h200x4/rank_compile_check.json")
    args = ap.parse_args()
    p, nonces = v1.PARAMS_V1, list(range(128))
    e = Engine("cuda", compile="off")
    ref = e.v1_distances(p, BH, PK, nonces, "float16", batch_size=64)
    e.close()
    out = {}
    for mode in ("off", "auto"):
        d = DistEngine("cuda", tp=2, world=2, compile=mode)
        d.load()
        t0 = time.perf_counter()
        got = d.v1_distances(p, BH, PK, nonces, "float16", batch_size=64)
        out[f"tp2_compile_{mode}_vs_one_gpu_eager_max_abs_ddist"] = float(np.abs(got - ref).max())
        out[f"tp2_compile_{mode}_seconds"] = time.perf_counter() - t0
        d.close()
    print(json.dumps(out), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
