"""The attention recipes (model/attention.py, ../shared/spec/minimax-m2.md step 6).

CPU: the fp8 recipe's torch emulation against a naive transcription written here (loops over batch, head, query tile
and key tile), bit for bit, with GQA and short last tiles; the last-position pass against the last row of the full
pass; one tile (S <= 128) against a plain softmax whose P is quantised as e4(448 p); the counterfactuals (key tiles
from 0 forward, no 448, unquantised P, the wrong GQA mapping) each moving bits, so the comparisons can fail; the
clamp at +-448; `fp8kv` and `bf16` against their definitions, `bf16` against the model's SDPA call before attend.

Triton's interpreter (CPU, when triton is installed; a subprocess, since TRITON_INTERPRET must be set before triton
is imported): the kernel (kernels/attn_fp8_triton.py) against the emulation, the interpreter's float32 -> bf16 and
-> e4m3 casts rounding to nearest even as the GPU's do (benchmarks/diagnostics/triton_interpret.round_as_the_gpu).

GPU (CUDA, Hopper for the kernel): the kernel against the emulation at the MiniMax shape, in bf16.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from poc.model import attention
from poc.model.attention import e4, fp8_attention_torch

from .attention_inputs import UNIT_C, robust_inputs

ROOT = Path(__file__).resolve().parents[1]
LOG2E = math.log2(math.e)


def projections(B: int, H: int, Hkv: int, S: int, D: int, dtype=torch.float32, seed: int = 0, q_mul: float = 1.0,
                device="cpu"):
    """q (B, H, S, D), k and v (B, Hkv, S, D) as the model hands them over: transposed views of one
    (B, S, (H + 2 Hkv) D) projection output (non-contiguous); random normal, q times q_mul (peakier rows)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(B, S, (H + 2 * Hkv) * D, generator=g, device=device)
    x[..., :H * D] *= q_mul
    q, k, v = x.to(dtype).split([H * D, Hkv * D, Hkv * D], dim=-1)
    # (B, S, H*D) -> (B, S, H, D) -> (B, H, S, D)
    return (q.view(B, S, H, D).transpose(1, 2), k.view(B, S, Hkv, D).transpose(1, 2),
            v.view(B, S, Hkv, D).transpose(1, 2))


