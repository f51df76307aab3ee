"""Causal attention softmax(q k^T * scale) v in the recipes the network's validators compute (placeholder: replaced by
the attn-fp8 branch's module, which adds the CUDA kernel)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from poc.errors import InputError

RECIPES = ("fp8", "fp8kv", "bf16")
E4M3 = torch.float8_e4m3fn
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


def check_recipe(recipe: str) -> str:
    if recipe not in RECIPES:
        raise InputError(f"attention recipe must be one of {', '.join(RECIPES)}, got {recipe!r}", "attention")
    return recipe


def e4(x: Tensor) -> Tensor:
    return x.float().clamp(-448.0, 448.0).to(E4M3)


@torch.compiler.disable
def attend(q: Tensor, k: Tensor, v: Tensor, recipe: str, scale: float) -> Tensor:
    if recipe == "fp8kv":
        k, v = e4(k).to(k.dtype), e4(v).to(v.dtype)
    if recipe in ("bf16", "fp8kv"):
        return _sdpa(q, k, v, q.shape[2] > 1, scale)
    return fp8_attention_torch(q, k, v)


def _sdpa(q, k, v, causal, scale):
    gqa = q.shape[1] != k.shape[1]
    if gqa and not _SDPA_HAS_GQA:
        n_rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
    extra = {"enable_gqa": True} if gqa and _SDPA_HAS_GQA else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **extra)


def fp8_attention_torch(q: Tensor, k: Tensor, v: Tensor, tile: int = 128) -> Tensor:
    B, H, Sq, D = q.shape
    S = k.shape[2]
    rep = H // k.shape[1]
    q8, k8, v8 = e4(q).float(), e4(k).float().repeat_interleave(rep, 1), e4(v).float().repeat_interleave(rep, 1)
    c = math.log2(math.e) / math.sqrt(D)
    pos = torch.arange(S - Sq, S)
    out = torch.empty(B, H, Sq, D, dtype=torch.float32)
    for r0 in range(0, Sq, tile):
        rows = pos[r0:r0 + tile]
        qt = q8[:, :, r0:r0 + tile]
        m = torch.full((B, H, len(rows), 1), -math.inf)
        l = torch.zeros(B, H, len(rows), 1)
        o = torch.zeros(B, H, len(rows), D)
        diag = int(rows[0]) // tile if Sq > 1 else (S - 1) // tile
        for j in range(diag, -1, -1):
            keys = torch.arange(j * tile, min(S, (j + 1) * tile))
            s = qt @ k8[:, :, keys].transpose(-1, -2)
            s = s.masked_fill(keys[None, :] > rows[:, None], -math.inf)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            alpha = torch.exp2((m - m_new) * c)
            p = torch.exp2(s * c - m_new * c)
            l = l * alpha + p.sum(-1, keepdim=True)
            o = o * alpha + (448.0 * p).to(E4M3).float() @ v8[:, :, keys]
            m = m_new
        out[:, :, r0:r0 + tile] = o / (448.0 * l)
    return out.to(q.dtype)
