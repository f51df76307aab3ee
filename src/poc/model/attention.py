"""Causal self-attention after RoPE, in the recipes the network's validators have run (`../shared/spec/minimax-m2.md`
step 6). One home for the attention call: `transformer.Attention` projects, normalises and rotates, then calls
`attend`.

- `bf16`: plain attention in the model dtype (`F.scaled_dot_product_attention`, the served path today);
- `fp8kv`: the vLLM 0.20-era H100 form: Q in the model dtype, K and V rounded to float8_e4m3fn (the fp8 KV cache,
  scale 1) and read back exactly, then the same SDPA;
- `fp8`: vLLM 0.25 on Hopper (FlashInfer's FA3 FP8 prefill): Q, K, V all e4m3, P quantised as e4(448 p), key tiles
  of 128 visited from the diagonal back to the first. On Hopper a Triton kernel (`kernels/attn_fp8_triton.py`),
  elsewhere `fp8_attention_torch`, the recipe in plain torch ops (the CPU path and the GPU tests' reference).

Shapes: q (B, H, Sq, D), k and v (B, Hkv, S, D), any strides; query head h reads kv head h // (H // Hkv). Sq == S is
the causal pass, Sq == 1 the last position alone (it sees every key).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from poc.model.options import ATTENTIONS

RECIPES = tuple(a for a in ATTENTIONS if a != "auto")  # the recipes' names, written once (ModelOptions.attention)
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3: the clamp of e4() and the factor P is scaled by before its rounding
TILE = 128  # the fp8 recipe's query and key tile (rows and keys)

# enable_gqa arrived in torch 2.5; before that the kv heads are repeated by hand
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


@torch.compiler.disable
def attend(q: Tensor, k: Tensor, v: Tensor, recipe: str, scale: float) -> Tensor:
    """Attention output (B, H, Sq, D) in q's dtype by `recipe` (RECIPES), scores scaled by `scale`. Always run as
    eager PyTorch runs it: a compiled graph around it must not re-lower attention with different rounding."""
    B, H, Sq, D = q.shape
    S = k.shape[2]
    if Sq not in (S, 1):
        raise ValueError(f"attend takes the causal pass (Sq == S) or the last position (Sq == 1), got Sq {Sq}, S {S}")
    if H % k.shape[1]:
        raise ValueError(f"{H} query heads are not a multiple of {k.shape[1]} kv heads")
    if recipe == "bf16":
        return _sdpa(q, k, v, scale)
    if recipe == "fp8kv":
        return _sdpa(q, e4(k).to(k.dtype), e4(v).to(v.dtype), scale)
    if recipe == "fp8":
        if use_kernel(q):
            return kernels().attention(q, k, v, scale)
        return fp8_attention_torch(q, k, v, scale)
    raise ValueError(f"attention recipe must be one of {RECIPES}, got {recipe!r}")


def _sdpa(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """SDPA (flash/memory-efficient on CUDA, math on the CPU): causal when Sq > 1; a single last query sees every key
    (SDPA's causal mask is top-left aligned, so no mask)."""
    extra = {}
    if q.shape[1] != k.shape[1]:
        if _SDPA_HAS_GQA:
            extra = {"enable_gqa": True}
        else:  # kv head j serves query heads j*n_rep ... j*n_rep + n_rep - 1: repeat_interleave, not a tile
            n_rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=q.shape[2] > 1, scale=scale, **extra)


