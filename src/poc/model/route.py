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
