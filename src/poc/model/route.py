"""The MoE router's top-k: each token's k largest router probabilities and their experts.

On CUDA a Triton kernel (model/kernels/route_triton.py) that selects exactly what torch.topk selects there (the largest
values, ties at the k-th broken towards the lower expert index), registered as the custom op `poc::route_topk` so
that a compiled layer keeps it in its graph; on the CPU a stable descending sort (the same rule: torch.topk there
leaves equal values' order open). The order of the k within a token differs from torch's only among equal values: the
Qwen3-MoE block sums a token's k terms exactly (experts.combine) and renormalises them with an exact sum; MiniMax's
adds them in float32 in this order (experts.combine_weighted), so equal scores keep the lower expert first.
"""

from __future__ import annotations

import torch
from torch import Tensor

_KERNELS: list = []  # [route_triton, or None without Triton], resolved once


def kernels():
    """The CUDA kernels (model/kernels/route_triton.py), or None where Triton is missing (CPU builds of torch)."""
    if not _KERNELS:
        try:
            from poc.model.kernels import route_triton
        except ImportError:
            route_triton = None
        _KERNELS.append(route_triton)
    return _KERNELS[0]


@torch.library.custom_op("poc::route_topk", mutates_args=())
def _route_topk(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    kern = kernels() if probs.is_cuda else None
    if kern is None:
        return torch.topk(probs, k, dim=-1)
    return kern.topk(probs, k)


@_route_topk.register_fake
def _(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    shape = (*probs.shape[:-1], k)
    return probs.new_empty(shape), probs.new_empty(shape, dtype=torch.int64)


def topk(probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(weights, experts), each (T, k): the k largest of each row of probs (T, E) float32 and their indices, largest
    first, ties to the lower expert index (the CUDA kernel's and torch.topk's rule there; elsewhere a stable sort,
    since the CPU's torch.topk leaves the order of equal values open)."""
    if probs.is_cuda and probs.dim() == 2 and probs.dtype == torch.float32:
        return torch.ops.poc.route_topk(probs, k)
    if probs.is_cuda:
        return torch.topk(probs, k, dim=-1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    return vals[..., :k], idx[..., :k]


def split_bf16(w: Tensor) -> Tensor:
    """A float32 matrix w (E, D) as three bfloat16 matrices stacked (3E, D) whose sum hi + mid + lo is w exactly:
    hi is w rounded to bf16's 8 significant bits, mid the remainder (at most 16 bits, a multiple of w's ulp) rounded
    to 8, lo what is left (at most 7 bits), so nothing is lost for any normal float32 (bf16 has float32's exponent
    range). The float32 router's GEMM then runs on 16-bit tensor cores (router_logits)."""
    w = w.float()
    hi = w.bfloat16()
    r = w - hi.float()  # exact: w and hi share the binade's grid
    mid = r.bfloat16()
    lo = (r - mid.float()).bfloat16()  # exact in bf16 (checked by tests/test_route.py)
    return torch.cat([hi, mid, lo])


@torch.library.custom_op("poc::router_logits", mutates_args=())
def _router_logits(x: Tensor, w3: Tensor) -> Tensor:
    e = w3.shape[0] // 3
    if x.is_cuda:  # bf16 x bf16 products are exact in float32; cuBLAS accumulates them in float32
        y = torch.mm(x, w3.t(), out_dtype=torch.float32)
    else:  # the same arithmetic where mm has no out_dtype: the 16-bit operands widened exactly
        y = x.float() @ w3.float().t()
    return (y[:, :e] + y[:, e:2 * e]) + y[:, 2 * e:]


@_router_logits.register_fake
def _(x: Tensor, w3: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], w3.shape[0] // 3), dtype=torch.float32)


def router_logits(x: Tensor, w3: Tensor) -> Tensor:
    """x (T, D) bfloat16 times the float32 router w (E, D) given as split_bf16(w), in float32 (T, E): every product
    x_i * w_ij exact (as a float32 GEMM's) and summed in float32, three partial GEMMs (hi, mid, lo terms) added
    largest first. As precise as a float32 x float32 GEMM of the widened x (which differs from this one, as two
    float32 GEMMs do, only in the order of its float32 sums), on a GPU's tensor cores instead of its FFMA units and
    without a float32 copy of x."""
    return torch.ops.poc.router_logits(x, w3)
