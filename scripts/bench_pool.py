#!/usr/bin/env python3
"""Time v1's weight pool: the single stream (v1.weight_pool) against poc.protocol.pool's threads.

    .venv/bin/python scripts/bench_pool.py [--size 50000000] [--workers 1,2] [--device cpu] [--repeat 3]

Prints one JSON line per variant (best of --repeat, seconds) and checks every result against the single stream.
--device cuda also times random_init.pool_tensor there (the path build_v1_model takes; build_timing['pool']).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from poc.model.random_init import pool_tensor
from poc.protocol import pool, v1


def best(fn, repeat: int) -> tuple[float, object]:
    out, times = None, []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return min(times), out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=50_000_000)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--block-hash", default="bench")
    a = ap.parse_args()
    t, ref = best(lambda: v1.weight_pool(a.block_hash, a.size), a.repeat)
    print(json.dumps({"variant": "single_stream", "size": a.size, "s": round(t, 3)}), flush=True)
    for w in (int(x) for x in a.workers.split(",")):
        pool.pool_stats.clear()
        t, got = best(lambda: pool.weight_pool_parallel(a.block_hash, a.size, w), a.repeat)
        assert np.array_equal(got, ref), f"workers={w}: not the single stream"
        print(json.dumps({"variant": "threads", "workers": w, "size": a.size, "s": round(t, 3),
                          "stats": dict(pool.pool_stats)}), flush=True)
        if a.device != "cpu":
            dev = torch.device(a.device)

            def on_device():
                x = pool_tensor(a.block_hash, a.size, dev, workers=w)
                torch.cuda.synchronize(dev)
                return x
            t, x = best(on_device, a.repeat)
            assert torch.equal(x.cpu(), torch.from_numpy(ref)), f"pool_tensor workers={w}: not the single stream"
            print(json.dumps({"variant": "pool_tensor", "device": a.device, "workers": w, "size": a.size,
                              "s": round(t, 3)}), flush=True)


if __name__ == "__main__":
    main()
