"""Variants of the experts' block-scaled FP8 GEMMs that were tried against the served kernels and did not help.

    bash benchmarks/run.sh h100 expert_gemm_variants          # -> benchmarks/h100/expert_gemm_variants.json
    python benchmarks/diagnostics/expert_gemm_variants.py --out FILE [--tokens 65536]

The Qwen3-30B-A3B-FP8 expert shapes (128 experts, top 8, w13 2 x 768 x 2048, w2 2048 x 768), routed seq-1024 tokens
laid out as `fp8.padded_layout` does, each variant timed (median of 10, CUDA events) and compared with the served
kernel's output (relative Frobenius difference: only accumulation order may differ). The kernels compared against
are `poc.model.fp8_triton`'s (`grouped_gemm` for w2, `w13_swiglu_quant` for w13), served on GPUs other than Hopper
(Hopper runs `poc.model.fp8_gluon`, measured by `w8a8.py kernels`). Variants:
- `tma_weights`: the weights (and a contiguous A) through TMA descriptors instead of pointer loads;
- `persistent`: one program per SM looping over tiles (TMA loads), with the tile loop flattened into the K loop
  and with Triton's warp specialisation (`tl.range(..., flatten=, warp_specialize=)`);
- `ws_kloop`: a warp-specialised K loop (TMA loads), one program per tile;
- `sw_pipelined`: K block kb's product issued before block kb-1's is scaled and added;
- `inplace_rescale`: the accumulator rescaled by the ratio of consecutive scales so that the tensor cores add into it;
- `bn256`: 256-wide N tiles (the weight scales as a vector over the tile's columns).
w13 runs on the gathered token rows (as served) and, for the TMA variants, on a materialised (contiguous) copy;
the gather pass that copy needs is timed too (torch's index_put). Writes JSON (the command inside).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from poc.bench import cuda_time
from poc.model import fp8, fp8_triton
from poc.model.fp8_triton import TL_DTYPES, _swiglu_quant, _tile_rows

grouped_gemm = partial(fp8_triton.grouped_gemm, group_rows=fp8.GROUP_ROWS)
w13_swiglu_quant = partial(fp8_triton.w13_swiglu_quant, group_rows=fp8.GROUP_ROWS)


@triton.jit
def _grouped_tma(a_ptr, a_desc, as_ptr, b_desc, bs_ptr, c_ptr, tile_e_ptr, a_rows_ptr, K: tl.constexpr,
                 N: tl.constexpr, E, s_am, s_asm, s_asg, s_bse, s_bsn, s_cm, GATHER: tl.constexpr,
                 A_TMA: tl.constexpr, TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e, rows, src, live = _tile_rows(tile_e_ptr, a_rows_ptr, pid_m, GATHER, TILES, BM)
    if e < E:
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * s_am + ks[None, :]
        as_ptrs = as_ptr + src * s_asm
        bs_ptrs = bs_ptr + e.to(tl.int64) * s_bse + (cols // BK) * s_bsn
        row0 = e * N + pid_n * BN
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K // BK):
            if A_TMA:
                a = a_desc.load([pid_m * BM, kb * BK])
                sa = tl.load(as_ptrs + kb * s_asg)
            else:
                a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
                sa = tl.load(as_ptrs + kb * s_asg, mask=live, other=0.0)
            b = b_desc.load([row0, kb * BK])
            sb = tl.load(bs_ptrs + kb)
            acc += tl.dot(a, b.T) * sa[:, None] * sb[None, :]
            a_ptrs += BK
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def grouped_tma(q, s, w, w_scale, tile_expert, out_dtype, a_rows=None, BM=128, BN=128, num_warps=8, num_stages=3,
                group_rows=fp8.GROUP_ROWS, a_tma=None):
    K = q.shape[1]
    M = tile_expert.numel() * group_rows
    E, N, _ = w.shape
    w_scale = w_scale.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    grid = (N // BN, tile_expert.numel() * (group_rows // BM))
    gather = a_rows is not None
    a_tma = (not gather) if a_tma is None else a_tma
    a_desc = TensorDescriptor.from_tensor(q, [BM, 128])
    b_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [BN, 128])
    _grouped_tma[grid](q, a_desc, s, b_desc, w_scale, out, tile_expert, a_rows if gather else tile_expert, K, N, E,
                       q.stride(0), s.stride(0), s.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0),
                       GATHER=gather, A_TMA=a_tma, TILES=group_rows // BM, BM=BM, BN=BN, BK=128,
                       num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _w13_tma(a_ptr, as_ptr, b_desc, bs_ptr, q_ptr, qs_ptr, tile_e_ptr, a_rows_ptr, K: tl.constexpr, F: tl.constexpr,
             E, s_am, s_asm, s_asg, s_bse, s_bsn, s_qm, s_qsg, OUT: tl.constexpr, GATHER: tl.constexpr,
             TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e, rows, src, live = _tile_rows(tile_e_ptr, a_rows_ptr, pid_m, GATHER, TILES, BM)
    if e < E:
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * s_am + ks[None, :]
        as_ptrs = as_ptr + src * s_asm
        bsg_ptrs = bs_ptr + e.to(tl.int64) * s_bse + pid_n * s_bsn
        bsu_ptrs = bsg_ptrs + (F // BK) * s_bsn
        rg = e * (2 * F) + pid_n * BN
        acc_g = tl.zeros((BM, BN), dtype=tl.float32)
        acc_u = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K // BK):
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            bg = b_desc.load([rg, kb * BK])
            bu = b_desc.load([rg + F, kb * BK])
            sa = tl.load(as_ptrs + kb * s_asg, mask=live, other=0.0)
            acc_g += tl.dot(a, bg.T) * sa[:, None] * tl.load(bsg_ptrs + kb)
            acc_u += tl.dot(a, bu.T) * sa[:, None] * tl.load(bsu_ptrs + kb)
            a_ptrs += BK
        q, s = _swiglu_quant(acc_g, acc_u, OUT)
        tl.store(q_ptr + rows[:, None] * s_qm + cols[None, :], q.to(q_ptr.dtype.element_ty))
        tl.store(qs_ptr + pid_n * s_qsg + rows, s)


def w13_tma(q, s, w, w_scale, tile_expert, out_dtype, a_rows=None, BM=128, num_warps=8, num_stages=3,
            group_rows=fp8.GROUP_ROWS):
    K = q.shape[1]
    E, N2, _ = w.shape
    F = N2 // 2
    M = tile_expert.numel() * group_rows
    w_scale = w_scale.contiguous()
    qo = torch.empty((M, F), dtype=torch.float8_e4m3fn, device=q.device)
    so = torch.empty((F // 128, M), dtype=torch.float32, device=q.device)
    grid = (F // 128, tile_expert.numel() * (group_rows // BM))
    gather = a_rows is not None
    b_desc = TensorDescriptor.from_tensor(w.view(E * N2, K), [128, 128])
    _w13_tma[grid](q, s, b_desc, w_scale, qo, so, tile_expert, a_rows if gather else tile_expert, K, F, E,
                   q.stride(0), s.stride(0), s.stride(1), w_scale.stride(0), w_scale.stride(1), qo.stride(0),
                   so.stride(0), OUT=TL_DTYPES[out_dtype], GATHER=gather, TILES=group_rows // BM, BM=BM, BN=128, BK=128,
                   num_warps=num_warps, num_stages=num_stages)
    return qo, so.t()


@triton.jit
def _g2(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tile_e_ptr, a_rows_ptr, K: tl.constexpr, E, s_am, s_asm, s_asg, s_be,
        s_bn, s_bse, s_bsn, s_cm, GATHER: tl.constexpr, TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
        BK: tl.constexpr, MODE: tl.constexpr):
    """MODE 0: acc += dot*sa*sb (vector sb); 1: acc += dot*(sa*sb); 2: in-place rescaled accumulator."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e, rows, src, live = _tile_rows(tile_e_ptr, a_rows_ptr, pid_m, GATHER, TILES, BM)
    if e < E:
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        ks = tl.arange(0, BK)
        a_ptrs = a_ptr + src[:, None] * s_am + ks[None, :]
        b_ptrs = b_ptr + e.to(tl.int64) * s_be + cols[None, :] * s_bn + ks[:, None]
        as_ptrs = as_ptr + src * s_asm
        bs_ptrs = bs_ptr + e.to(tl.int64) * s_bse + (cols // BK) * s_bsn
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        if MODE == 2:
            cprev = tl.full((BM, BN), 1.0, tl.float32)
        for kb in range(0, K // BK):
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            b = tl.load(b_ptrs)
            sa = tl.load(as_ptrs + kb * s_asg, mask=live, other=1.0)
            sb = tl.load(bs_ptrs + kb)
            if MODE == 0:
                acc += tl.dot(a, b) * sa[:, None] * sb[None, :]
            elif MODE == 1:
                acc += tl.dot(a, b) * (sa[:, None] * sb[None, :])
            else:
                c = sa[:, None] * sb[None, :]
                acc = tl.dot(a, b, acc * (cprev / c))
                cprev = c
            a_ptrs += BK
            b_ptrs += BK
        if MODE == 2:
            acc = acc * cprev
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def g2(q, s, w, w_scale, tile_expert, out_dtype, a_rows=None, BM=128, BN=128, num_warps=8, num_stages=3, mode=0,
       group_rows=fp8.GROUP_ROWS):
    K = q.shape[1]
    M = tile_expert.numel() * group_rows
    E, N, _ = w.shape
    w_scale = w_scale.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    grid = (N // BN, tile_expert.numel() * (group_rows // BM))
    gather = a_rows is not None
    _g2[grid](q, s, w, w_scale, out, tile_expert, a_rows if gather else tile_expert, K, E, q.stride(0),
              s.stride(0), s.stride(1), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1),
              out.stride(0), GATHER=gather, TILES=group_rows // BM, BM=BM, BN=BN, BK=128, MODE=mode,
              num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _gp(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, tile_e_ptr, n_mt_ptr, K: tl.constexpr, N: tl.constexpr, E,
        s_asm, s_asg, s_bse, s_bsn, s_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
        NUM_SMS: tl.constexpr, FLATTEN: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    """Persistent grouped GEMM, A and B by TMA, BM == group rows."""
    start = tl.program_id(0)
    n_nt: tl.constexpr = N // BN
    n_tiles = tl.load(n_mt_ptr) * n_nt
    for tile in tl.range(start, n_tiles, NUM_SMS, flatten=FLATTEN, warp_specialize=WS, num_stages=STAGES):
        pid_m = tile // n_nt
        pid_n = tile % n_nt
        e = tl.load(tile_e_ptr + pid_m)
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in range(0, K // BK):
            a = a_desc.load([pid_m * BM, kb * BK])
            b = b_desc.load([e * N + pid_n * BN, kb * BK])
            sa = tl.load(as_ptr + rows * s_asm + kb * s_asg)
            sb = tl.load(bs_ptr + e.to(tl.int64) * s_bse + (pid_n * BN // BK) * s_bsn + kb)
            acc += tl.dot(a, b.T) * sa[:, None] * sb
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def gp(q, s, w, w_scale, tile_expert, out_dtype, BM=128, num_warps=8, num_stages=3, flatten=True, ws=False,
       num_sms=132, group_rows=fp8.GROUP_ROWS):
    K = q.shape[1]
    E, N, _ = w.shape
    M = tile_expert.numel() * group_rows
    w_scale = w_scale.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    n_mt = (tile_expert < E).sum().to(torch.int32).reshape(1) * (group_rows // BM)
    te = tile_expert.repeat_interleave(group_rows // BM)
    a_desc = TensorDescriptor.from_tensor(q, [BM, 128])
    b_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [128, 128])
    _gp[(num_sms,)](a_desc, s, b_desc, w_scale, out, te, n_mt, K, N, E, s.stride(0), s.stride(1),
                    w_scale.stride(0), w_scale.stride(1), out.stride(0), BM=BM, BN=128, BK=128, NUM_SMS=num_sms,
                    FLATTEN=flatten, WS=ws, STAGES=num_stages, num_warps=num_warps)
    return out


@triton.jit
def _gws(a_desc, as_ptr, b_desc, bs_ptr, c_ptr, tile_e_ptr, K: tl.constexpr, N: tl.constexpr, E,
         s_asm, s_asg, s_bse, s_bsn, s_cm, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
         TILES: tl.constexpr, STAGES: tl.constexpr):
    """Non-persistent, TMA A and B, warp-specialised K loop."""
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    e = tl.load(tile_e_ptr + pid_m // TILES)
    if e < E:
        rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
        cols = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kb in tl.range(0, K // BK, warp_specialize=True, num_stages=STAGES):
            a = a_desc.load([pid_m * BM, kb * BK])
            b = b_desc.load([e * N + pid_n * BN, kb * BK])
            sa = tl.load(as_ptr + rows * s_asm + kb * s_asg)
            sb = tl.load(bs_ptr + e.to(tl.int64) * s_bse + (pid_n * BN // BK) * s_bsn + kb)
            acc += tl.dot(a, b.T) * sa[:, None] * sb
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def gws(q, s, w, w_scale, tile_expert, out_dtype, BM=128, num_warps=8, num_stages=3, group_rows=fp8.GROUP_ROWS):
    K = q.shape[1]
    E, N, _ = w.shape
    M = tile_expert.numel() * group_rows
    w_scale = w_scale.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    a_desc = TensorDescriptor.from_tensor(q, [BM, 128])
    b_desc = TensorDescriptor.from_tensor(w.view(E * N, K), [128, 128])
    _gws[(N // 128, tile_expert.numel() * (group_rows // BM))](
        a_desc, s, b_desc, w_scale, out, tile_expert, K, N, E, s.stride(0), s.stride(1), w_scale.stride(0),
        w_scale.stride(1), out.stride(0), BM=BM, BN=128, BK=128, TILES=group_rows // BM, STAGES=num_stages,
        num_warps=num_warps)
    return out


@triton.jit
def _gsp(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tile_e_ptr, a_rows_ptr, K: tl.constexpr, E, s_am, s_asm, s_asg, s_be,
         s_bn, s_bse, s_bsn, s_cm, GATHER: tl.constexpr, TILES: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
         BK: tl.constexpr):
    """Software-pipelined promotion: K block kb's product is issued before block kb-1's is scaled and added."""
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
        prev = tl.dot(tl.load(a_ptrs, mask=live[:, None], other=0.0), tl.load(b_ptrs))
        sp = tl.load(as_ptrs, mask=live, other=0.0) * tl.load(bs_ptrs)
        for kb in range(1, K // BK):
            a_ptrs += BK
            b_ptrs += BK
            cur = tl.dot(tl.load(a_ptrs, mask=live[:, None], other=0.0), tl.load(b_ptrs))
            acc += prev * sp[:, None]
            sp = tl.load(as_ptrs + kb * s_asg, mask=live, other=0.0) * tl.load(bs_ptrs + kb)
            prev = cur
        acc += prev * sp[:, None]
        tl.store(c_ptr + rows[:, None] * s_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty))


def gsp(q, s, w, w_scale, tile_expert, out_dtype, a_rows=None, BM=128, BN=128, num_warps=8, num_stages=3,
        group_rows=fp8.GROUP_ROWS):
    K = q.shape[1]
    M = tile_expert.numel() * group_rows
    E, N, _ = w.shape
    w_scale = w_scale.contiguous()
    out = torch.empty((M, N), dtype=out_dtype, device=q.device)
    gather = a_rows is not None
    _gsp[(N // BN, tile_expert.numel() * (group_rows // BM))](
        q, s, w, w_scale, out, tile_expert, a_rows if gather else tile_expert, K, E, q.stride(0), s.stride(0),
        s.stride(1), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0), GATHER=gather,
        TILES=group_rows // BM, BM=BM, BN=BN, BK=128, num_warps=num_warps, num_stages=num_stages)
    return out


@triton.jit
def _w13sp(a_ptr, as_ptr, b_ptr, bs_ptr, q_ptr, qs_ptr, tile_e_ptr, a_rows_ptr, K: tl.constexpr, F: tl.constexpr,
           E, s_am, s_asm, s_asg, s_be, s_bn, s_bse, s_bsn, s_qm, s_qsg, OUT: tl.constexpr, GATHER: tl.constexpr,
           TILES: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr):
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
        a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
        pg = tl.dot(a, tl.load(bg_ptrs))
        pu = tl.dot(a, tl.load(bu_ptrs))
        sa = tl.load(as_ptrs, mask=live, other=0.0)
        sg = sa * tl.load(bsg_ptrs)
        su = sa * tl.load(bsu_ptrs)
        for kb in range(1, K // BK):
            a_ptrs += BK
            bg_ptrs += BK
            bu_ptrs += BK
            a = tl.load(a_ptrs, mask=live[:, None], other=0.0)
            cg = tl.dot(a, tl.load(bg_ptrs))
            acc_g += pg * sg[:, None]
            cu = tl.dot(a, tl.load(bu_ptrs))
            acc_u += pu * su[:, None]
            sa = tl.load(as_ptrs + kb * s_asg, mask=live, other=0.0)
            sg = sa * tl.load(bsg_ptrs + kb)
            su = sa * tl.load(bsu_ptrs + kb)
            pg = cg
            pu = cu
        acc_g += pg * sg[:, None]
        acc_u += pu * su[:, None]
        q, s = _swiglu_quant(acc_g, acc_u, OUT)
        tl.store(q_ptr + rows[:, None] * s_qm + cols[None, :], q.to(q_ptr.dtype.element_ty))
        tl.store(qs_ptr + pid_n * s_qsg + rows, s)


def w13sp(q, s, w, w_scale, tile_expert, out_dtype, a_rows=None, BM=128, num_warps=8, num_stages=3,
          group_rows=fp8.GROUP_ROWS):
    K = q.shape[1]
    E, N2, _ = w.shape
    F = N2 // 2
    M = tile_expert.numel() * group_rows
    w_scale = w_scale.contiguous()
    qo = torch.empty((M, F), dtype=torch.float8_e4m3fn, device=q.device)
    so = torch.empty((F // 128, M), dtype=torch.float32, device=q.device)
    gather = a_rows is not None
    _w13sp[(F // 128, tile_expert.numel() * (group_rows // BM))](
        q, s, w, w_scale, qo, so, tile_expert, a_rows if gather else tile_expert, K, F, E, q.stride(0), s.stride(0),
        s.stride(1), w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), qo.stride(0), so.stride(0),
        OUT=TL_DTYPES[out_dtype], GATHER=gather, TILES=group_rows // BM, BM=BM, BK=128, num_warps=num_warps,
        num_stages=num_stages)
    return qo, so.t()


def measure(tokens: int) -> list[dict]:
    g = torch.Generator(device="cuda").manual_seed(0)
    E, F, D, k = 128, 768, 2048, 8

    def weight(n, kk):
        w = torch.randn(E, n, kk, device="cuda", generator=g).mul_(64).clamp_(-448, 448).to(fp8.FP8)
        return w, torch.rand(E, n // 128, kk // 128, device="cuda", generator=g).mul_(0.2).add_(0.9) * 1.6e-5

    (w13, s13), (w2, s2) = weight(2 * F, D), weight(D, F)
    x = torch.randn(tokens, D, device="cuda", generator=g).bfloat16()
    experts = torch.randint(0, E, (tokens * k,), device="cuda", generator=g)
    rows = experts.argsort(stable=True)
    ends = torch.searchsorted(experts[rows], torch.arange(1, E + 1, device="cuda"))
    dest, tile_e, a_rows = fp8.padded_layout(rows, k, ends)
    live = a_rows >= 0
    qt, st = fp8.quantize_act(x)
    aq, as_ = w13_swiglu_quant(qt, st, w13, s13, tile_e, torch.bfloat16, a_rows)
    qa = torch.zeros((a_rows.numel(), D), dtype=fp8.FP8, device="cuda")
    sa = torch.ones((a_rows.numel(), D // 128), device="cuda")

    def gather():
        qa[dest] = qt[rows // k]
        sa[dest] = st[rows // k]

    gather()
    sac = fp8.col_major(sa)
    n = tokens * k
    flop13, flop2 = 2 * n * 2 * F * D, 2 * n * D * F
    out: list[dict] = []

    def row(gemm, variant, fn, flop, ref=None, **config):
        try:
            y = fn()
            rel = None
            if ref is not None:
                y = y[0] if isinstance(y, tuple) else y
                if y.dtype == fp8.FP8:  # a fused output: the fraction of FP8 values that differ
                    rel = float((y.view(torch.uint8)[live] != ref.view(torch.uint8)[live]).float().mean())
                else:
                    rel = float((y[live].float() - ref[live].float()).norm() / ref[live].float().norm())
            t = cuda_time(fn, iters=10)
            r = {"gemm": gemm, "variant": variant, "config": config, "ms": t * 1e3, "tflops": flop / t / 1e12,
                 "diff_vs_served": rel}
        except Exception as e:  # noqa: BLE001 - a variant the compiler refuses: recorded
            r = {"gemm": gemm, "variant": variant, "config": config, "error": str(e).splitlines()[0][:200]}
        out.append(r)
        print(json.dumps(r), flush=True)

    t = cuda_time(gather, iters=5)
    out.append({"gemm": "w13 input", "variant": "gather pass (index_put)", "ms": t * 1e3})
    print(json.dumps(out[-1]), flush=True)
    # w13 with SwiGLU and the quantiser (served), and its variants
    row("w13 fused", "served", lambda: w13_swiglu_quant(qt, st, w13, s13, tile_e, torch.bfloat16, a_rows),
        flop13)
    row("w13 fused", "tma_weights", lambda: w13_tma(qt, st, w13, s13, tile_e, torch.bfloat16, a_rows), flop13, aq)
    for bm, warps in ((128, 8), (64, 8)):
        row("w13 fused", "sw_pipelined", lambda: w13sp(qt, st, w13, s13, tile_e, torch.bfloat16, a_rows, BM=bm,
                                                        num_warps=warps), flop13, aq, BM=bm, num_warps=warps)
    # the plain grouped GEMM: w13 on gathered rows, on a contiguous copy, and w2
    cases = {"w13 gathered": (qt, st, w13, s13, a_rows, flop13), "w13 contiguous": (qa, sac, w13, s13, None, flop13),
             "w2": (aq, as_, w2, s2, None, flop2)}
    for name, (q, s, w, ws, ar, flop) in cases.items():
        ref = grouped_gemm(q, s, w, ws, tile_e, torch.bfloat16, ar)
        row(name, "served", lambda: grouped_gemm(q, s, w, ws, tile_e, torch.bfloat16, ar), flop,
            **fp8_triton.GROUPED_CONFIG)
        row(name, "tma_weights", lambda: grouped_tma(q, s, w, ws, tile_e, torch.bfloat16, ar, BM=64, num_warps=4),
            flop, ref)
        row(name, "sw_pipelined", lambda: gsp(q, s, w, ws, tile_e, torch.bfloat16, ar, BM=64, num_warps=4), flop,
            ref)
        row(name, "inplace_rescale", lambda: g2(q, s, w, ws, tile_e, torch.bfloat16, ar, mode=2), flop, ref)
        for bm in (64, 128):
            row(name, "bn256", lambda: g2(q, s, w, ws, tile_e, torch.bfloat16, ar, BM=bm, BN=256, num_warps=8),
                flop, ref, BM=bm, BN=256)
        if ar is None:  # TMA for A too
            for flatten, ws_ in ((False, False), (True, False), (True, True)):
                row(name, "persistent", lambda: gp(q, s, w, ws, tile_e, torch.bfloat16, flatten=flatten, ws=ws_),
                    flop, ref, flatten=flatten, warp_specialize=ws_)
            row(name, "ws_kloop", lambda: gws(q, s, w, ws, tile_e, torch.bfloat16), flop, ref)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", type=int, default=64 * 1024, help="routed tokens (a 64-nonce seq-1024 batch: 65536)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = measure(args.tokens)
    res = {"what": "expert GEMM variants", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "triton": triton.__version__, "tokens": args.tokens,
           "command": " ".join(["python benchmarks/diagnostics/expert_gemm_variants.py",
                                *(sys.argv[1:] if argv is None else argv)]),
           "date": time.strftime("%Y-%m-%d %H:%M:%S"), "seconds": time.perf_counter() - t0, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
