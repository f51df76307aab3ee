"""The experts' block-scaled FP8 GEMMs on Hopper, in Gluon: warp-specialised and persistent (`experts.grouped_w8a8`
calls them on sm_90; `fp8_triton` holds the portable Triton kernels, which compute the same bits).

One program per SM loops over 128-row x 256-column tiles of the padded row layout (`experts.padded_layout`: each
expert's rows start on a multiple of 128, so a tile never spans two experts; the tiles past the last group are
skipped). The partitions share a ring of shared-memory stages:
- a producer fills each 128-deep K block (the tile's A rows, two 128-row blocks of the expert's weight) and runs
  ahead across tile boundaries, so the next tile's loads overlap this tile's epilogue: one warp issuing TMA loads,
  or, where w13 gathers its A rows from the tokens' quantised rows (16-bit models, as grouped_w8a8 runs them), four
  warps copying those rows with cp.async and the weight blocks by TMA;
- two consumer warp groups take 64 rows each. Per K block and weight block: a zero-initialised wgmma (FP8 x FP8,
  float32), then the recipe's promotion `acc += p * s_a * s_b` (the activation group's scale per row, the weight
  block's scale), the arithmetic of `fp8_triton` (and of the fork's Triton kernel) in the same order. While one
  warp group scales, the other's wgmma keeps the tensor cores busy;
- w13 (16-bit models): the consumers round gate and up to the model dtype into two hand-off tiles and go on to the
  next tile, while a fourth partition (4 warps) takes SwiGLU and the re-quantisation (`fp8_triton._swiglu_quant`'s
  formula, with the quantiser's exact division by a row's scale, so the FP8 output and its scales are bit-identical
  to the Triton kernel's) 8 rows at a time and stores them. A float32 model runs that epilogue in the consumers;
- w2: the consumers store the rows in the model dtype through shared memory with TMA.

w13's two weight blocks are the gate rows [n*128, n*128+128) and the up rows F + the same (one activation group of
the SwiGLU output per tile, quantised whole); w2's are two adjacent 128-column blocks. A is either contiguous rows
in the padded layout (w2's input; a float32 model's w13 input, which `fp8_triton.quantize_scatter` writes) or, for
w13, the tokens' quantised rows with each padded row's token (`a_rows`); scales are (K/128, rows) row-major.

Measured on the H100: benchmarks/h100/w8a8_kernels.json (`benchmarks/diagnostics/w8a8.py kernels`).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.extra import libdevice
from triton.experimental.gluon.language.nvidia.hopper import (async_copy, fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from poc.model.kernels.fp8_triton import FP_FUSION  # the promotion's FMA contraction as the Triton kernels: the same bits,
# whatever TRITON_DEFAULT_FP_FUSION the process runs with (compile.py sets it to 0 for inductor's kernels)

GROUP = 128  # the K block, each weight block's rows and the activation group (fp8.GROUP, checked there)
ROWS = 128  # a tile's rows (two warp groups of 64): the padded layout's group_rows must be a multiple
FP8 = torch.float8_e4m3fn
# the model dtype (SwiGLU's rounding, w2's output) as a constexpr code: Gluon takes no dtype objects as partition args
_OUT_CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32, FP8: gl.float8e4nv}
# stages of the shared-memory ring (48 KB each), chosen on the H100 (benchmarks/h100/w8a8_kernels.json); w2 keeps
# 64 KB of shared memory for its epilogue tiles
W13_STAGES, W2_STAGES = 4, 3
CONSUMER_REGS, PRODUCER_REGS = 232, 40  # registers per thread after setmaxnreg: 2 x 128 x 232 + 128 x 40 <= 64K
# w13 with its SwiGLU epilogue in a fourth partition (16-bit models): the consumers' and epilogue warps' registers,
# the rows the epilogue takes at a time, and the ring's stages (64 KB of shared memory go to the hand-off tiles)
HANDOFF = True
HANDOFF_REGS = (216, 24, 56)  # consumers, producer, epilogue: 2 x 216 + 24 + 56 = 512 (x 128 threads = 64K); no spills
HANDOFF_ROWS = 8
HANDOFF_STAGES = 3
GATHER_REGS = (216, 24, 56)  # the same with a 4-warp producer gathering A (w13_swiglu_quant's a_rows)
FOLD_POW2 = True  # power-of-two A scales: the promotion as one FMA (_consumer's A_POW2); False: benchmark baseline


def supported(device: torch.device) -> bool:
    """wgmma and setmaxnreg are sm_90a instructions: Hopper only (other GPUs take the Triton kernels)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


