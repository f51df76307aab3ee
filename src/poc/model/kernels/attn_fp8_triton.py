"""The fp8 attention recipe's CUDA kernel, in Triton (`model/attention.py` calls it on Hopper; it holds the recipe and
the CPU path, `fp8_attention_torch`).

`attention(q, k, v, scale)`: causal attention, or the last position alone, with every operand of both GEMMs in
float8_e4m3fn. K and V are rounded to e4m3 once per call (clamped to +-448, nearest even: `_round_kv`), K as (B, Hkv, S,
D) and V transposed as (B, Hkv, D, S): the K-major layouts FP8 wgmma takes for both GEMMs' B operand, so the main loop
streams FP8 tiles from memory into shared memory (Triton's pipeliner: the next tiles' loads in flight while this one
computes) and on to the tensor cores with no conversion. Then one program per (query tile of BLOCK_M rows (CONFIG: 64),
query head, batch) loads its query tile in the model dtype (any strides: the projections' (B, S, H*D) rows seen as (B,
H, S, D) views), rounds it to e4m3 in registers, and walks the key tiles of 128 from the diagonal tile (causal mask)
back to tile 0: S = Q8 K8^T on the FP8 tensor cores (float32 accumulation), the running row max m of S, alpha =
exp2((m_old - m_new) c) applied to l and O, p = exp2(S c - m c), l += rowsum(p) of the unquantised p, O += e4(448 p) V8;
the output O / (448 l) (IEEE division) rounded to the model dtype. The last-position pass (Sq == 1) puts the query heads
of one kv head in the rows of one tile (position S - 1 in every row) and walks that row's key tiles in the same order:
each row does the full pass's arithmetic.

Triton rounds the float32 -> e4m3 conversions to nearest even with saturation (cvt.rn.satfinite on sm_90). Contraction
to FMA is off (`S c - m c` is two products and a difference, as the emulation computes it). The differences left: the
MMAs' accumulation (FP8 wgmma is reported to keep 13 mantissa bits of the accumulator it adds to; Triton's default on
sm_90, as FA3, adds PV into O on the tensor cores), exp2's ulps (ex2.approx.ftz), the order of the row sum.

Importing this module needs Triton (present with CUDA builds of torch); `attention` imports it only for CUDA tensors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

TILE = 128  # keys per tile: the recipe's, fixed
# sm_90: BLOCK_M query rows a program (64: one warpgroup; 128: two), the FP8 K/V tiles double-buffered (16 KiB a K
# and V tile pair). A query row's arithmetic does not depend on BLOCK_M (the key tiles, their order and each row's
# reductions are the same), so every config computes the same bits. Measured on an H200 at 64 x 48 heads x 1024
# (benchmarks/h200/attention_fp8.json): 64 x 4 warps x 2 stages 2.74 ms, 128 x 8 x 3 2.96, 64 x 4 x 3 4.18
CONFIG = {"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}
FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn


@triton.jit
def _e4(x):
    """A tile in the model dtype -> float8e4nv: float32, clamped to +-448, rounded to nearest even."""
    return tl.clamp(x.to(tl.float32), -448.0, 448.0).to(tl.float8e4nv)


@triton.jit
def _step(s, v8, m, l, acc, c):
    """One key tile of the online softmax: s (M, N) float32 scores (masked ones -inf), v8 V's tile in e4m3."""
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.math.exp2((m - m_new) * c)
    p = tl.math.exp2(s * c - (m_new * c)[:, None])
    l = l * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot((p * 448.0).to(tl.float8e4nv), v8, acc)
    return m_new, l, acc


