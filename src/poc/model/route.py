"""The MoE block's routing steps, with their CUDA kernels (model/route_triton.py) behind one rule each.

- `topk`: each token's k largest router probabilities. On CUDA a Triton kernel that selects exactly what
  torch.topk selects there (the largest values, ties at the k-th broken towards the lower expert index), registered
  as the custom op `poc::route_topk` so that a compiled layer keeps it in its graph; elsewhere torch.topk. The
  order of the k within a token differs only among equal values and changes nothing downstream: the block sums a
  token's k terms exactly (transformer._combine) and renormalises with an exact sum.
- `slot_layout`: the padded expert layout of fp8.padded_layout, per (token, choice) slot. On CUDA three small
  kernels and no host sync; elsewhere the stable sort and fp8.padded_layout. Both give the same rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

_KERNELS: list = []  # [route_triton, or None without Triton], resolved once


def kernels():
    """The CUDA kernels (model/route_triton.py), or None where Triton is missing (CPU builds of torch)."""
    if not _KERNELS:
        try:
            from poc.model import route_triton
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
    """(weights, experts), each (T, k): the k largest of each row of probs (T, E) float32 and their indices."""
    if probs.is_cuda and probs.dim() == 2 and probs.dtype == torch.float32:
        return torch.ops.poc.route_topk(probs, k)
    return torch.topk(probs, k, dim=-1)


def slot_layout(key: Tensor, n_experts: int, k: int, group_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """The padded expert layout (each expert's rows padded to a multiple of group_rows) of the routed slots.

    key (T*k,) int64: each (token, choice) slot's expert; a value outside 0..n_experts-1 is not served here.
    Returns (slot (T*k,) int64: the slot's row, n_rows for a slot not served here; tile_expert (n_rows /
    group_rows,) int32: each row tile's expert, n_experts past the last group; a_rows (n_rows,) int32: each row's
    token, -1 for a padding row). Within an expert the rows keep the slots' order. n_rows = ceil(T*k /
    group_rows) * group_rows + n_experts * group_rows, known without a host sync."""
    kern = kernels() if key.is_cuda else None
    if kern is not None:
        return kern.slot_layout(key, n_experts, k, group_rows)
    return slot_layout_torch(key, n_experts, k, group_rows)


def slot_layout_torch(key: Tensor, n_experts: int, k: int, group_rows: int) -> tuple[Tensor, Tensor, Tensor]:
    """slot_layout from a stable sort of the slots by expert and fp8.padded_layout (the reference of the kernels)."""
    from poc.model import fp8

    if group_rows != fp8.GROUP_ROWS:
        raise ValueError(f"slot_layout_torch: group_rows {group_rows} != fp8.GROUP_ROWS {fp8.GROUP_ROWS}")
    mine = (key >= 0) & (key < n_experts)
    key = torch.where(mine, key, n_experts)
    rows = key.argsort(stable=True)
    ends = torch.searchsorted(key[rows], torch.arange(1, n_experts + 1, device=key.device))
    n = int(ends[-1]) if n_experts else 0
    # the bound on the rows counts every slot, served here or not: the kernels' n_rows
    dest, tile_expert, a_rows = fp8.padded_layout(rows[:n], k, ends, n_slots=key.numel())
    slot = torch.full((key.numel(),), a_rows.numel(), dtype=torch.int64, device=key.device)
    slot[rows[:n]] = dest
    return slot, tile_expert, a_rows