@gluon.constexpr_function
def _dtype(code):
    return [gl.bfloat16, gl.float16, gl.float32][code]


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_e_ptr, E, n_tiles, NT_N: gl.constexpr,
              KB: gl.constexpr, N_E: gl.constexpr, TILE_N: gl.constexpr, SUB_STRIDE: gl.constexpr,
              STAGES: gl.constexpr):
    """TMA loads of every K block of this program's tiles into the ring; stage s is refilled once both consumer
    warp groups released it (empty), and signals ready when its bytes have landed."""
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    it = 0
    for t in range(pid, n_tiles, nprog):
        pid_n = t % NT_N
        pid_m = t // NT_N
        e = gl.load(tile_e_ptr + pid_m)
        if e < E:
            brow = e * N_E + pid_n * TILE_N
            for kb in range(KB):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(a_desc, [pid_m * 128, kb * 128], bar, a_bufs.index(2 * s))
                tma.async_copy_global_to_shared(a_desc, [pid_m * 128 + 64, kb * 128], bar, a_bufs.index(2 * s + 1))
                tma.async_copy_global_to_shared(b_desc, [brow, kb * 128], bar, b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(b_desc, [brow + SUB_STRIDE, kb * 128], bar, b_bufs.index(2 * s + 1))
                it += 1


@gluon.jit
def _producer_gather(a_ptr, s_am, a_rows_ptr, b_desc, a_bufs, b_bufs, ready, empty, tile_e_ptr, E, n_tiles,
                     NT_N: gl.constexpr, KB: gl.constexpr, N_E: gl.constexpr, TILE_N: gl.constexpr,
                     SUB_STRIDE: gl.constexpr, STAGES: gl.constexpr):
    """_producer for A rows gathered from the tokens' quantised rows (a_rows: each padded row's token, -1: a zero
    row): four warps copy them with cp.async (their completion held on the stage's barrier), the weight blocks come
    by TMA as in _producer."""
    blk: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [4, 1], [1, 0])
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    nbytes: gl.constexpr = 2 * b_desc.block_type.nbytes
    cols = gl.arange(0, 128, gl.SliceLayout(0, blk))
    it = 0
    for t in range(pid, n_tiles, nprog):
        pid_n = t % NT_N
        pid_m = t // NT_N
        e = gl.load(tile_e_ptr + pid_m)
        if e < E:
            brow = e * N_E + pid_n * TILE_N
            r0 = gl.load(a_rows_ptr + pid_m * 128 + gl.arange(0, 64, gl.SliceLayout(1, blk)))
            r1 = gl.load(a_rows_ptr + pid_m * 128 + 64 + gl.arange(0, 64, gl.SliceLayout(1, blk)))
            p0 = a_ptr + (gl.maximum(r0, 0).to(gl.int64) * s_am)[:, None] + cols[None, :]
            p1 = a_ptr + (gl.maximum(r1, 0).to(gl.int64) * s_am)[:, None] + cols[None, :]
            m0 = (r0 >= 0)[:, None] & (cols >= 0)[None, :]
            m1 = (r1 >= 0)[:, None] & (cols >= 0)[None, :]
            for kb in range(KB):
                s = it % STAGES
                mbarrier.wait(empty.index(s), ((it // STAGES) & 1) ^ 1)
                bar = ready.index(s)
                async_copy.async_copy_global_to_shared(a_bufs.index(2 * s), p0 + kb * 128, mask=m0)
                async_copy.async_copy_global_to_shared(a_bufs.index(2 * s + 1), p1 + kb * 128, mask=m1)
                async_copy.mbarrier_arrive(bar)  # each thread's copies hold the phase open until they land
                gl.thread_barrier()  # ... before the expect's arrival could complete it
                mbarrier.expect(bar, nbytes)
                tma.async_copy_global_to_shared(b_desc, [brow, kb * 128], bar, b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(b_desc, [brow + SUB_STRIDE, kb * 128], bar, b_bufs.index(2 * s + 1))
                it += 1


@gluon.jit
def _consumer(WG: gl.constexpr, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
              out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N: gl.constexpr, KB: gl.constexpr,
              TILE_N: gl.constexpr, SUB_STRIDE: gl.constexpr, STAGES: gl.constexpr, SWIGLU: gl.constexpr,
              OUT_CODE: gl.constexpr, TMA_OUT: gl.constexpr, HANDOFF: gl.constexpr, h_bufs, hready, hfree,
              GATHER: gl.constexpr, a_rows_ptr, UE8M0: gl.constexpr, RW: gl.constexpr, A_POW2: gl.constexpr):
    """Rows [64 WG, 64 WG + 64) of each tile: the two weight blocks' block-scaled products, then the epilogue (or,
    HANDOFF, the products rounded to the model dtype into h_bufs for _swiglu_epilogue). RW (w2): each row's float32
    product multiplied by its routing weight (qs_ptr, one per padded row) before the one rounding. A_POW2: A's
    scales are powers of two (UE8M0 activations), so the promotion takes one FMA an element instead of a product
    and an FMA, with the same bits (p s_a is exact: |p| >= 2^-18 where nonzero and s_a >= 2^-42 keep it normal)."""
    OUT: gl.constexpr = _dtype(OUT_CODE)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 128, 32])
    rl: gl.constexpr = gl.SliceLayout(1, mma)
    cl: gl.constexpr = gl.SliceLayout(0, mma)
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    zero = gl.zeros([64, 128], gl.float32, mma)
    it = 0
    tc = 0
    for t in range(pid, n_tiles, nprog):
        pid_n = t % NT_N
        pid_m = t // NT_N
        e = gl.load(tile_e_ptr + pid_m)
        if e < E:
            rows = pid_m * 128 + WG * 64 + gl.arange(0, 64, rl)
            bs0 = bs_ptr + e.to(gl.int64) * s_bse + ((pid_n * TILE_N) // 128) * s_bsn
            bs1 = bs_ptr + e.to(gl.int64) * s_bse + ((pid_n * TILE_N + SUB_STRIDE) // 128) * s_bsn
            acc0 = zero
            acc1 = zero
            if GATHER:  # the scales of the rows' tokens (a padding row reads token 0's: times zeros)
                srows = gl.maximum(gl.load(a_rows_ptr + rows), 0)
            else:
                srows = rows
            sa = gl.load(as_ptr + srows)
            sb0 = gl.load(bs0)
            sb1 = gl.load(bs1)
            for kb in range(KB):
                s = it % STAGES
                mbarrier.wait(ready.index(s), (it // STAGES) & 1)
                a = a_bufs.index(2 * s + WG)
                p = warpgroup_mma(a, b_bufs.index(2 * s).permute((1, 0)), zero, use_acc=False, is_async=True)
                kn = gl.minimum(kb + 1, KB - 1)  # the next block's scales load while this one multiplies
                sa_n = gl.load(as_ptr + kn * s_asg + srows)
                sb0_n = gl.load(bs0 + kn)
                sb1_n = gl.load(bs1 + kn)
                p = warpgroup_mma_wait(0, deps=(p, ))
                if A_POW2:  # p s_a exact: (p s_a) s_b + acc, contracted to one FMA, is fma(p, s_a s_b, acc)
                    acc0 += p * (sa * sb0)[:, None]
                else:
                    acc0 += p * sa[:, None] * sb0
                p = warpgroup_mma(a, b_bufs.index(2 * s + 1).permute((1, 0)), zero, use_acc=False, is_async=True)
                p = warpgroup_mma_wait(0, deps=(p, ))
                mbarrier.arrive(empty.index(s), count=1)
                if A_POW2:
                    acc1 += p * (sa * sb1)[:, None]
                else:
                    acc1 += p * sa[:, None] * sb1
                sa = sa_n
                sb0 = sb0_n
                sb1 = sb1_n
                it += 1
            row0 = pid_m * 128 + WG * 64
            if HANDOFF:  # g and u rounded to the model dtype (SwiGLU's first step) go to the epilogue warps
                mbarrier.wait(hfree.index(WG), (tc & 1) ^ 1)  # they have read this tile's predecessor
                h_bufs.index(2 * WG).store(acc0.to(OUT))
                h_bufs.index(2 * WG + 1).store(acc1.to(OUT))
                gl.thread_barrier()
                mbarrier.arrive(hready.index(WG), count=1)
                tc += 1
            elif SWIGLU:  # fp8_triton._swiglu_quant, term for term
                q, sc = _swiglu_quant_rows(acc0.to(OUT).to(gl.float32), acc1.to(OUT).to(gl.float32), OUT, OUT_CODE,
                                           UE8M0)
                tma.store_wait(0)  # the previous tile's store has left c_bufs
                c_bufs.index(WG).store(q)
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [row0, pid_n * 128], c_bufs.index(WG))
                gl.store(qs_ptr + pid_n * s_qsg + rows, sc)
            elif TMA_OUT:
                if RW:  # the routing weight in float32, before the rounding (vLLM's fused MoE; MiniMax-M2)
                    rw = gl.load(qs_ptr + rows)
                    acc0 = acc0 * rw[:, None]
                    acc1 = acc1 * rw[:, None]
                tma.store_wait(0)
                c_bufs.index(2 * WG).store(acc0.to(OUT))
                c_bufs.index(2 * WG + 1).store(acc1.to(OUT))
                fence_async_shared()
                tma.async_copy_shared_to_global(c_desc, [row0, pid_n * TILE_N], c_bufs.index(2 * WG))
                tma.async_copy_shared_to_global(c_desc, [row0, pid_n * TILE_N + 128], c_bufs.index(2 * WG + 1))
            else:  # a float32 model: 64 KB tiles would not fit beside the ring; plain stores
                if RW:
                    rw = gl.load(qs_ptr + rows)
                    acc0 = acc0 * rw[:, None]
                    acc1 = acc1 * rw[:, None]
                r64 = rows.to(gl.int64)
                c0 = pid_n * TILE_N + gl.arange(0, 128, cl)
                gl.store(out_ptr + r64[:, None] * s_om + c0[None, :], acc0.to(OUT))
                gl.store(out_ptr + r64[:, None] * s_om + (c0 + 128)[None, :], acc1.to(OUT))
    if SWIGLU or TMA_OUT:
        tma.store_wait(0)


@gluon.jit
def _swiglu_quant_rows(g, u, OUT: gl.constexpr, OUT_CODE: gl.constexpr, UE8M0: gl.constexpr):
    """fp8_triton._swiglu_quant on rows of g and u (float32 values of the model dtype): the FP8 values and the rows'
    scales (UE8M0: fp8_triton._pow2_scale's power-of-two scale and the exact product with its reciprocal)."""
    silu = gl.div_rn(g, 1.0 + libdevice.exp(-g)).to(OUT).to(gl.float32)
    h = (silu * u).to(OUT).to(gl.float32)
    amax = gl.maximum(gl.max(gl.abs(h), axis=1), 1e-10)
    if UE8M0:
        bits = gl.div_rn(amax, gl.full_like(amax, 448.0)).to(gl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(gl.int32)
        sc = (e << 23).to(gl.float32, bitcast=True)
        hs = h * ((254 - e) << 23).to(gl.float32, bitcast=True)[:, None]
        return gl.minimum(gl.maximum(hs, -448.0), 448.0).to(gl.float8e4nv), sc
    sc = amax * (1.0 / 448.0)
    if OUT_CODE == 2:  # float32 h: IEEE division
        hs = gl.div_rn(h, sc[:, None])
    else:  # 16-bit h: fp8_triton._div_by_row's exact division, a reciprocal per row and one FMA
        y = gl.div_rn(gl.full_like(sc, 1.0), sc)
        q0 = h * y[:, None]
        hs = gl.where(h == 0.0, h, gl.fma(gl.fma(-q0, sc[:, None], h), y[:, None], q0))
    return gl.minimum(gl.maximum(hs, -448.0), 448.0).to(gl.float8e4nv), sc


@gluon.jit
def _swiglu_epilogue(h_bufs, hready, hfree, out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles,
                     NT_N: gl.constexpr, OUT_CODE: gl.constexpr, CH: gl.constexpr, UE8M0: gl.constexpr):
    """w13's epilogue in warps of its own, overlapping the consumers' next tile: each half tile's g and u from
    h_bufs, CH rows at a time, through SwiGLU and the quantiser to q (rows, F) and its scales."""
    OUT: gl.constexpr = _dtype(OUT_CODE)
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    rl: gl.constexpr = gl.SliceLayout(1, blk)
    cols = gl.arange(0, 128, gl.SliceLayout(0, blk))
    pid = gl.program_id(0)
    nprog = gl.num_programs(0)
    tc = 0
    for t in range(pid, n_tiles, nprog):
        pid_n = t % NT_N
        pid_m = t // NT_N
        e = gl.load(tile_e_ptr + pid_m)
        if e < E:
            for wg in gl.static_range(2):
                mbarrier.wait(hready.index(wg), tc & 1)
                for r0 in gl.static_range(0, 64, CH):
                    g = h_bufs.index(2 * wg).slice(r0, CH).load(blk).to(gl.float32)
                    u = h_bufs.index(2 * wg + 1).slice(r0, CH).load(blk).to(gl.float32)
                    q, sc = _swiglu_quant_rows(g, u, OUT, OUT_CODE, UE8M0)
                    rows = pid_m * 128 + wg * 64 + r0 + gl.arange(0, CH, rl)
                    gl.store(out_ptr + rows.to(gl.int64)[:, None] * s_om + (pid_n * 128 + cols)[None, :], q)
                    gl.store(qs_ptr + pid_n * s_qsg + rows, sc)
                gl.thread_barrier()
                mbarrier.arrive(hfree.index(wg), count=1)
            tc += 1


@gluon.jit
def fp8_ws_grouped_gemm(a_desc, a_ptr, s_am, a_rows_ptr, b_desc, c_desc, as_ptr, s_asg, bs_ptr, s_bse, s_bsn, out_ptr,
                        s_om, qs_ptr, s_qsg,
                        tile_e_ptr, E, n_tiles, NT_N: gl.constexpr, KB: gl.constexpr, N_E: gl.constexpr,
                        TILE_N: gl.constexpr, SUB_STRIDE: gl.constexpr, STAGES: gl.constexpr, SWIGLU: gl.constexpr,
                        OUT_CODE: gl.constexpr, TMA_OUT: gl.constexpr, HANDOFF: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, EPILOGUE_REGS: gl.constexpr,
                        CH: gl.constexpr, GATHER: gl.constexpr, UE8M0: gl.constexpr, RW: gl.constexpr,
                        A_POW2: gl.constexpr):
    a_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, 64, 128], a_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.float8e4nv, [2 * STAGES, 128, 128], b_desc.layout)
    c_bufs = gl.allocate_shared_memory(c_desc.dtype, [1 if HANDOFF else (2 if SWIGLU else (4 if TMA_OUT else 1)), 64,
                                                      128], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    h_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    h_bufs = gl.allocate_shared_memory(gl.bfloat16 if OUT_CODE == 0 else gl.float16,
                                       [4, 64, 128] if HANDOFF else [1, 8, 128], h_layout)
    hready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    hfree = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # one arrival per consumer warp group
    for i in gl.static_range(2):
        mbarrier.init(hready.index(i), count=1)
        mbarrier.init(hfree.index(i), count=1)
    fence_async_shared()
    # the consumers' argument lists are written out in each form: a tuple built here would turn the constexprs in it
    # into tensors (Triton 3.6), and the partitions need them as constants
    if HANDOFF and GATHER:
        gl.warp_specialize([
            (_consumer, (0, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
                         out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N, KB, TILE_N, SUB_STRIDE, STAGES,
                         SWIGLU, OUT_CODE, TMA_OUT, HANDOFF, h_bufs, hready, hfree, GATHER, a_rows_ptr, UE8M0, RW,
                         A_POW2)),
            (_consumer, (1, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
                         out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N, KB, TILE_N, SUB_STRIDE, STAGES,
                         SWIGLU, OUT_CODE, TMA_OUT, HANDOFF, h_bufs, hready, hfree, GATHER, a_rows_ptr, UE8M0, RW,
                         A_POW2)),
            (_producer_gather, (a_ptr, s_am, a_rows_ptr, b_desc, a_bufs, b_bufs, ready, empty, tile_e_ptr, E,
                                n_tiles, NT_N, KB, N_E, TILE_N, SUB_STRIDE, STAGES)),
            (_swiglu_epilogue, (h_bufs, hready, hfree, out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N,
                                OUT_CODE, CH, UE8M0)),
        ], [4, 4, 4], [CONSUMER_REGS, PRODUCER_REGS, EPILOGUE_REGS])
    elif HANDOFF:
        gl.warp_specialize([
            (_consumer, (0, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
                         out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N, KB, TILE_N, SUB_STRIDE, STAGES,
                         SWIGLU, OUT_CODE, TMA_OUT, HANDOFF, h_bufs, hready, hfree, GATHER, a_rows_ptr, UE8M0, RW,
                         A_POW2)),
            (_consumer, (1, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
                         out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N, KB, TILE_N, SUB_STRIDE, STAGES,
                         SWIGLU, OUT_CODE, TMA_OUT, HANDOFF, h_bufs, hready, hfree, GATHER, a_rows_ptr, UE8M0, RW,
                         A_POW2)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_e_ptr, E, n_tiles, NT_N, KB, N_E,
                         TILE_N, SUB_STRIDE, STAGES)),
            (_swiglu_epilogue, (h_bufs, hready, hfree, out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N,
                                OUT_CODE, CH, UE8M0)),
        ], [4, 1, 4], [CONSUMER_REGS, PRODUCER_REGS, EPILOGUE_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (0, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
                         out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N, KB, TILE_N, SUB_STRIDE, STAGES,
                         SWIGLU, OUT_CODE, TMA_OUT, HANDOFF, h_bufs, hready, hfree, GATHER, a_rows_ptr, UE8M0, RW,
                         A_POW2)),
            (_consumer, (1, a_bufs, b_bufs, c_bufs, c_desc, ready, empty, as_ptr, s_asg, bs_ptr, s_bse, s_bsn,
                         out_ptr, s_om, qs_ptr, s_qsg, tile_e_ptr, E, n_tiles, NT_N, KB, TILE_N, SUB_STRIDE, STAGES,
                         SWIGLU, OUT_CODE, TMA_OUT, HANDOFF, h_bufs, hready, hfree, GATHER, a_rows_ptr, UE8M0, RW,
                         A_POW2)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, tile_e_ptr, E, n_tiles, NT_N, KB, N_E,
                         TILE_N, SUB_STRIDE, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _desc(t: torch.Tensor, block: list[int]) -> TensorDescriptor:
    layout = gl.NVMMASharedLayout.get_default_for(block, _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), list(t.stride()), block, layout)


def fits(w13: torch.Tensor, w2: torch.Tensor) -> bool:
    """The shapes these kernels take: w13 (E, 2F, D), w2 (E, D, F) with F a multiple of 128 and D of 256."""
    E, F2, D = w13.shape
    return F2 % (2 * GROUP) == 0 and D % (2 * GROUP) == 0 and tuple(w2.shape) == (E, D, F2 // 2)


def _launch(q, s, w, w_scale, tile_expert, out, qs, swiglu, model_dtype, stages, tma_out, handoff=False,
            a_rows=None, ue8m0=False, rw=False, a_pow2=False):
    E, N, K = w.shape
    rows = tile_expert.numel() * ROWS
    gather = a_rows is not None
    if (a_rows.numel() if gather else q.shape[0]) != rows or K % GROUP or q.stride(1) != 1 or s.stride(1) != 1:
        raise ValueError(f"fp8_gluon: A {tuple(q.shape)} for {tile_expert.numel()} row tiles, K {K}")
    nt_n, tile_n, sub = ((N // 2) // GROUP, GROUP, N // 2) if swiglu else (N // (2 * GROUP), 2 * GROUP, GROUP)
    n_tiles = tile_expert.numel() * nt_n
    if n_tiles == 0:
        return
    nsm = torch.cuda.get_device_properties(q.device).multi_processor_count
    w_scale = w_scale.contiguous()
    regs = (GATHER_REGS if gather else HANDOFF_REGS) if handoff else (CONSUMER_REGS, PRODUCER_REGS, 0)
    fp8_ws_grouped_gemm[(min(nsm, n_tiles), )](
        _desc(q, [64, GROUP]), q, q.stride(0), a_rows if gather else tile_expert, _desc(w.view(E * N, K), [GROUP, GROUP]),
        _desc(out, [64, GROUP]), s, s.stride(0), w_scale, w_scale.stride(0), w_scale.stride(1), out, out.stride(0), qs,
        qs.stride(0), tile_expert, E, n_tiles, NT_N=nt_n, KB=K // GROUP, N_E=N, TILE_N=tile_n, SUB_STRIDE=sub,
        STAGES=stages, SWIGLU=swiglu, OUT_CODE=_OUT_CODES[model_dtype], TMA_OUT=tma_out, HANDOFF=handoff,
        CONSUMER_REGS=regs[0], PRODUCER_REGS=regs[1], EPILOGUE_REGS=regs[2], CH=HANDOFF_ROWS, GATHER=gather,
        UE8M0=ue8m0, RW=rw, A_POW2=a_pow2 and FOLD_POW2 and FP_FUSION, num_warps=4, enable_fp_fusion=FP_FUSION)


def w13_swiglu_quant(q: torch.Tensor, s: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
                     tile_expert: torch.Tensor, model_dtype: torch.dtype,
                     a_rows: torch.Tensor | None = None, ue8m0: bool = False, a_pow2: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The padded layout's rows through w13 (E, 2F, D), SwiGLU in model_dtype and the quantiser: (q (rows, F) float8,
    s (F/128, rows) float32), the second GEMM's input (the tiles past the last group are left unwritten; no GEMM reads
    them). A is q (rows, D) float8 with scales s (D/128, rows), or with a_rows (each padded row's token, -1: a zero
    row; 16-bit models) the tokens' q (T, D) and s (D/128, T), gathered in the kernel's loads. ue8m0: the
    re-quantisation's power-of-two scales; a_pow2: s holds powers of two (the promotion's short form, same bits)."""
    M, F = tile_expert.numel() * ROWS, w13.shape[1] // 2
    qo = torch.empty((M, F), dtype=FP8, device=q.device)
    so = torch.empty((F // GROUP, M), dtype=torch.float32, device=q.device)
    handoff = model_dtype != torch.float32 and HANDOFF
    if a_rows is not None and not handoff:
        raise ValueError("fp8_gluon: the gathered A needs the hand-off epilogue (a 16-bit model)")
    _launch(q, s, w13, w13_scale, tile_expert, qo, so, True, model_dtype, HANDOFF_STAGES if handoff else W13_STAGES,
            True, handoff, a_rows, ue8m0, a_pow2=a_pow2)
    return qo, so


def grouped_gemm(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, tile_expert: torch.Tensor,
                 out_dtype: torch.dtype, row_weight: torch.Tensor | None = None, a_pow2: bool = False
                 ) -> torch.Tensor:
    """The padded layout's rows q (rows, K) float8 with scales s (K/128, rows) times their experts' w (E, N, K):
    (rows, N) in out_dtype (N a multiple of 256). row_weight (rows,) float32: each row's product multiplied by it in
    float32 before the rounding (the routing weight, as vLLM's fused MoE applies it). a_pow2: s holds powers of two
    (UE8M0: the promotion's short form, same bits)."""
    out = torch.empty((q.shape[0], w.shape[1]), dtype=out_dtype, device=q.device)
    tma_out = out_dtype != torch.float32
    rw = row_weight is not None
    if rw and (row_weight.dtype != torch.float32 or row_weight.numel() != q.shape[0] or not row_weight.is_contiguous()):
        raise ValueError(f"fp8_gluon: row_weight must be ({q.shape[0]},) contiguous float32")
    _launch(q, s, w, w_scale, tile_expert, out, row_weight if rw else out, False, out_dtype, W2_STAGES, tma_out,
            rw=rw, a_pow2=a_pow2)
    return out