def naive_fp8(q, k, v, scale: float, order: str = "back", p_scale: float = 448.0, quantise: bool = True,
              kv_head=None):
    """The fp8 recipe as the spec words it, per batch, head, query tile and key tile. The dots are exact: sums of
    e4m3 products in float64 (exact: the products are multiples of 2^-18 below 2^18) rounded once, as the emulation
    defines them; exp2 correctly rounded to float32 (float64, one rounding); a row of p summed pairwise (j + j+64,
    ...). The counterfactuals, for the tests that show a comparison can fail: order "forward" (key tiles 0 ..
    diagonal), p_scale 1 (P rounded as e4(p), no 448), quantise False (P unrounded), kv_head (h -> kv head)."""
    B, H, Sq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    c = torch.tensor(LOG2E * scale, dtype=torch.float32)
    first = S - Sq
    out = torch.empty(B, H, Sq, D, dtype=q.dtype, device=q.device)
    for b in range(B):
        for h in range(H):
            g = kv_head(h) if kv_head else h // (H // Hkv)
            Q, K, V = e4(q[b, h]).double(), e4(k[b, g]).double(), e4(v[b, g]).double()
            for i in range(first // 128, (S + 127) // 128):
                pos = torch.arange(max(128 * i, first), min(128 * i + 128, S), device=q.device)
                m = torch.full((len(pos),), -math.inf, device=q.device)
                l = torch.zeros(len(pos), device=q.device)
                o = torch.zeros(len(pos), D, device=q.device)
                for j in (range(i, -1, -1) if order == "back" else range(0, i + 1)):
                    keys = torch.arange(128 * j, 128 * j + 128, device=q.device)
                    real = keys < S
                    s = torch.full((len(pos), 128), -math.inf, device=q.device)
                    dots = (Q[pos - first][:, None, :] * K[keys[real]][None, :, :]).sum(-1).float()
                    s[:, real] = torch.where(keys[real][None, :] <= pos[:, None], dots, -math.inf)
                    m_new = torch.maximum(m, s.max(-1).values)
                    alpha = torch.exp2(((m - m_new) * c).double()).float()
                    p = torch.exp2((s * c - m_new[:, None] * c).double()).float()
                    row = p
                    while row.shape[-1] > 1:
                        row = row[:, :row.shape[-1] // 2] + row[:, row.shape[-1] // 2:]
                    l = l * alpha + row[:, 0]
                    pq = e4(p_scale * p).double() if quantise else (p_scale * p).double()
                    pv = (pq[:, real][:, :, None] * V[keys[real]][None, :, :]).sum(1).float()
                    o = o * alpha[:, None] + pv
                    m = m_new
                out[b, h, pos - first] = (o / (p_scale * l)[:, None]).to(q.dtype)
    return out


def agreement(out: torch.Tensor, ref: torch.Tensor) -> dict:
    """How far out is from ref: the share of elements that differ, the largest difference and the RMS difference,
    each relative to ref's (largest magnitude, RMS)."""
    o, r = out.float(), ref.float()
    d = o - r
    return {"differ": (o != r).float().mean().item(), "max_rel": (d.abs().max() / r.abs().max()).item(),
            "rms_rel": (d.pow(2).mean().sqrt() / r.pow(2).mean().sqrt()).item(), "n": r.numel()}


# The GPU tests' bounds on the kernel against the emulation. A Hopper FP8 MMA is reported to keep only 13 mantissa
# bits of the accumulator it adds to (SageAttention2; DeepSeek-V3 3.5.2): the PV dot adds into O, so O is
# truncated a little on every 32 keys. A CPU model of that (each 32-wide chunk of both dots added to an accumulator
# cut to 13 bits) gave, at H 6 / Hkv 1 / D 128, S 300 and 1024: random bf16 inputs differ 14-28%, rms_rel
# 0.0018-0.0025, max_rel 0.004-0.008; robust_inputs differ 1.0-2.4%, rms_rel 0.00016-0.00027, max_rel 0.001. The
# counterfactuals on the same inputs: key tiles from 0 forward rms_rel 0.0084-0.016 (random), 0.0058-0.011
# (robust), differ 44-81%; no 448 0.028-0.038; P unrounded 0.014-0.020; GQA mapping ~1. Measured on an H200 (the
# kernel with K and V rounded once, benchmarks/h200/attention_fp8.json): random inputs differ 38%, rms_rel 0.0037,
# max_rel 0.012-0.020; robust inputs (S 300) differ 2.7%, rms_rel 0.0006, max_rel 0.0045.
RANDOM_RMS, RANDOM_MAX = 6e-3, 3e-2
ROBUST_RMS, ROBUST_MAX, ROBUST_DIFFER = 1e-3, 1e-2, 0.05
COUNTERFACTUALS = ({"order": "forward"}, {"p_scale": 1.0}, {"quantise": False}, {"kv_head": lambda h: h % 2})


# ---------------------------------------------------------------------------------------------------------------
# CPU: the emulation


@pytest.mark.parametrize("S", [5, 128, 130, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_emulation_is_the_naive_transcription_bit_for_bit(S, dtype):
    q, k, v = projections(2, 4, 2, S, 32, dtype, seed=S, q_mul=3.0)
    scale = 32 ** -0.5
    full = fp8_attention_torch(q, k, v, scale)
    assert full.dtype == dtype and full.shape == (2, 4, S, 32)
    assert torch.equal(full, naive_fp8(q, k, v, scale))
    last = fp8_attention_torch(q[:, :, -1:], k, v, scale)
    assert torch.equal(last, naive_fp8(q[:, :, -1:], k, v, scale)) and torch.equal(last, full[:, :, -1:])
    assert torch.equal(attention.attend(q, k, v, "fp8", scale), full)  # the CPU path is the emulation


@pytest.mark.parametrize("S", [1, 2, 127, 128, 129, 256, 385])
def test_last_position_is_the_last_row_of_the_full_pass(S):
    q, k, v = projections(1, 6, 2, S, 64, torch.bfloat16, seed=S, q_mul=2.0)
    full = attention.attend(q, k, v, "fp8", 0.125)
    assert torch.equal(attention.attend(q[:, :, -1:].contiguous(), k, v, "fp8", 0.125), full[:, :, -1:])


@pytest.mark.parametrize("S", [1, 5, 77, 128])
def test_one_tile_is_a_softmax_with_p_quantised(S):
    """S <= 128: one key tile, no rescaling: out = e4(448 p) V8 / (448 sum(p)), p = exp2(c (S - rowmax)) (c (S - m)
    as c S - c m), here in plain float32 matrix ops (library order: close, not bitwise)."""
    q, k, v = projections(2, 4, 1, S, 32, seed=S, q_mul=3.0)
    c = attention.log2e_scale(32 ** -0.5)
    s = e4(q).float() @ e4(k).float().transpose(-1, -2)  # (B, H, S, D) @ (B, 1, D, S): GQA by broadcasting
    s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), -math.inf)
    p = torch.exp2(s * c - s.amax(-1, keepdim=True) * c)
    want = (e4(448 * p).float() @ e4(v).float()) / (448 * p.sum(-1, keepdim=True))
    torch.testing.assert_close(fp8_attention_torch(q, k, v), want, rtol=2e-6, atol=1e-6)
    # and it is not the unquantised softmax
    plain = torch.softmax(s * (32 ** -0.5), -1) @ e4(v).float()
    assert S == 1 or (fp8_attention_torch(q, k, v) - plain).abs().max() > 1e-3


def test_counterfactuals_move_bits():
    """Each way to get the recipe wrong changes the emulation's output, so the bitwise comparisons above (and the
    kernel's below) can fail: key tiles from 0 forward (S > 128 only), e4(p) without the 448, P unrounded, query head
    h reading kv head h % Hkv instead of h // (H / Hkv)."""
    q, k, v = projections(1, 4, 2, 300, 32, torch.bfloat16, seed=3, q_mul=3.0)
    scale = 32 ** -0.5
    ref = fp8_attention_torch(q, k, v, scale)
    for kw in COUNTERFACTUALS:
        assert agreement(naive_fp8(q, k, v, scale, **kw), ref)["differ"] > 0.01, kw
    short = [t[:, :, :100] for t in (q, k, v)]  # one tile: the order is moot
    assert torch.equal(naive_fp8(*short, scale, order="forward"), fp8_attention_torch(*short, scale))


def test_robust_inputs_separate_right_from_wrong():
    """robust_inputs: the recipe's right and wrong forms far apart, so the GPU test may ask the kernel for (nearly)
    exact agreement. c is exactly 1 there; each counterfactual differs in more than 20% of the elements, by an RMS
    over 4 times the GPU test's bound."""
    assert attention.log2e_scale(UNIT_C) == 1.0
    q, k, v = robust_inputs(1, 6, 2, 300, 64, seed=1)
    ref = fp8_attention_torch(q, k, v, UNIT_C)
    assert torch.equal(naive_fp8(q, k, v, UNIT_C), ref)
    for kw in COUNTERFACTUALS:
        stats = agreement(naive_fp8(q, k, v, UNIT_C, **kw), ref)
        assert stats["differ"] > 0.2 and stats["rms_rel"] > 4 * ROBUST_RMS, (kw, stats)


def test_inputs_beyond_448_are_clamped():
    q, k, v = projections(1, 2, 1, 40, 32, seed=1)
    q[0, 0, 3, :4] = torch.tensor([1000.0, -5000.0, 448.5, 3e38])
    k[0, 0, 7, :3] = torch.tensor([-1e4, 600.0, 449.0])
    v[0, 0, 2, :2] = torch.tensor([1e6, -460.0])
    assert e4(torch.tensor([1000.0, -1e6, 448.0, 449.0])).float().tolist() == [448.0, -448.0, 448.0, 448.0]
    out = fp8_attention_torch(q, k, v)
    assert torch.isfinite(out).all()
    clamped = [t.clamp(-448, 448) for t in (q, k, v)]
    assert torch.equal(out, fp8_attention_torch(*clamped))


def old_sdpa(q, k, v, scale):
    """transformer.Attention's attention call before attend (commit 1bc4cc3): enable_gqa SDPA, causal when Sq > 1."""
    gqa = q.shape[1] != k.shape[1]
    extra = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, **extra)


def softmax_attention(q, k, v, scale):
    """The textbook definition in float32: softmax(q k^T scale, causal when Sq > 1) v, kv heads repeat-interleaved."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    s = q.float() @ k.transpose(-1, -2) * scale
    Sq, S = s.shape[-2:]
    s = s.masked_fill(torch.ones(Sq, S, dtype=torch.bool).triu(S - Sq + 1), -math.inf)
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_bf16_and_fp8kv_are_their_definitions(dtype, Hkv):
    q, k, v = projections(2, 4, Hkv, 37, 32, dtype, seed=Hkv, q_mul=2.0)
    scale = 32 ** -0.5
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for Sq in (37, 1):
        qq = q[:, :, -Sq:]
        out = attention.attend(qq, k, v, "bf16", scale)
        assert out.dtype == dtype and torch.equal(out, old_sdpa(qq, k, v, scale))  # today's bits
        torch.testing.assert_close(out.float(), softmax_attention(qq, k, v, scale), **tol)
        k8, v8 = e4(k).to(dtype), e4(v).to(dtype)
        out = attention.attend(qq, k, v, "fp8kv", scale)
        assert torch.equal(out, old_sdpa(qq, k8, v8, scale))
        torch.testing.assert_close(out.float(), softmax_attention(qq, k8, v8, scale), **tol)
        assert not torch.equal(out, attention.attend(qq, k, v, "bf16", scale))


def test_attend_rejects_what_it_does_not_compute():
    q, k, v = projections(1, 4, 2, 8, 32)
    with pytest.raises(ValueError, match="recipe"):
        attention.attend(q, k, v, "fp16", 0.1)
    with pytest.raises(ValueError, match="Sq"):
        attention.attend(q[:, :, :3], k, v, "fp8", 0.1)
    with pytest.raises(ValueError, match="kv heads"):
        attention.attend(q[:, :3], k, v, "bf16", 0.1)


# ---------------------------------------------------------------------------------------------------------------
# the Triton kernel in Triton's interpreter (CPU)


def interpreter_cases() -> list[dict]:
    """Run in a process with TRITON_INTERPRET=1: the kernel on small shapes against the emulation (bf16 and float32
    inputs, GQA, short last tiles, the last-position pass, inputs beyond 448), with the interpreter's casts rounding
    as the GPU's."""
    assert os.environ.get("TRITON_INTERPRET") == "1"
    spec = importlib.util.spec_from_file_location("triton_interpret",
                                                  ROOT / "benchmarks/diagnostics/triton_interpret.py")
    helper = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helper)
    helper.round_as_the_gpu()
    _index_from_one_element_arrays()
    from poc.model.kernels import attn_fp8_triton

    rows = []
    cases = [("random", S, dtype) for S, dtype in ((5, torch.bfloat16), (130, torch.float32), (300, torch.bfloat16))]
    cases += [("beyond 448", 130, torch.bfloat16), ("robust", 300, torch.bfloat16)]
    for kind, S, dtype in cases:
        if kind != "robust":
            q, k, v = projections(1, 4, 2, S, 64, dtype, seed=S, q_mul=3.0)
            scale = 64 ** -0.5
            if kind == "beyond 448":  # clamped (cvt.rn.satfinite on sm_90 and torch 2.13 saturate as well)
                q[0, 1, 7, :3], k[0, 0, 100, 5:8], v[0, 1, 3, :2] = 1000.0, -3e4, 600.0
        else:
            q, k, v = robust_inputs(1, 4, 2, S, 64, dtype, seed=2)
            scale = UNIT_C
        ref = fp8_attention_torch(q, k, v, scale)
        out = attn_fp8_triton.attention(q, k, v, scale)
        last = attn_fp8_triton.attention(q[:, :, -1:], k, v, scale)
        # query tiles of 64 and 32 rows: the same key tiles in the same order for every row
        small = [attn_fp8_triton.attention(q, k, v, scale, config={"BLOCK_M": m, "num_warps": 4}) for m in (64, 32)]
        rows.append({"inputs": kind, "S": S, "dtype": str(dtype).removeprefix("torch."), **agreement(out, ref),
                     "last_is_last_row": torch.equal(last, out[:, :, -1:]),
                     "last_vs_emulation": agreement(last, ref[:, :, -1:])["differ"],
                     "small_tiles_same": all(torch.equal(o, out) for o in small)})
    return rows


