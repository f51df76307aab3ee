"""Inputs for the FP8 attention recipe on which it has no rounding boundary nearby: shared by tests/test_attention.py
and benchmarks/diagnostics/attention_fp8.py."""

import math

import torch

UNIT_C = 1 / math.log2(math.e)  # a scale whose c = log2(e) * scale rounds to exactly 1.0


def robust_inputs(B: int, H: int, Hkv: int, S: int, D: int, dtype=torch.bfloat16, seed: int = 0, device="cpu"):
    """Inputs on which the recipe has no rounding boundary nearby, for scale UNIT_C (c == 1): every score is a
    multiple of 1/8 in [-4, 4] (q: 8 entries per row from +-1/4, +-1/2; k: entries from 0, +-1/2, +-1), so S and
    S - m are exact in any order; p = 2^(-j/8) puts 448 p at least 1.5% from an e4m3 rounding boundary (the midpoints
    between 240 and 448 nearest to 448 x 2^(-j/8), j = 0..7, are 248, 272, 304, 336, 368, 400: no ulp of exp2 moves
    e4(448 p)); v: integers in [-4, 4], so each tile's P8 V8 is exact. What is left is float32 rounding in l's sum,
    in O x alpha (alpha = 2^(-j/8)) and the accumulation order: the outputs differ only where O / (448 l) lies within
    a few float32 ulps of a bf16 rounding boundary. The running max still changes between key tiles (the largest
    possible score is rare), so the tile order, the 448, P's rounding and the GQA mapping all matter."""
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.zeros(B, S, H, D, device=device)
    idx = torch.rand(B, S, H, D, generator=g, device=device).argsort(-1)[..., :8]
    vals = torch.tensor([-0.5, -0.25, 0.25, 0.5], device=device)
    q.scatter_(-1, idx, vals[torch.randint(0, 4, idx.shape, generator=g, device=device)])
    kv = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0], device=device)
    k = kv[torch.randint(0, 5, (B, S, Hkv, D), generator=g, device=device)]
    v = torch.randint(-4, 5, (B, S, Hkv, D), generator=g, device=device).float()
    return tuple(t.to(dtype).transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D)
