"""The MoE router's top-k on CUDA, in Triton (`model/route.py` calls it; it holds the rule and the torch path).

Each token's k largest router probabilities and their experts, one program per block of tokens, k rounds of
(largest key, lowest index holding it). The selection is torch.topk's on CUDA, bit for bit: values ordered as torch
orders float bits (NaN above everything, -0 below +0), ties at the k-th value broken towards the lower expert index
(its gather keeps the first ones it sees). Returned sorted by value, ties by index. It replaces torch's radix-select
top-k and the bitonic sort of its k results (0.54 ms a layer at 64k tokens x 128 experts on the H100) with one launch
that reads the probabilities once (about 35 us).

Importing this module needs Triton; `route` imports it only for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOPK_ROWS = 32  # tokens per program


@triton.jit
def _topk_kernel(p_ptr, v_ptr, i_ptr, T, E: tl.constexpr, BE: tl.constexpr, K: tl.constexpr, BT: tl.constexpr):
    r = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.arange(0, BE)
    m = (r < T)[:, None] & (c < E)[None, :]
    row = p_ptr + r.to(tl.int64) * E
    v = tl.load(row[:, None] + c[None, :], mask=m, other=0.0)
    b = v.to(tl.int32, bitcast=True)
    # torch's order of float bits (TopKTypeConfig<float>: a non-negative value gets its sign bit set, a negative one
    # all its bits flipped, NaN is the largest) less 2**31, as int32: a non-negative value's bits as they are, a
    # negative one's with the 31 low bits flipped, NaN INT32_MAX. Masked-out columns and taken entries are INT32_MIN,
    # below every real value (-inf is -2**31 + 2**23 - 1)
    lowest = tl.full([BT, BE], -2147483648, tl.int32)
    key = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
    key = tl.where(v != v, 0x7FFFFFFF, key)
    key = tl.where(m, key, lowest)
    for j in tl.static_range(K):
        best = tl.max(key, axis=1)
        idx = tl.min(tl.where(key == best[:, None], c[None, :], BE), axis=1)  # the lowest index among equal keys
        out = r.to(tl.int64) * K + j
        tl.store(v_ptr + out, tl.load(row + idx, mask=r < T), mask=r < T)
        tl.store(i_ptr + out, idx.to(tl.int64), mask=r < T)
        key = tl.where(c[None, :] == idx[:, None], lowest, key)


def topk(probs: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(values (T, k) float32, indices (T, k) int64) of the k largest in each row of probs (T, E) float32, as
    torch.topk(probs, k) selects them on CUDA; sorted by value, ties by index."""
    T, E = probs.shape
    if probs.dtype != torch.float32 or not 1 <= k <= E:
        raise ValueError(f"topk: float32 (T, E) with 1 <= k <= E, got {probs.dtype} k={k} E={E}")
    probs = probs.contiguous()
    vals = torch.empty((T, k), dtype=torch.float32, device=probs.device)
    idx = torch.empty((T, k), dtype=torch.int64, device=probs.device)
    if T:
        _topk_kernel[(triton.cdiv(T, TOPK_ROWS),)](probs, vals, idx, T, E=E, BE=triton.next_power_of_2(E), K=k,
                                                   BT=TOPK_ROWS, num_warps=4)
    return vals, idx