def _index_from_one_element_arrays() -> None:
    """The interpreter holds scalars as one-element arrays and converts them to int with int(array), which numpy 2.4
    refuses for 1-d arrays (a loop bound computed in the kernel): read the element instead."""
    from triton.runtime import interpreter as interp

    patch = interp._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton (pip install triton; no GPU)")
def test_kernel_in_the_interpreter_is_the_emulation():
    """The kernel's masks, tile order, GQA rows, strides and last-position rows in Triton's interpreter: equal to the
    emulation except where the row sum's order (numpy's pairwise sum against the emulation's tree) moves l by an ulp
    and the output with it (float32: every such ulp shows; bf16: rarely, one ulp); the robust inputs bit for bit."""
    src = Path(attention.__file__).resolve().parents[2]  # the poc this test imported
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(src), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    code = "import json; from tests.test_attention import interpreter_cases; print(json.dumps(interpreter_cases()))"
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = json.loads(run.stdout.strip().splitlines()[-1])
    for r in rows:
        print(r)
        assert r["last_is_last_row"] and r["small_tiles_same"], r
        if r["inputs"] == "robust":
            assert r["differ"] == 0 and r["last_vs_emulation"] == 0, r
        elif r["dtype"] == "float32":  # every ulp of l shows: float32 rounding only
            assert r["max_rel"] <= 1e-6, r
        else:
            assert r["differ"] <= 1e-3 and r["max_rel"] <= 2 ** -8 and r["last_vs_emulation"] <= 0.05, r