def e4(x: Tensor) -> Tensor:
    """x clamped to [-448, 448] and rounded to nearest even float8_e4m3fn (the recipe's e4; float32 first, exact from
    any 16-bit dtype)."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(FP8)


def log2e_scale(scale: float) -> float:
    """c = log2(e) * scale rounded once to float32 (as a Python float): the exponent's factor in both the kernel and
    the emulation, so that they start from the same number."""
    return float(torch.tensor(math.log2(math.e) * scale, dtype=torch.float32))


def fp8_attention_torch(q: Tensor, k: Tensor, v: Tensor, scale: float | None = None) -> Tensor:
    """The fp8 recipe in torch ops, vectorised over batch and heads, looping over tiles: per query tile of 128 rows
    (absolute positions), key tiles from the diagonal back to 0; S = Q8 K8^T, running max m of S, alpha =
    exp2((m_old - m_new) c) rescales l and O, p = exp2(S c - m c), l = l alpha + rowsum(p), O = O alpha + e4(448 p) V8;
    out = O / (448 l) in q's dtype. scale defaults to 1/sqrt(D).

    Every step is one correctly rounded float32 operation, so the result depends on no library's evaluation order:
    the dots are exact in float64 (an e4m3 product is a multiple of 2^-18 below 2^18: 128 of them sum exactly in 53
    bits) and rounded once; exp2 is evaluated in float64 and rounded once; a row of p is summed in a fixed pairwise
    tree (element j + element j + 64, then + 32, ...). A GPU differs from this only where the recipe leaves things
    open: accumulation order inside a dot, exp2 ulps, an FMA in S c - m c."""
    B, H, Sq, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    rep = H // Hkv
    c = log2e_scale(1 / math.sqrt(D) if scale is None else scale)
    first = S - Sq  # position of query row 0
    q8 = e4(q).view(B, Hkv, rep, Sq, D)  # (B, H, Sq, D) -> (B, Hkv, rep, Sq, D): head h = kv head h // rep
    k8, v8 = e4(k), e4(v)
    out = q.new_empty(B, Hkv, rep, Sq, D)
    for i in range(first // TILE, -(-S // TILE)):
        r0, r1 = max(TILE * i, first) - first, min(TILE * (i + 1), S) - first  # q rows of query tile i
        n = r1 - r0
        qi = q8[:, :, :, r0:r1].double().reshape(B, Hkv, rep * n, D)  # every head of a kv head: one matmul
        qpos = torch.arange(r0 + first, r1 + first, device=q.device)
        m = torch.full((B, Hkv, rep, n), -math.inf, device=q.device)
        l = torch.zeros(B, Hkv, rep, n, device=q.device)
        o = torch.zeros(B, Hkv, rep, n, D, device=q.device)
        for j in range(i, -1, -1):  # the diagonal tile first, back to tile 0
            k0, k1 = TILE * j, min(TILE * (j + 1), S)
            s = (qi @ k8[:, :, k0:k1].double().transpose(-1, -2)).float().view(B, Hkv, rep, n, k1 - k0)
            if k1 - k0 < TILE:  # a short last tile: the missing keys are masked keys
                s = F.pad(s, (0, TILE - (k1 - k0)), value=-math.inf)
            if j == i:
                kpos = torch.arange(k0, k0 + TILE, device=q.device)
                s = s.masked_fill(kpos[None, :] > qpos[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1))
            alpha = _exp2((m - m_new) * c)
            p = _exp2(s * c - (m_new * c)[..., None])
            l = l * alpha + _tree_sum(p)
            pv = e4(FP8_MAX * p)[..., :k1 - k0].double() @ v8[:, :, None, k0:k1].double()
            o = o * alpha[..., None] + pv.float()
            m = m_new
        out[:, :, :, r0:r1] = (o / (FP8_MAX * l)[..., None]).to(q.dtype)
    return out.view(B, H, Sq, D)


def _exp2(x: Tensor) -> Tensor:
    """2^x for float32 x, correctly rounded to float32 (float64 evaluation, one rounding): the same bits whatever path
    (vectorised or scalar) the library takes for an element."""
    return torch.exp2(x.double()).float()


def _tree_sum(p: Tensor) -> Tensor:
    """The last dimension (a power of two) summed in float32 in a fixed pairwise order: halves added, repeatedly."""
    while p.shape[-1] > 1:
        h = p.shape[-1] // 2
        p = p[..., :h] + p[..., h:]
    return p[..., 0]


_TRITON: list = []  # [the attn_fp8_triton module, or None without Triton], resolved once


def kernels():
    """The CUDA kernel (model/kernels/attn_fp8_triton.py), or None where Triton is missing (CPU builds of torch)."""
    if not _TRITON:
        try:
            from poc.model.kernels import attn_fp8_triton
        except ImportError:
            attn_fp8_triton = None
        _TRITON.append(attn_fp8_triton)
    return _TRITON[0]


def use_kernel(q: Tensor) -> bool:
    """The Triton kernel: CUDA, 16-bit model dtype, FP8 tensor cores (capability 9 or newer), a head size it tiles."""
    if not q.is_cuda or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if q.shape[-1] not in (32, 64, 128):  # 256: O alone (128 x 256 float32) would fill the registers
        return False
    if torch.cuda.get_device_capability(q.device)[0] < 9:
        return False
    return kernels() is not None
