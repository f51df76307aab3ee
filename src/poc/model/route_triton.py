"""The MoE block's routing on CUDA, in Triton (`model/route.py` calls them; it holds the rules and the torch path).

- `topk`: each token's k largest router probabilities and their experts, one program per block of tokens, k rounds
  of (largest key, lowest index holding it). The selection is torch.topk's on CUDA, bit for bit: values ordered as
  torch orders float bits (NaN above everything, -0 below +0), ties at the k-th value broken towards the lower
  expert index (its gather keeps the first ones it sees). Returned sorted by value, ties by index. Replaces torch's radix-select top-k plus its bitonic sort
  (0.54 ms a layer at 64k tokens on the H100, benchmarks/h100/W6Q_profile.json) with one launch that reads the
  probabilities once.
- `slot_layout`: the padded expert layout of `fp8.padded_layout` computed straight from the routed experts, in three
  launches (per-block expert counts; one scan per expert over the blocks; the placement, each slot ranked among
  its block's slots of the same expert), with no sort and no host sync: each (token, choice) slot's row, the row
  tiles' experts and the rows' tokens. The rows of an expert keep the slots' order (a stable counting sort), so it
  is the layout the sort-based path builds, bit for bit.

Importing this module needs Triton; `route` imports it only for CUDA tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TOPK_ROWS = 32  # tokens per topk program
LAYOUT_SLOTS = 128  # (token, choice) slots per layout block
SCAN_CHUNK = 1024  # blocks per step of the layout scan (one program per expert)


# ---------------------------------------------------------------------------------------------------------------
# top-k


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


# ---------------------------------------------------------------------------------------------------------------
# the padded expert layout


@triton.jit
def _count_kernel(e_ptr, cnt_ptr, N, nb, E: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr):
    """cnt[e, b]: how many of block b's slots go to expert e."""
    b = tl.program_id(0)
    s = b * BS + tl.arange(0, BS)
    e = tl.load(e_ptr + s, mask=s < N, other=-1)
    c = tl.arange(0, BE)
    hit = (e[:, None] == c[None, :]) & (c < E)[None, :]
    tl.store(cnt_ptr + c * nb + b, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _scan_kernel(cnt_ptr, tot_ptr, nb, CB: tl.constexpr):
    """One program per expert e: cnt[e, b] becomes expert e's slots in the blocks before b; tot[e] its total."""
    e = tl.program_id(0)
    row = cnt_ptr + e.to(tl.int64) * nb
    carry = tl.zeros([], tl.int32)
    for b0 in range(0, nb, CB):
        rb = b0 + tl.arange(0, CB)
        x = tl.load(row + rb, mask=rb < nb, other=0)
        tl.store(row + rb, tl.cumsum(x, axis=0) - x + carry, mask=rb < nb)
        carry += tl.sum(x, axis=0)
    tl.store(tot_ptr + e, carry)


@triton.jit
def _place_kernel(e_ptr, cnt_ptr, tot_ptr, slot_ptr, row_ptr, te_ptr, N, nb, n_rows, n_tiles, K: tl.constexpr,
                  E: tl.constexpr, BE: tl.constexpr, BS: tl.constexpr, GR: tl.constexpr, TPB: tl.constexpr):
    """Block b's slots: each slot's row = its expert's padded start + the expert's slots in earlier blocks + those
    before it in this block (slot order); row_ptr[row] = the slot's token; a slot of no expert here gets n_rows.
    Also this program's TPB row tiles of te (each tile's expert: the groups that end at or before its start)."""
    b = tl.program_id(0)
    c = tl.arange(0, BE)
    padded = (tl.load(tot_ptr + c, mask=c < E, other=0) + GR - 1) // GR * GR
    pend = tl.cumsum(padded, axis=0)
    rt = b * TPB + tl.arange(0, TPB)
    done = (pend[None, :] <= rt[:, None] * GR) & (c < E)[None, :]
    tl.store(te_ptr + rt, tl.sum(done.to(tl.int32), axis=1), mask=rt < n_tiles)
    s = b * BS + tl.arange(0, BS)
    e = tl.load(e_ptr + s, mask=s < N, other=-1)
    ok = (s < N) & (e >= 0) & (e < E)
    e = tl.where(ok, e, -1).to(tl.int32)
    j = tl.arange(0, BS)
    rank = tl.sum(((e[None, :] == e[:, None]) & (j[None, :] < j[:, None])).to(tl.int32), axis=1)
    start = tl.sum(tl.where(e[:, None] == c[None, :], (pend - padded)[None, :], 0), axis=1)
    prior = tl.load(cnt_ptr + e.to(tl.int64) * nb + b, mask=ok, other=0)
    row = start + prior + rank
    tl.store(slot_ptr + s, tl.where(ok, row, n_rows).to(tl.int64), mask=s < N)
    tl.store(row_ptr + row, (s // K).to(tl.int32), mask=ok)


def slot_layout(key: torch.Tensor, n_experts: int, k: int, group_rows: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                        torch.Tensor]:
    """key (T*k,) int64: each (token, choice) slot's expert (outside 0..n_experts-1: not here). Returns (slot (T*k,)
    int64: the slot's row in the padded layout, n_rows for a slot not here; tile_expert (n_rows / group_rows,) int32;
    a_rows (n_rows,) int32: each row's token, -1 for padding), n_rows = ceil(T*k / group_rows) * group_rows +
    n_experts * group_rows."""
    N = key.numel()
    dev = key.device
    n_rows = triton.cdiv(N, group_rows) * group_rows + n_experts * group_rows
    n_tiles = n_rows // group_rows
    BE = max(16, triton.next_power_of_2(n_experts))
    nb = max(1, triton.cdiv(N, LAYOUT_SLOTS))
    key = key.contiguous()
    cnt = torch.empty((BE, nb), dtype=torch.int32, device=dev)
    tot = torch.empty((BE,), dtype=torch.int32, device=dev)
    tile_expert = torch.empty((n_tiles,), dtype=torch.int32, device=dev)
    slot = torch.empty((N,), dtype=torch.int64, device=dev)
    a_rows = torch.full((n_rows,), -1, dtype=torch.int32, device=dev)
    meta = dict(E=n_experts, BE=BE, BS=LAYOUT_SLOTS)
    _count_kernel[(nb,)](key, cnt, N, nb, num_warps=4, **meta)
    _scan_kernel[(BE,)](cnt, tot, nb, CB=SCAN_CHUNK, num_warps=4)
    _place_kernel[(nb,)](key, cnt, tot, slot, a_rows, tile_expert, N, nb, n_rows, n_tiles, K=k, GR=group_rows,
                         TPB=triton.next_power_of_2(triton.cdiv(n_tiles, nb)), num_warps=4, **meta)
    return slot, tile_expert, a_rows
