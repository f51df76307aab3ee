"""The MoE router's top-k: each token's k largest router probabilities and their experts.

On CUDA a Triton kernel (model/kernels/route_triton.py) that selects exactly what torch.topk selects there (the largest
values, ties at the k-th broken towards the lower expert index), registered as the custom op `poc::route_topk` so
that a compiled layer keeps it in its graph; on the CPU a stable descending sort (the same rule: torch.topk there
leaves equal values' order open). The order of the k within a token differs from torch's only among equal values: the
Qwen3-MoE block sums a token's k terms exactly (experts.combine) and renormalises them with an exact sum; MiniMax's
adds them in float32 in this order (experts.combine_weighted), so equal scores keep the lower expert first.

MiniMax-M2's router is a float32 GEMM (its gate is float32, its input the bfloat16 normed hidden state). `split3` and
`split_logits` compute it on the tensor cores with every product exact: the float32 gate as the sum of three bfloat16
parts, one bfloat16 GEMM with a float32 output (ModelOptions.router_gemm).
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


# ---------------------------------------------------------------------------------------------------------------
# MiniMax-M2's float32 router GEMM on the tensor cores (ModelOptions.router_gemm = split)


def split3(w: Tensor) -> Tensor:
    """A float32 matrix w (E, D) as three bfloat16 matrices stacked (3E, D) whose exact sum is w: hi = bf(w), mid =
    bf(w - hi), lo = w - hi - mid. float32's 24 significant bits are three runs of 8, each of them a bfloat16, and both
    differences are exact (each keeps w's own bits), so nothing of w is lost. A residual too small for bfloat16's
    subnormals (|lo| < 2^-133, for a weight below about 2^-110) would not split exactly: that is refused."""
    w = w.float()
    hi = w.to(torch.bfloat16)
    rest = w - hi.float()
    mid = rest.to(torch.bfloat16)
    rest = rest - mid.float()
    lo = rest.to(torch.bfloat16)
    if not torch.equal(lo.float(), rest):
        bad = int((lo.float() != rest).sum())
        raise ValueError(f"route.split3: {bad} router weights do not split exactly into three bfloat16 parts")
    return torch.cat([hi, mid, lo])


def split_logits(x: Tensor, parts: Tensor) -> Tensor:
    """x (T, D) bfloat16 times w^T, w (E, D) float32 given as split3's parts: (T, E) float32, a float32 GEMM
    computed on the tensor cores. Every product of a bfloat16 x and a part is exact (8 x 8 significant bits fit
    float32's 24); the products are summed in float32, on CUDA as one bfloat16 GEMM with a float32 output over the
    three parts (cuBLAS, tensor cores), elsewhere as a float32 GEMM of the same exact parts; then each token's three
    partial logits are added smallest first. What differs from a float32 FFMA GEMM is the accumulation: its order, and
    the tensor cores' float32 sums, which truncate where FFMA rounds (on an H200 at the router's shape the mean error
    against float64 is 2.8e-6 against FFMA's 7.7e-7, both far inside the float32 bound:
    benchmarks/diagnostics/router_gemm.py)."""
    E = parts.shape[0] // 3
    if x.is_cuda:
        z = torch.mm(x, parts.t(), out_dtype=torch.float32)  # (T, 3E)
    else:
        z = x.float() @ parts.float().t()
    return z[:, :E] + (z[:, E:2 * E] + z[:, 2 * E:])