# ---------------------------------------------------------------------------------------------------------------
# GPU


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs CUDA with FP8 tensor cores (capability 9+) and Triton")
@pytest.mark.parametrize("S", [1024, 300])
def test_cuda_kernel_is_the_emulation_at_the_minimax_shape(S):
    """bf16 at B=2, H=48, Hkv=8, D=128, scale 1/sqrt(128): the full pass and the last position. The kernel and the
    emulation differ by the GPU's dot accumulation and exp2 ulps, which flip an e4(448 p) now and then (one e4m3 step
    is 1/16 to 1/8 of a value), and by the MMA's accumulator in O (RANDOM_*: bounds from a CPU model of it)."""
    assert attention.use_kernel(torch.empty(1, 1, 1, 128, device="cuda", dtype=torch.bfloat16))  # attend runs it
    q, k, v = projections(2, 48, 8, S, 128, torch.bfloat16, seed=S, device="cuda")
    scale = 128 ** -0.5
    out = attention.attend(q, k, v, "fp8", scale)
    ref = fp8_attention_torch(q, k, v, scale)
    stats = agreement(out, ref)
    last = attention.attend(q[:, :, -1:], k, v, "fp8", scale)
    lstats, own = agreement(last, ref[:, :, -1:]), agreement(last, out[:, :, -1:])
    print(f"S {S}: full pass {stats}; last position {lstats}; last vs the full pass's last row {own}")
    for st in (stats, lstats):
        assert st["rms_rel"] < RANDOM_RMS and st["max_rel"] < RANDOM_MAX and st["differ"] < 0.5, st
    assert own["rms_rel"] < RANDOM_RMS, own  # the same per-row arithmetic (bitwise, where the MMA is row-blind)
    # a wrong recipe on these inputs lands far outside those bounds: fp8kv (Q and P unquantised)
    wrong = agreement(attention.attend(q, k, v, "fp8kv", scale), ref)
    assert wrong["rms_rel"] > 2 * RANDOM_RMS, wrong


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs CUDA with FP8 tensor cores (capability 9+) and Triton")
@pytest.mark.parametrize("S", [1024, 300])
def test_cuda_kernel_is_exact_where_no_rounding_boundary_is_near(S):
    """robust_inputs (c == 1, scores on a 1/8 grid, 448 p far from e4m3 boundaries): the kernel agrees with the
    emulation in all but a few elements (l's sum order and O x alpha, a few float32 ulps, reach a bf16 rounding
    boundary rarely; a 13-bit MMA accumulator in O more often: see ROBUST_*). Each counterfactual (tile order, no 448,
    unrounded P, GQA mapping), by the naive transcription on batch 0, lands far outside: the comparison can fail."""
    q, k, v = robust_inputs(2, 48, 8, S, 128, seed=S, device="cuda")
    ref = fp8_attention_torch(q, k, v, UNIT_C)
    out = attention.attend(q, k, v, "fp8", UNIT_C)
    stats = agreement(out, ref)
    last = agreement(attention.attend(q[:, :, -1:], k, v, "fp8", UNIT_C), ref[:, :, -1:])
    print(f"S {S} robust inputs: full pass {stats}, last position {last}")
    for st in (stats, last):
        assert st["differ"] <= ROBUST_DIFFER and st["rms_rel"] < ROBUST_RMS and st["max_rel"] < ROBUST_MAX, st
    # the counterfactuals, by the naive transcription on batch 0, heads 0-11 (kv heads 0 and 1): each far off
    b0 = [t[:1, :12] if i == 0 else t[:1, :2] for i, t in enumerate((q, k, v))]
    ref0 = fp8_attention_torch(*b0, UNIT_C)
    assert torch.equal(naive_fp8(*b0, UNIT_C), ref0)
    mine = agreement(out[:1, :12], ref0)
    for kw in COUNTERFACTUALS:
        wrong = agreement(naive_fp8(*b0, UNIT_C, **kw), ref0)
        print(f"  counterfactual {kw}: {wrong}")
        assert wrong["differ"] > 4 * ROBUST_DIFFER and wrong["rms_rel"] > max(5 * mine["rms_rel"], ROBUST_RMS), kw


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="needs CUDA with FP8 tensor cores (capability 9+) and Triton")
@pytest.mark.parametrize("S", [1024, 300])
def test_cuda_kernel_tile_configs_give_the_same_bits(S):
    """A query row's arithmetic does not depend on how many rows a program takes (the key tiles, their order and the
    row's reductions are the same): query tiles of 128 rows (two warp groups) and of 64 (one), at several pipeline
    depths, give the same output bits; a tile size that does not divide the key tile is refused."""
    from poc.model.kernels import attn_fp8_triton

    q, k, v = projections(2, 48, 8, S, 128, torch.bfloat16, seed=S + 1, device="cuda")
    scale = 128 ** -0.5
    want = attn_fp8_triton.attention(q, k, v, scale, config={"BLOCK_M": 128, "num_warps": 8, "num_stages": 3})
    for cfg in ({"BLOCK_M": 64, "num_warps": 4, "num_stages": 2}, {"BLOCK_M": 64, "num_warps": 4, "num_stages": 4},
                {"BLOCK_M": 128, "num_warps": 8, "num_stages": 2}, {}):
        assert torch.equal(attn_fp8_triton.attention(q, k, v, scale, config=cfg), want), cfg
        last = attn_fp8_triton.attention(q[:, :, -1:], k, v, scale, config=cfg)
        assert torch.equal(last, want[:, :, -1:]), cfg
    with pytest.raises(ValueError, match="BLOCK_M"):
        attn_fp8_triton.attention(q, k, v, scale, config={"BLOCK_M": 96})
