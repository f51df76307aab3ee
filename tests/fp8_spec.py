"""The W8A8 arithmetic of ../shared/spec/fp8-w8a8.md transcribed for the tests, independently of src/poc/model/fp8.py:
the quantiser in numpy float32 (float32 scales, or UE8M0's power-of-two scales computed in float64 with math.log2),
the UE8M0 re-quantisation of a dense weight per 128x128 block, and the linear and the MoE experts as float32 matmuls
of the dequantised operands. Light (torch and numpy only), so the gloo rank processes of tests/test_w8a8.py import it
too."""

import math

import numpy as np
import torch

E4M3 = torch.float8_e4m3fn


def _pow2_ceil(y: float) -> np.float32:
    """2^ceil(log2(y)) in float64 (y > 0): log2 is exact at powers of two, and a quotient a few float32 ulps above
    one is far above float64's rounding, so this is the exact smallest power of two >= y."""
    return np.float32(2.0 ** math.ceil(math.log2(y)))


def spec_quantize(x: torch.Tensor, ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's per-token-group quantiser, transcribed: for each row and each 128 columns, in float32,
    amax = max(max|x|, 1e-10); scale = amax * (1/448), or with ue8m0 scale = 2^ceil(log2(amax / 448));
    q = clamp(x / scale, -448, 448) rounded to e4m3 (RNE)."""
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
            scale = _pow2_ceil(float(amax) / 448.0) if ue8m0 else np.float32(amax * inv)
            q[r, g * 128:(g + 1) * 128] = np.clip(grp / scale, np.float32(-448), np.float32(448))
            s[r, g] = scale
    return torch.from_numpy(q).to(E4M3), torch.from_numpy(s)


def spec_requant(w: torch.Tensor, scale_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The UE8M0 re-quantisation of a dense FP8 weight, transcribed: per 128x128 block (edge blocks: their own
    values), w = fp32(w8) * s in float32, amax = max(max|w|, 1e-4), e = ceil(log2(amax / 448)),
    w8' = RNE_e4m3(w * 2^-e), new scale 2^e."""
    wf = w.float().numpy()
    sv = scale_inv.float().numpy()
    R, C = wf.shape
    q = np.zeros((R, C), np.float32)
    s = np.zeros(sv.shape, np.float32)
    for i in range(sv.shape[0]):
        for j in range(sv.shape[1]):
            blk = (wf[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] * sv[i, j]).astype(np.float32)
            amax = max(float(np.abs(blk).max()), float(np.float32(1e-4)))
            scale = _pow2_ceil(amax / 448.0)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = blk / scale
            s[i, j] = scale
    return torch.from_numpy(q).to(E4M3), torch.from_numpy(s)


def _deq(w, s):
    R, C = w.shape
    return w.float() * s.float().repeat_interleave(128, 0)[:R].repeat_interleave(128, 1)[:, :C]


def _linear(x, weight, scale_inv, bias, out_dtype, ue8m0):
    K = x.shape[-1]
    q, s = spec_quantize(x.reshape(-1, K), ue8m0)
    xd = q.float() * s.repeat_interleave(128, 1)[:, :K]
    y = xd @ _deq(weight, scale_inv).t()
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).view(*x.shape[:-1], weight.shape[0])


def emu_linear(x, weight, scale_inv, bias=None, out_dtype=None, ue8m0=False):
    """The spec's W8A8 linear in float32 on the weight it is given: the input quantised by spec_quantize (with the
    module's scale format), both operands dequantised."""
    return _linear(x, weight, scale_inv, bias, out_dtype, ue8m0)


def emu_experts(x, rows, k, ends, w13, s13, w2, s2, act, xq=None, ue8m0=False):
    """The spec's MoE experts: each routed token quantised, w13, SwiGLU, quantised again, w2; rows in expert order;
    the checkpoint's expert weights and scales in both formats. (xq, the served path's quantised copy of x, is not
    read: the emulation quantises x itself.)"""
    out = torch.zeros(rows.numel(), x.shape[1], dtype=x.dtype)
    start = 0
    for j, stop in enumerate(ends.tolist()):
        if stop > start:
            xt = x[rows[start:stop] // k]
            h = _linear(xt, w13[j], s13[j], None, None, ue8m0)
            gate, up = h.chunk(2, dim=-1)
            out[start:stop] = _linear(torch.nn.functional.silu(gate) * up, w2[j], s2[j], None, None, ue8m0)
        start = stop
    return out, torch.arange(rows.numel())


def emulation(fmt: str):
    """(linear, experts) replacing fp8.linear and experts.grouped_w8a8 with the spec's arithmetic in scale format fmt,
    whatever the model was loaded with: meant for a model loaded in the float32 format (the checkpoint's weights),
    whose dense weights the UE8M0 emulation re-quantises itself (spec_requant, once per weight)."""
    ue8m0 = fmt == "ue8m0"
    cache: dict = {}

    def linear(x, weight, scale_inv, bias=None, out_dtype=None, *_):
        if ue8m0:
            key = (weight.data_ptr(), tuple(weight.shape))
            if key not in cache:
                cache[key] = spec_requant(weight, scale_inv)
            weight, scale_inv = cache[key]
        return _linear(x, weight, scale_inv, bias, out_dtype, ue8m0)

    def experts(x, rows, k, ends, w13, s13, w2, s2, act, xq=None, **_):
        return emu_experts(x, rows, k, ends, w13, s13, w2, s2, act, None, ue8m0)

    return linear, experts
