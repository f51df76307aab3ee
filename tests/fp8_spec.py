"""The W8A8 arithmetic of ../shared/spec/fp8-w8a8.md transcribed for the tests, independently of src/poc/model/fp8.py:
the quantiser in numpy float32, the linear and the MoE experts as float32 matmuls of the dequantised operands. Light
(torch and numpy only), so the gloo rank processes of tests/test_w8a8.py import it too."""

import math

import numpy as np
import torch

E4M3 = torch.float8_e4m3fn


def spec_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's per-token-group quantiser, transcribed: for each row and each 128 columns, in float32,
    amax = max(max|x|, 1e-10), scale = amax * (1/448), q = clamp(x / scale, -448, 448) rounded to e4m3 (RNE)."""
    xs = x.detach().float().cpu().numpy().astype(np.float32)
    M, K = xs.shape
    G = math.ceil(K / 128)
    q = np.zeros((M, K), np.float32)
    s = np.zeros((M, G), np.float32)
    inv = np.float32(1.0 / 448.0)
    for r in range(M):
        for g in range(G):
            grp = xs[r, g * 128:(g + 1) * 128]
            amax = np.maximum(np.abs(grp).max(), np.float32(1e-10)).astype(np.float32)
            scale = np.float32(amax * inv)
            q[r, g * 128:(g + 1) * 128] = np.clip(grp / scale, np.float32(-448), np.float32(448))
            s[r, g] = scale
    return torch.from_numpy(q).to(E4M3), torch.from_numpy(s)


def emu_linear(x, weight, scale_inv, bias=None, out_dtype=None):
    """The spec's W8A8 linear in float32: the input quantised by spec_quantize, both operands dequantised."""
    K = x.shape[-1]
    q, s = spec_quantize(x.reshape(-1, K))
    xd = q.float() * s.repeat_interleave(128, 1)[:, :K]
    y = xd @ _deq(weight, scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], weight.shape[0])


def _deq(w, s):
    R, C = w.shape
    return w.float() * s.float().repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]


def emu_experts(x, rows, k, ends, w13, s13, w2, s2, act, xq=None):
    """The spec's MoE experts: each routed token quantised, w13, SwiGLU, quantised again, w2; rows in expert order.
    (xq, the served path's quantised copy of x, is not read: the emulation quantises x itself.)"""
    out = torch.zeros(rows.numel(), x.shape[1], dtype=x.dtype)
    start = 0
    for j, stop in enumerate(ends.tolist()):
        if stop > start:
            xt = x[rows[start:stop] // k]
            h = emu_linear(xt, w13[j], s13[j])
            gate, up = h.chunk(2, dim=-1)
            out[start:stop] = emu_linear(torch.nn.functional.silu(gate) * up, w2[j], s2[j])
        start = stop
    return out, torch.arange(rows.numel())
