"""The model's exact arithmetic: sums whose bits do not depend on the reduction order, and half-precision
elementwise ops that round where eager PyTorch rounds.

Eager PyTorch and a compiled graph (inductor, Triton) must compute the same bits (`compile.py`), and the served
dtype must round as the reference's plain tensor ops do. A bf16/fp16 op computes in fp32 and rounds its output once;
`mul` and `add` are written as plain ops in the model dtype, so a compiled graph keeps each op's rounding (inductor's
emulate_precision_casts rounds the output of every low-precision op, inside fused kernels too). An explicit
x.to(bf16).float() is avoided: older inductors fold that chain into x.float() and lose the rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sum_exact(t: Tensor) -> Tensor:
    """Sum along the last dim (keepdim) accumulated in float64, returned in float32.

    The terms here are squares or products of bf16/fp16 values (at most 22 significant bits), so their float64 sum is
    exact for any realistic spread of magnitudes: every reduction order gives the same bits. Eager PyTorch and a
    compiled graph (Triton's reduction tree) therefore agree exactly, where a float32 sum differs in the last bit
    for about a third of the rows and the model's chaotic depth amplifies that. For float32 models it is simply a
    more accurate sum. The float64 -> float32 rounding is written out so both paths round the same way."""
    return t.double().sum(-1, keepdim=True).float()


def mul(a: Tensor, b: Tensor) -> Tensor:
    """a * b in a's dtype (computed in fp32, rounded once)."""
    return a * b if a.dtype == b.dtype else (a.float() * b.float()).to(a.dtype)


def add(a: Tensor, b: Tensor) -> Tensor:
    """a + b in a's dtype (computed in fp32, rounded once)."""
    return a + b if a.dtype == b.dtype else (a.float() + b.float()).to(a.dtype)


def softmax(z: Tensor) -> Tensor:
    """Softmax over the last dim, written out (max, exp, exact sum, one division) so that eager PyTorch and a
    compiled graph compute the same bits: a fused softmax kernel and Triton's sum differ in the order they add."""
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / sum_exact(e)


def sigmoid(z: Tensor) -> Tensor:
    """1 / (1 + exp(-z)), written out (the validators' formula) so that eager PyTorch and a compiled graph compute
    the same bits: each op rounds in z's dtype."""
    return 1 / (1 + torch.exp(-z))


def reflect(x: Tensor, v: Tensor) -> Tensor:
    """Householder reflection x - 2 (x.v) v along the last dim, in x's dtype (v a unit vector of that dtype),
    rounding as the reference's plain tensor ops do: x*v, the sum, 2*dot*v and the difference."""
    dot = sum_exact(mul(x, v)).to(x.dtype)
    return x - mul(dot * 2, v)
