"""The W8A8 recipe's CUDA kernels, in Triton (`model/fp8.py` and `model/experts.py` call them on CUDA; they hold the
recipe and the CPU path).

- `quantize`: the per-token-group activation quantiser, bit for bit the spec's formula in both scale formats
  (float32 `amax * (1/448)` with IEEE division: Triton's plain `/` on float32 is an approximation that can move a
  value across an FP8 rounding boundary; UE8M0, the smallest power of two >= amax / 448, from the quotient's bits,
  and an exact product with its reciprocal); every quantiser here takes the format as a constexpr `UE8M0`;
- `rmsnorm_quant`: the residual add, the model's RMSNorm and the quantiser in one pass over whole rows (the
  quantiser's code, so its bits), for `fp8.norm_quant`;
- `grouped_gemm`: the experts' block-scaled FP8 GEMM, every expert in one launch over the padded row layout of
  `experts.grouped_w8a8` (each expert's rows start on a multiple of `group_rows`, so a tile never spans two experts);
- `w13_swiglu_quant`: the first expert GEMM with SwiGLU and the re-quantisation in its epilogue: each tile computes
  128 gate and the matching 128 up columns, rounds both to the model dtype, takes SiLU(gate) * up as
  `experts.swiglu` rounds it, and quantises those 128 columns (one activation group) per row. The (rows, 2F)
  intermediate and the (rows, F) activation never reach memory; the output is the FP8 input of the second GEMM.

Importing this module needs Triton (present with CUDA builds of torch); `fp8` imports it only for CUDA tensors. It
imports nothing of `fp8` (the layout's parameters come with each call: `group_rows`, `ld_align`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import libdevice
except ImportError:  # older Triton
    from triton.language.extra import libdevice

GROUP = 128  # the checkpoints' weight block and the activation group: the kernels' K tile (fp8.GROUP, checked there)
FP8 = torch.float8_e4m3fn
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

# tile configurations, chosen by benchmarks/diagnostics/w8a8.py's sweep on the H100 (Qwen3-30B-A3B expert shapes,
# benchmarks/h100/w8a8_kernels.json): the grouped kernel serves w2 (K = 768), the fused one w13
GROUPED_CONFIG = {"BM": 64, "num_warps": 4, "num_stages": 3}
W13_CONFIG = {"BM": 128, "num_warps": 8, "num_stages": 3}
FP_FUSION = True  # a*b+c may contract to one FMA inside the accumulator update (the GEMMs only: accumulation
# order, which the spec leaves open); set explicitly so that the process's TRITON_DEFAULT_FP_FUSION (compile.py sets
# it for inductor's kernels) does not change these kernels' bits between processes


# ---------------------------------------------------------------------------------------------------------------
# the quantiser


@triton.jit
def _div_by_row(x, s, FAST: tl.constexpr):
    """x / s[:, None] rounded as IEEE division. FAST: one correctly rounded reciprocal per row, then per value the
    product and one FMA correction (Markstein: with y = RN(1/s) and q0 = RN(x y), the residual r = x - s q0 is exact
    and RN(q0 + r y) = RN(x / s); a zero x keeps its sign), which has no slow-path branch per value. Used where x holds bf16/fp16 values and
    s comes from a 16-bit amax (the quantisers' inputs, the SwiGLU output): tests/test_w8a8.py checks it against IEEE
    division on every such pair; float32 inputs keep div_rn."""
    if FAST:
        y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
        q0 = x * y[:, None]
        q = tl.math.fma(tl.math.fma(-q0, s[:, None], x), y[:, None], q0)
        return tl.where(x == 0.0, x, q)  # the correction of -0 gives +0: x / s keeps x's sign
    else:
        return tl.math.div_rn(x, s[:, None])


@triton.jit
def _pow2_scale(amax):
    """(s, 1/s) for UE8M0: s the smallest power of two >= amax / 448 (IEEE quotient; its exponent, plus one where
    its mantissa is not zero: fp8.pow2_ceil), 1/s exact. amax >= 1e-10, so both are normal float32 numbers."""
    bits = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)).to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True), ((254 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quant_groups(x, FAST: tl.constexpr, UE8M0: tl.constexpr):
    """(R, 128) float32, one activation group per row -> (q as float32 values on the FP8 grid, s (R,)): the spec's
    amax, then scale = amax * (1/448) and q = clamp(x / scale) with IEEE division (_div_by_row; FAST: x holds
    16-bit values), or with UE8M0 the power-of-two scale and q = x * (1/scale), exactly x / scale."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-10)
    if UE8M0:
        s, inv = _pow2_scale(amax)
        return tl.clamp(x * inv[:, None], -448.0, 448.0), s
    else:
        s = amax * (1.0 / 448.0)
        return tl.clamp(_div_by_row(x, s, FAST), -448.0, 448.0), s


@triton.jit
def fp8_act_quant(x_ptr, q_ptr, s_ptr, M, K, W, stride_xm, stride_qm, stride_sg, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr, UE8M0: tl.constexpr):
    """A tile of ROWS rows x one 128-column group: amax, the scale, q = clamp(x / scale) (_quant_groups)."""
    pid_m, g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    r64 = rows.to(tl.int64)[:, None]  # offsets past 2**31 elements at large batches
    x = tl.load(x_ptr + r64 * stride_xm + cols[None, :], mask=mask, other=0.0)
    q, s = _quant_groups(x.to(tl.float32), x.dtype != tl.float32, UE8M0)
    out = (rows[:, None] < M) & (cols[None, :] < W)  # columns K..W-1: zero (loaded as 0, quantised to 0)
    tl.store(q_ptr + r64 * stride_qm + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=out)
    tl.store(s_ptr + g * stride_sg + rows, s, mask=rows < M)  # (G, >=M) row-major: s.t() column-major


def quantize(x: torch.Tensor, width: int, *, ld_align: int, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (M, K) -> q (M, width) float8 (columns past K zero), s (M, ceil(width/128)) float32, column-major in a
    buffer whose row count is padded to ld_align (the block-scaled GEMM's alignment); ue8m0: power-of-two scales."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, K = x.shape
    G = triton.cdiv(width, GROUP)
    q = torch.empty((M, width), dtype=FP8, device=x.device)
    s = torch.empty((G, triton.cdiv(M, ld_align) * ld_align), dtype=torch.float32, device=x.device)
    rows = 32
    fp8_act_quant[(triton.cdiv(M, rows), G)](x, q, s, M, K, width, x.stride(0), q.stride(0), s.stride(0), ROWS=rows,
                                             BLOCK=GROUP, UE8M0=ue8m0, enable_fp_fusion=FP_FUSION)
    return q, s[:, :M].t()


NORM_CONFIGS = [triton.Config({"ROWS": r}, num_warps=w) for r, w in ((1, 4), (2, 8), (4, 8))]


def norm_configs_that_fit(configs, nargs, **kw):
    """The configs that hold at most 64 values of the tile per thread (sm_90 builds of more spill registers)."""
    block = kw.get("BLOCK_D") or nargs.get("BLOCK_D")
    fit = [c for c in configs if block is None or c.kwargs["ROWS"] * block <= 64 * 32 * c.num_warps]
    return fit or configs[:1]


# rows are independent: every config computes the same bits
@triton.autotune(configs=NORM_CONFIGS, key=["D", "RES", "KEEP", "UE8M0"],
                 prune_configs_by={"early_config_prune": norm_configs_that_fit})
@triton.jit
def fp8_rmsnorm_quant(x_ptr, res_ptr, w_ptr, r_ptr, y_ptr, q_ptr, s_ptr, M, eps, stride_sg, D: tl.constexpr,
                      RES: tl.constexpr, KEEP: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK: tl.constexpr, UE8M0: tl.constexpr):
    """ROWS whole rows: (with RES) r = res + x rounded to x's dtype and stored; y = RMSNorm(r) as
    transformer.RMSNorm rounds it (the squares summed exactly in float64, rounded to float32, IEEE division by D,
    + eps, rsqrt, the product rounded to the model dtype, times the weight rounded again), stored only with KEEP;
    then y quantised per BLOCK (128) columns as fp8_act_quant does (_quant_groups: the same bits)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    live = rows < M
    mask = live[:, None] & (cols[None, :] < D)
    off = rows.to(tl.int64)[:, None] * D + cols[None, :]
    x = tl.load(x_ptr + off, mask=mask, other=0.0)
    if RES:
        x = (tl.load(res_ptr + off, mask=mask, other=0.0).to(tl.float32) + x.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(r_ptr + off, x, mask=mask)
    xf = x.to(tl.float32)
    ss = tl.sum((xf * xf).to(tl.float64), axis=1).to(tl.float32)  # exact: squares of 16-bit values
    rstd = libdevice.rsqrt(tl.math.div_rn(ss, tl.full(ss.shape, D, tl.float32)) + eps)  # torch's rsqrt: rsqrtf
    y = (xf * rstd[:, None]).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0)
    y = (y.to(tl.float32) * w.to(tl.float32)[None, :]).to(x_ptr.dtype.element_ty)
    if KEEP:
        tl.store(y_ptr + off, y, mask=mask)
    q, s = _quant_groups(tl.reshape(y.to(tl.float32), (ROWS * (BLOCK_D // BLOCK), BLOCK)), True, UE8M0)
    tl.store(q_ptr + off, tl.reshape(q, (ROWS, BLOCK_D)).to(q_ptr.dtype.element_ty), mask=mask)
    g = tl.arange(0, BLOCK_D // BLOCK)
    tl.store(s_ptr + g[None, :] * stride_sg + rows[:, None], tl.reshape(s, (ROWS, BLOCK_D // BLOCK)),
             mask=live[:, None] & (g[None, :] * BLOCK < D))


def rmsnorm_quant(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, keep: bool, *,
                  ld_align: int, config: triton.Config | None = None, ue8m0: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x (M, D) 16-bit, D a multiple of 128 -> (r, y, q, s): r = residual + x (empty without a residual), y its
    RMSNorm (empty unless keep), q (M, D) float8 and s (D/128, M padded to ld_align) float32 row-major: y quantised
    as `quantize` quantises it in the same scale format (s[:, :M].t() is its column-major scale operand). The tile
    config is autotuned per (D, residual, keep, format); config: one of NORM_CONFIGS instead (the tests run each)."""
    M, D = x.shape
    if D % GROUP or x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rmsnorm_quant takes 16-bit rows of whole {GROUP}-column groups, got {x.dtype} {D}")
    x = x.contiguous()
    r = torch.empty_like(x) if residual is not None else x.new_empty(0)
    y = torch.empty_like(x) if keep else x.new_empty(0)
    q = torch.empty((M, D), dtype=FP8, device=x.device)
    s = torch.empty((D // GROUP, triton.cdiv(M, ld_align) * ld_align), dtype=torch.float32, device=x.device)
    if M:
        kern, meta = (fp8_rmsnorm_quant, {}) if config is None else (fp8_rmsnorm_quant.fn, config.all_kwargs())
        kern[lambda m: (triton.cdiv(M, m["ROWS"]), )](
            x, x if residual is None else residual.contiguous(), weight, r, y, q, s, M, eps, s.stride(0), D=D,
            RES=residual is not None, KEEP=keep, BLOCK_D=triton.next_power_of_2(D), BLOCK=GROUP, UE8M0=ue8m0,
            enable_fp_fusion=False, **meta)  # no sum of products to contract here
    return r, y, q, s


@triton.jit
def fp8_act_quant_scatter(x_ptr, q_ptr, s_ptr, dest_ptr, M, K, stride_xm, stride_qm, stride_sg, KSEL: tl.constexpr,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr, UE8M0: tl.constexpr):
    """fp8_act_quant's tile, stored to each of its rows' KSEL destination rows (dest (M, KSEL); -1: none)."""
    pid_m, g = tl.program_id(0), tl.program_id(1)
    rows = pid_m * ROWS + tl.arange(0, ROWS)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    live = rows < M
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :],
                mask=live[:, None] & (cols[None, :] < K), other=0.0)
    q, s = _quant_groups(x.to(tl.float32), x.dtype != tl.float32, UE8M0)
    q = q.to(q_ptr.dtype.element_ty)
    for j in tl.static_range(KSEL):
        d = tl.load(dest_ptr + rows * KSEL + j, mask=live, other=-1).to(tl.int64)
        ok = d >= 0
        tl.store(q_ptr + d[:, None] * stride_qm + cols[None, :], q, mask=ok[:, None])
        tl.store(s_ptr + g * stride_sg + d, s, mask=ok)


@triton.jit
def fp8_zero_rows(q_ptr, s_ptr, a_rows_ptr, M, stride_qm, stride_sg, G: tl.constexpr, ROWS: tl.constexpr,
                  BLOCK: tl.constexpr):
    """Zero the values and scales of the padding rows (a_rows -1) among ROWS rows."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    pad = tl.load(a_rows_ptr + rows, mask=rows < M, other=0) < 0
    if tl.max(pad.to(tl.int32)) > 0:
        cols = tl.arange(0, BLOCK)
        for g in tl.static_range(G):
            tl.store(q_ptr + rows.to(tl.int64)[:, None] * stride_qm + (g * BLOCK + cols)[None, :],
                     tl.zeros((ROWS, BLOCK), dtype=q_ptr.dtype.element_ty), mask=pad[:, None])
            tl.store(s_ptr + g * stride_sg + rows, tl.zeros((ROWS, ), dtype=tl.float32), mask=pad)


SCATTER_CONFIG = {"ROWS": 32, "num_warps": 4}


def quantize_scatter(x: torch.Tensor, dest: torch.Tensor, a_rows: torch.Tensor,
                     ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x (T, K) quantised per token per group, each token's row written to its routed rows of the padded layout:
    dest (T, k) int32 (-1: a slot routed elsewhere), a_rows (rows,) each padded row's token (-1: padding, written
    as zeros). Returns q (rows, K) float8 and s (K/128, rows) float32 (row-major), the layout the Hopper expert
    kernels read (fp8_gluon). The values are quantize's, bit for bit (one formula, _quant_groups)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    T, K = x.shape
    M, G = a_rows.numel(), triton.cdiv(K, GROUP)
    if K % GROUP:
        raise ValueError(f"quantize_scatter: K {K} is not a multiple of {GROUP}")
    q = torch.empty((M, K), dtype=FP8, device=x.device)
    s = torch.empty((G, M), dtype=torch.float32, device=x.device)
    rows, warps = SCATTER_CONFIG["ROWS"], SCATTER_CONFIG["num_warps"]
    if T:
        fp8_act_quant_scatter[(triton.cdiv(T, rows), G)](x, q, s, dest, T, K, x.stride(0), q.stride(0), s.stride(0),
                                                         KSEL=dest.shape[1], ROWS=rows, BLOCK=GROUP, UE8M0=ue8m0,
                                                         num_warps=warps, enable_fp_fusion=FP_FUSION)
    if M:
        fp8_zero_rows[(triton.cdiv(M, 64), )](q, s, a_rows, M, q.stride(0), s.stride(0), G=G, ROWS=64, BLOCK=GROUP)
    return q, s


# ---------------------------------------------------------------------------------------------------------------
# the experts' GEMMs


@triton.jit
def _tile_rows(tile_e_ptr, a_rows_ptr, pid_m, GATHER: tl.constexpr, TILES: tl.constexpr, BM: tl.constexpr):
    """The expert of row tile pid_m (E: past the last group), its output rows, and the A row each reads (the token,
    when the gather is in the loads) with the rows that read zeros (padding rows, a_rows -1)."""
    e = tl.load(tile_e_ptr + pid_m // TILES)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    if GATHER:
        src = tl.load(a_rows_ptr + rows).to(tl.int64)
    else:
        src = rows
    live = src >= 0
    return e, rows, tl.where(live, src, 0), live


@triton.jit
def fp8_grouped_gemm(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tile_e_ptr, a_rows_ptr, rw_ptr, K: tl.constexpr, E, s_am,
                     s_asm, s_asg, s_be, s_bn, s_bse, s_bsn, s_cm, GATHER: tl.constexpr, TILES: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, RW: tl.constexpr):
    """Tile (m, n) of the padded row layout times its expert's weight: each 128-deep K block's FP8 product scaled
    by the rows' and the block's scales, added to a float32 accumulator; written in c's dtype (RW: multiplied by
    each row's routing weight first, in float32). N tiles vary fastest, so the CTAs that run together share one
    block of rows and sweep the expert's weight from L2."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e, rows, src, live = _tile_rows(tile_e_ptr, a_rows_ptr, pid_m, GATHER, TILES, BM)
    if e < E:
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * s_am + ks[None, :]
        b_ptrs = b_ptr + e.to(tl.int64) * s_be + cols[None, :] * s_bn + ks[:, None]
        as_ptrs = as_ptr + src * s_asm
        bs_ptrs = bs_ptr + e.to(tl.int64) * s_bse + (pid_n * BN // BK) * s_bsn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K // BK):
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            b = tl.load(b_ptrs)
            sa = tl.load(as_ptrs + kb * s_asg, mask=live, other=0.0)
            acc += tl.dot(a, b) * sa[:, None] * tl.load(bs_ptrs + kb)
            a_ptrs += BK
            b_ptrs += BK
        if RW:
            acc = acc * tl.load(rw_ptr + rows)[:, None]
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def grouped_gemm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, tile_expert: torch.Tensor,
                 out_dtype: torch.dtype, a_rows: torch.Tensor | None = None, *, group_rows: int,
                 row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The padded layout's rows (tile_expert.numel() * group_rows of them, each expert's starting on a multiple of
    group_rows) times their experts' w (E, N, K) with block scales w_scale (E, N/128, K/128); row i reads q's row
    a_rows[i] (-1: a zero row), or the i-th. row_weight (rows,) float32: each output row multiplied by it in float32
    before the rounding (the routing weight, as vLLM's fused MoE applies it)."""
    K = q.shape[1]
    M = tile_expert.numel() * group_rows
    E, N, _ = w.shape
    w_scale = w_scale.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    bm, warps, stages = GROUPED_CONFIG["BM"], GROUPED_CONFIG["num_warps"], GROUPED_CONFIG["num_stages"]
    gather = a_rows is not None
    rw = row_weight is not None
    if rw and (row_weight.dtype != torch.float32 or row_weight.numel() != M or not row_weight.is_contiguous()):
        raise ValueError(f"fp8_triton: row_weight must be ({M},) contiguous float32")
    fp8_grouped_gemm[(N // GROUP, tile_expert.numel() * (group_rows // bm))](
        q, s, w, w_scale, out, tile_expert, a_rows if gather else tile_expert, row_weight if rw else s, K, E,
        q.stride(0), s.stride(0), s.stride(1), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
        out.stride(0), GATHER=gather, TILES=group_rows // bm, BM=bm, BN=GROUP, BK=GROUP, RW=rw, num_warps=warps,
        num_stages=stages, enable_fp_fusion=FP_FUSION)
    return out


@triton.jit
def _swiglu_quant(acc_g, acc_u, OUT: tl.constexpr, UE8M0: tl.constexpr):
    """Float32 gate and up tiles -> the SwiGLU output's quantised values (float32, FP8-representable) and the rows'
    scales: g and u rounded to OUT, SiLU(g) = g / (1 + exp(-g)) in float32 (libdevice exp, IEEE division, as eager
    torch) rounded to OUT, times u rounded to OUT, then fp8_act_quant's formula over the tile's 128 columns."""
    g = acc_g.to(OUT).to(tl.float32)
    u = acc_u.to(OUT).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + libdevice.exp(-g)).to(OUT).to(tl.float32)
    h = (silu * u).to(OUT).to(tl.float32)
    return _quant_groups(h, OUT != tl.float32, UE8M0)


@triton.jit
def fp8_gemm_w13_swiglu_quant(a_ptr, as_ptr, b_ptr, bs_ptr, q_ptr, qs_ptr, tile_e_ptr, a_rows_ptr, K: tl.constexpr,
                              F: tl.constexpr, E, s_am, s_asm, s_asg, s_be, s_bn, s_bse, s_bsn, s_qm, s_qsg,
                              OUT: tl.constexpr, GATHER: tl.constexpr, TILES: tl.constexpr, BM: tl.constexpr,
                              BK: tl.constexpr, UE8M0: tl.constexpr):
    """Tile (m, n): gate columns [n*128, n*128+128) and up columns F + the same, accumulated as fp8_grouped_gemm
    does; then SwiGLU in OUT (the model dtype) and the quantiser (_swiglu_quant), written to q (rows, F) float8 and
    qs (F/128, rows) float32."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e, rows, src, live = _tile_rows(tile_e_ptr, a_rows_ptr, pid_m, GATHER, TILES, BM)
    if e < E:
        cols = (pid_n * BK + tl.arange(0, BK)).to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * s_am + ks[None, :]
        bg_ptrs = b_ptr + e.to(tl.int64) * s_be + cols[None, :] * s_bn + ks[:, None]
        bu_ptrs = bg_ptrs + F * s_bn
        as_ptrs = as_ptr + src * s_asm
        bsg_ptrs = bs_ptr + e.to(tl.int64) * s_bse + pid_n * s_bsn
        bsu_ptrs = bsg_ptrs + (F // BK) * s_bsn
        acc_g = tl.zeros((BM, BK), dtype=tl.float32)
        acc_u = tl.zeros((BM, BK), dtype=tl.float32)
        for kb in range(0, K // BK):
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            bg = tl.load(bg_ptrs)
            bu = tl.load(bu_ptrs)
            sa = tl.load(as_ptrs + kb * s_asg, mask=live, other=0.0)
            acc_g += tl.dot(a, bg) * sa[:, None] * tl.load(bsg_ptrs + kb)
            acc_u += tl.dot(a, bu) * sa[:, None] * tl.load(bsu_ptrs + kb)
            a_ptrs += BK
            bg_ptrs += BK
            bu_ptrs += BK
        q, s = _swiglu_quant(acc_g, acc_u, OUT, UE8M0)
        tl.store(q_ptr + rows[:, None] * s_qm + cols[None, :], q.to(q_ptr.dtype.element_ty))
        tl.store(qs_ptr + pid_n * s_qsg + rows, s)


def w13_swiglu_quant(q: torch.Tensor, s: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                     tile_expert: torch.Tensor, model_dtype: torch.dtype, a_rows: torch.Tensor | None = None, *,
                     group_rows: int, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded layout's rows through w13 (E, 2F, K) (gate rows, then up rows), SwiGLU in model_dtype and the
    quantiser: (q (rows, F) float8, s (rows, F/128) float32 column-major), the second GEMM's input. Rows that read
    no token (padding) come out as zero groups."""
    K = q.shape[1]
    E, F2, _ = w13.shape
    F = F2 // 2
    M = tile_expert.numel() * group_rows
    w13_scale = w13_scale.contiguous()
    qo = torch.empty((M, F), dtype=FP8, device=q.device)
    so = torch.empty((F // GROUP, M), dtype=torch.float32, device=q.device)
    bm, warps, stages = W13_CONFIG["BM"], W13_CONFIG["num_warps"], W13_CONFIG["num_stages"]
    gather = a_rows is not None
    fp8_gemm_w13_swiglu_quant[(F // GROUP, tile_expert.numel() * (group_rows // bm))](
        q, s, w13, w13_scale, qo, so, tile_expert, a_rows if gather else tile_expert, K, F, E, q.stride(0),
        s.stride(0), s.stride(1), w13.stride(0), w13.stride(1), w13_scale.stride(0), w13_scale.stride(1),
        qo.stride(0), so.stride(0), OUT=TL_DTYPES[model_dtype], GATHER=gather, TILES=group_rows // bm, BM=bm,
        BK=GROUP, UE8M0=ue8m0, num_warps=warps, num_stages=stages, enable_fp_fusion=FP_FUSION)
    return qo, so.t()