@triton.jit
def round_kv(x_ptr, y_ptr, S, sxb, sxh, sxs, sxd, syb, syh, sy0, sy1, HKV: tl.constexpr, D: tl.constexpr,
             BLOCK: tl.constexpr, TRANS: tl.constexpr):
    """BLOCK positions of one (batch, kv head) of x (B, Hkv, S, D) (model dtype, any strides) rounded to e4m3 into
    y: (B, Hkv, S, D) with strides (syb, syh, sy0, sy1), or with TRANS the transposed (B, Hkv, D, S) (the tile
    transposed in registers, so that both the load and the store run along contiguous memory)."""
    pid, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // HKV).to(tl.int64), (bh % HKV).to(tl.int64)
    s = (pid * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    d = tl.arange(0, D).to(tl.int64)
    x8 = _e4(tl.load(x_ptr + b * sxb + h * sxh + s[:, None] * sxs + d[None, :] * sxd, mask=(s < S)[:, None],
                     other=0.0))
    if TRANS:
        tl.store(y_ptr + b * syb + h * syh + d[:, None] * sy0 + s[None, :] * sy1, tl.trans(x8),
                 mask=(s < S)[None, :])
    else:
        tl.store(y_ptr + b * syb + h * syh + s[:, None] * sy0 + d[None, :] * sy1, x8, mask=(s < S)[:, None])


@triton.jit
def attn_fp8_fwd(q_ptr, k_ptr, v_ptr, o_ptr, c, S, B, n_tiles,
                 sqb, sqh, sqs, sqd, skb, skh, sks, skd, svb, svh, svd, svs, sob, soh, sos, sod,
                 H: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 LAST: tl.constexpr):
    """One tile of BLOCK_M query rows (a divisor of BLOCK_N), k the e4m3 K (B, Hkv, S, D) and v the e4m3 V
    transposed (B, Hkv, D, S). Causal pass: one head, positions [i BLOCK_M, (i + 1) BLOCK_M) (n_tiles of them);
    programs ordered heaviest tile first, and within a (tile, batch) the query heads of one kv head next to each
    other (they read the same K/V tiles: L2 reuse). LAST: row r is query head kvh * REP + r at position S - 1 (q's
    only position)."""
    REP: tl.constexpr = H // HKV
    pid = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    if LAST:
        kvh = pid % HKV
        b = pid // HKV
        head = kvh * REP + rows
        valid = rows < REP
        qpos = tl.zeros([BLOCK_M], tl.int32) + (S - 1)
        q_off = head.to(tl.int64) * sqh
        o_off = head.to(tl.int64) * soh
        diag = (S - 1) // BLOCK_N
    else:
        t = pid // REP
        kvh = t % HKV
        t = t // HKV
        b = t % B
        i = n_tiles - 1 - t // B
        head = kvh * REP + pid % REP
        qpos = i * BLOCK_M + rows
        valid = qpos < S
        q_off = head.to(tl.int64) * sqh + qpos.to(tl.int64) * sqs
        o_off = head.to(tl.int64) * soh + qpos.to(tl.int64) * sos
        diag = (i * BLOCK_M) // BLOCK_N  # BLOCK_M divides BLOCK_N: the tile's rows share one diagonal key tile
    b64 = b.to(tl.int64)
    q = tl.load(q_ptr + b64 * sqb + q_off[:, None] + d[None, :] * sqd, mask=valid[:, None], other=0.0)
    q8 = _e4(q)
    kn = tl.arange(0, BLOCK_N)
    k_base = k_ptr + b64 * skb + kvh.to(tl.int64) * skh + d[None, :] * skd  # (BLOCK_N, D) tiles, D contiguous
    v_base = v_ptr + b64 * svb + kvh.to(tl.int64) * svh + d[:, None] * svd  # (D, BLOCK_N) tiles, keys contiguous

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # the diagonal tile: causal mask, and keys past S (a short last tile) masked
    kpos = diag * BLOCK_N + kn
    kin = kpos < S
    k8 = tl.load(k_base + kpos.to(tl.int64)[:, None] * sks, mask=kin[:, None], other=0.0)
    vt8 = tl.load(v_base + kpos.to(tl.int64)[None, :] * svs, mask=kin[None, :], other=0.0)
    s = tl.dot(q8, tl.trans(k8))
    s = tl.where((kpos[None, :] <= qpos[:, None]) & kin[None, :], s, float("-inf"))
    m, l, acc = _step(s, tl.trans(vt8), m, l, acc, c)
    # the tiles below it, nearest first: every key visible
    for jj in range(0, diag):
        kpos = (diag - 1 - jj) * BLOCK_N + kn
        k8 = tl.load(k_base + kpos.to(tl.int64)[:, None] * sks)
        vt8 = tl.load(v_base + kpos.to(tl.int64)[None, :] * svs)
        s = tl.dot(q8, tl.trans(k8))
        m, l, acc = _step(s, tl.trans(vt8), m, l, acc, c)
    out = tl.math.div_rn(acc, (448.0 * l)[:, None])
    tl.store(o_ptr + b64 * sob + o_off[:, None] + d[None, :] * sod, out.to(o_ptr.dtype.element_ty),
             mask=valid[:, None])


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, config: dict | None = None
              ) -> torch.Tensor:
    """q (B, H, Sq, D), k and v (B, Hkv, S, D), 16-bit (or float32 in Triton's interpreter), any strides; Sq == S
    (causal) or Sq == 1 (the last position). Returns (B, H, Sq, D) in q's dtype, a view of a (B, Sq, H, D) buffer
    (the layout o_proj reads). config: BLOCK_M / num_warps / num_stages instead of CONFIG (the benchmark's sweep;
    the same bits in every config)."""
    B, H, Sq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    if Sq not in (S, 1) or H % Hkv or D not in (32, 64, 128):
        raise ValueError(f"attn_fp8_triton: q {tuple(q.shape)}, k {tuple(k.shape)}: need Sq in (S, 1), whole GQA "
                         "groups and a head size of 32, 64 or 128")
    cfg = {**CONFIG, **(config or {})}
    block_m = cfg.pop("BLOCK_M")
    if TILE % block_m or block_m < 16:
        raise ValueError(f"attn_fp8_triton: BLOCK_M {block_m} must divide the key tile {TILE}")
    if H // Hkv > block_m:
        raise ValueError(f"attn_fp8_triton: {H // Hkv} query heads per kv head do not fit one tile of {block_m}")
    out = torch.empty(B, Sq, H, D, dtype=q.dtype, device=q.device).transpose(1, 2)  # (B, Sq, H, D) -> (B, H, Sq, D)
    if B == 0 or S == 0:
        return out
    c = float(torch.tensor(math.log2(math.e) * scale, dtype=torch.float32))  # attention.log2e_scale: one rounding
    last = Sq == 1 and S > 1
    n_tiles = triton.cdiv(S, block_m)
    k8 = torch.empty(B, Hkv, S, D, dtype=FP8, device=k.device)
    vt8 = torch.empty(B, Hkv, D, S, dtype=FP8, device=v.device)  # V transposed: keys contiguous
    for x, y, trans in ((k, k8, False), (v, vt8, True)):
        round_kv[(triton.cdiv(S, 64), B * Hkv)](x, y, S, *x.stride(), *y.stride(), HKV=Hkv, D=D, BLOCK=64,
                                                TRANS=trans, num_warps=4)
    grid = (B * Hkv,) if last else (B * H * n_tiles,)
    attn_fp8_fwd[grid](q, k8, vt8, out, c, S, B, n_tiles, *q.stride(), *k8.stride(), *vt8.stride(), *out.stride(),
                       H=H, HKV=Hkv, D=D, BLOCK_M=block_m, BLOCK_N=TILE, LAST=last, enable_fp_fusion=False, **cfg)
    return out
