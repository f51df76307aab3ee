"""Block-FP8 checkpoints computed as the network's validators compute them: W8A8 (`../shared/spec/fp8-w8a8.md`).

A Qwen FP8 checkpoint holds float8_e4m3fn weights with one float32 `weight_scale_inv` per 128x128 block. The gonka
vLLM fork does not dequantise them: every FP8 linear (q/k/v/o, dense MLPs) and both expert GEMMs quantise their input
per token per 128 columns and multiply FP8 by FP8 with float32 accumulation. Two scale formats
(ModelOptions.fp8_scales, POC_FP8_SCALES): `ue8m0`, the default, what vLLM computes on Hopper and Blackwell with
DeepGEMM (power-of-two activation scales everywhere, the dense linears' weights re-quantised once at load to
power-of-two block scales: `use_scales`); `float32`, the spec's float32-scale recipe (scale = amax * (1/448), the
checkpoint's weights). This module is that recipe:

- `quantize_act`: the per-token-group activation quantiser, bit for bit the spec's formula in either scale format (a
  Triton kernel on CUDA, `kernels/fp8_triton.py`, plain torch ops elsewhere);
- `requant_ue8m0`: the load-time re-quantisation of a dense FP8 weight to power-of-two 128x128 block scales;
- `fp8_mm` / `fp8_grouped_mm`: block-scaled FP8 x FP8 GEMMs, on the FP8 tensor cores through `torch._scaled_mm` on
  Hopper or newer, elsewhere an exact emulation (dequantise both operands, float32 matmul, one rounding);
- `Fp8Linear`: the module the loader puts where the checkpoint has an FP8 linear (`use_fp8_linears`), with the
  checkpoint's parameter names (`weight`, `weight_scale_inv`), so loading stays a name match;
- `norm_quant`: a norm whose readers are FP8 linears hands them its output already quantised (`Quantized`); the
  residual add, the norm and the quantiser are one kernel on CUDA (the Block's `fused_norm`, ModelOptions.fused_norm);
- `kernels()`: the CUDA kernels of `kernels/fp8_triton.py`. The MoE experts' W8A8 GEMMs, which use these pieces, are
  `experts.grouped_w8a8`.

The router, norms and embeddings are not quantised. ModelOptions.fp8 "dequant" (POC_FP8=dequant) keeps the older
forward: weights dequantised to the model dtype, bf16 activations; it is a different arithmetic, kept for diagnosis.
`diagnostic_emulation` is a process-wide switch of these kernels for diagnostics alone (the float32 emulation on CUDA,
or the dequantised forward on a W8A8 model's weights); the served path never sets it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from poc.model.options import Fp8Scales

GROUP = 128  # activation group (columns) and weight block (rows and columns) of Qwen's FP8 checkpoints
FP8_MAX = 448.0  # largest finite float8_e4m3fn
EPS = 1e-10  # floor of a group's amax (an all-zero group gets scale eps/448, its values quantise to 0)
FP8 = torch.float8_e4m3fn
WEIGHT_EPS = 1e-4  # floor of a weight block's amax in the UE8M0 re-quantisation

log = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


EMULATIONS = ("off", "float32", "dequantised")
_EMULATION = ["off"]  # process-wide: a diagnosis runs one model at a time


@contextmanager
def diagnostic_emulation(mode: str) -> Iterator[None]:
    """A diagnostic switch of the kernels, process-wide, for diagnostics and the GPU accuracy tests only (the served
    path never sets it): on a W8A8 model, `float32` computes every FP8 GEMM by the float32 emulation and quantises with
    plain torch ops, even on CUDA; `dequantised` computes the dequantise forward on the same weights (no activation
    quantisation; not ModelOptions.fp8, which chooses how a checkpoint is loaded); `off` (the default) is the served
    path."""
    if mode not in EMULATIONS:
        raise ValueError(f"diagnostic emulation must be one of {EMULATIONS}, got {mode!r}")
    prev, _EMULATION[0] = _EMULATION[0], mode
    try:
        yield
    finally:
        _EMULATION[0] = prev


def emulation() -> str:
    """The diagnostic emulation in force (diagnostic_emulation): off, float32 or dequantised."""
    return _EMULATION[0]


# ---------------------------------------------------------------------------------------------------------------
# activation quantisation


def quantize_act(x: Tensor, width: int | None = None, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """x (M, K) in any float dtype -> (q (M, K) float8_e4m3fn, s (M, ceil(K/128)) float32), per row and 128-column
    group: amax = max(max|x|, 1e-10); s = amax * (1/448), or with ue8m0 the smallest power of two >= amax / 448
    (pow2_ceil: 2^ceil(log2(amax / 448)) exactly); q = clamp(x / s, -448, 448) rounded to nearest even.
    The last group of a width that is not a multiple of 128 is the columns left. On CUDA s comes column-major
    (s.t() contiguous), the layout the block-scaled GEMM takes. width: q is that wide, the columns past K zero (zero
    groups add nothing to a GEMM: an operand padded for the tensor cores' alignment)."""
    if x.dim() != 2:
        raise ValueError(f"quantize_act takes (M, K), got {tuple(x.shape)}")
    if x.is_cuda and _EMULATION[0] == "off" and kernels() is not None and x.shape[0] > 0:
        return kernels().quantize(x, width or x.shape[1], ld_align=LD_ALIGN, ue8m0=ue8m0)
    if width and width > x.shape[1]:
        x = F.pad(x, (0, width - x.shape[1]))
    return quantize_act_torch(x, ue8m0)


def quantize_act_torch(x: Tensor, ue8m0: bool = False) -> tuple[Tensor, Tensor]:
    """The formula in plain torch ops (float32 throughout; IEEE division on every backend)."""
    M, K = x.shape
    G = cdiv(K, GROUP)
    xf = x.float()
    if G * GROUP != K:  # zero columns change no amax (amax >= eps > 0) and are cut from q
        xf = F.pad(xf, (0, G * GROUP - K))
    xg = xf.view(M, G, GROUP)
    amax = xg.abs().amax(-1).clamp(min=EPS)  # (M, G)
    s = pow2_ceil(_div448(amax)) if ue8m0 else amax * (1.0 / FP8_MAX)
    q = (xg / s[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(M, G * GROUP)[:, :K]
    return q.contiguous(), s


def _div448(t: Tensor) -> Tensor:
    """t / 448 as IEEE float32 division (a Python-scalar divisor may become a product with its reciprocal on CUDA,
    which can round differently: the divisor is a tensor here)."""
    return t / torch.full((), FP8_MAX, dtype=torch.float32, device=t.device)


def pow2_ceil(y: Tensor) -> Tensor:
    """The smallest power of two >= y, for positive normal float32 y: read off the bits (the exponent, plus one
    where the mantissa is not zero), so exact where a float log2 rounds (log2 of a value a few ulps above a power of
    two can round down to the integer). y = fl(amax / 448) is a power of two exactly when amax / 448 is (amax holds
    24 significant bits and 448 = 7 * 64), so this is 2^ceil(log2(amax / 448)) of the exact quotient."""
    bits = y.view(torch.int32)
    e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (e << 23).view(torch.float32)


def requant_ue8m0(w: Tensor, scale_inv: Tensor) -> tuple[Tensor, Tensor]:
    """A dense FP8 weight (R, C) with its block scales (ceil(R/128), ceil(C/128)) re-quantised to power-of-two block
    scales, as vLLM does once at load for its DeepGEMM linears: per 128x128 block, w = fp32(w8) * s,
    amax = max(max|w|, 1e-4), e = ceil(log2(amax / 448)), w8' = RNE_e4m3(w * 2^-e), scale 2^e (exact: a power of two).
    Edge blocks count only their own values. Blocks are independent, so re-quantising a tensor-parallel shard cut on
    128-blocks gives that shard of the whole tensor's result."""
    R, C = w.shape
    Rb, Cb = cdiv(R, GROUP), cdiv(C, GROUP)
    if tuple(scale_inv.shape) != (Rb, Cb):
        raise ValueError(f"requant_ue8m0: scales {tuple(scale_inv.shape)} for a {R}x{C} weight")
    wf = _dequantize_blocks(w, scale_inv, torch.float32)  # fp32(w8) * s, one rounding (as dequantize_blocks)
    wf = F.pad(wf, (0, Cb * GROUP - C, 0, Rb * GROUP - R)).view(Rb, GROUP, Cb, GROUP)
    amax = wf.abs().amax(dim=(1, 3)).clamp(min=WEIGHT_EPS)  # (Rb, Cb)
    s = pow2_ceil(_div448(amax))
    q = (wf / s[:, None, :, None]).to(FP8).view(Rb * GROUP, Cb * GROUP)[:R, :C]
    return q.contiguous(), s


_TRITON: list = []  # [the fp8_triton module, or None without Triton], resolved once


def kernels():
    """The CUDA kernels (model/kernels/fp8_triton.py), or None where Triton is missing (CPU builds of torch)."""
    if not _TRITON:
        try:
            from poc.model.kernels import fp8_triton
        except ImportError:
            fp8_triton = None
        if fp8_triton is not None and fp8_triton.GROUP != GROUP:
            raise RuntimeError(f"fp8_triton.GROUP {fp8_triton.GROUP} != fp8.GROUP {GROUP}")
        _TRITON.append(fp8_triton)
    return _TRITON[0]


def dequantize_act(q: Tensor, s: Tensor) -> Tensor:
    """q (M, K) float8 x its group scales (M, ceil(K/128)) -> float32 (M, K)."""
    K = q.shape[-1]
    return q.float() * s.repeat_interleave(GROUP, -1)[..., :K]


def dequantize_blocks(w: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """float8 (..., R, C) times its per-block scales (..., ceil(R/128), ceil(C/128)), in float32, rounded to dtype
    once (edge blocks cropped): the numbers of dequantising at load time (weights.dequantize_fp8)."""
    if w.is_cuda:  # one fused kernel: no float32 copy of a layer's experts
        if not _DEQUANT_CUDA:
            _DEQUANT_CUDA.append(torch.compile(_dequantize_blocks, dynamic=False))
        return _DEQUANT_CUDA[0](w, scale_inv, dtype)
    return _dequantize_blocks(w, scale_inv, dtype)


_DEQUANT_CUDA: list = []


def _dequantize_blocks(w: Tensor, scale_inv: Tensor, dtype: torch.dtype) -> Tensor:
    R, C = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(GROUP, -2)[..., :R, :].repeat_interleave(GROUP, -1)[..., :C]
    return (w.float() * s).to(dtype)


# ---------------------------------------------------------------------------------------------------------------
# a norm and the quantiser of the FP8 linear that reads it, in one pass


class Quantized(NamedTuple):
    """An activation handed to its FP8 consumers already quantised (norm_quant): q (M, K) float8 and s (M, K/128)
    float32, quantize_act's layout and bits; the activation's shape (..., K) and dtype; and the 16-bit activation
    itself where a caller still reads it (the MoE router), else None. Fp8Linear and experts.grouped_w8a8 take it for x."""
    q: Tensor
    s: Tensor
    shape: torch.Size
    dtype: torch.dtype
    x: Tensor | None


FUSED_NORM_ON_CPU = False  # tests run the fused path's plumbing on the CPU (the composition stands in)


@torch.compiler.disable  # a Triton kernel, and a recipe read at run time: outside any compiled graph
def norm_quant(norm: nn.Module, x: Tensor, residual: Tensor | None = None, keep: bool = False,
               ue8m0: bool = False) -> tuple[Tensor | None, Tensor | Quantized]:
    """(r, h) for a norm whose output only FP8 linears read (keep: and a 16-bit reader too): r = residual + x
    rounded to x's dtype (None without a residual), h = norm(r). Where the fused kernel applies (CUDA, the fast
    recipe, 16-bit rows of whole 128-groups) h is Quantized: one pass reads x (and the residual) and writes r, the
    quantised norm and with keep the norm itself; its q and s are bit for bit
    quantize_act(norm(r), ue8m0=ue8m0) (tests/test_w8a8.py's CUDA test). Elsewhere h is the norm, a tensor its
    readers quantise themselves. ue8m0: the readers' scale format.
    `norm` is the model's RMSNorm (its weight, eps and formula: transformer.RMSNorm.forward)."""
    if not _fused_norm_ok(x, residual):
        if residual is None:
            return None, norm(x)
        r = residual + x if residual.dtype == x.dtype else (residual.float() + x.float()).to(residual.dtype)
        return r, norm(r)
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x.is_cuda:
        r, y, q, s = kernels().rmsnorm_quant(x2, None if residual is None else residual.reshape(-1, D), norm.weight,
                                             norm.eps, keep, ld_align=LD_ALIGN, ue8m0=ue8m0)
        s = s[:, :x2.shape[0]].t()
    else:  # the CPU stand-in of the tests: the same numbers by the unfused ops
        r = x2 if residual is None else residual.reshape(-1, D) + x2
        y = norm(r)
        q, s = quantize_act_torch(y, ue8m0)
    h = Quantized(q, s, x.shape, x.dtype, y.view(x.shape) if keep else None)
    return (None if residual is None else r.view(x.shape)), h


def _fused_norm_ok(x: Tensor, residual: Tensor | None) -> bool:
    if _EMULATION[0] != "off" or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if x.shape[-1] % GROUP or (residual is not None and (residual.dtype != x.dtype or residual.shape != x.shape)):
        return False
    return kernels() is not None if x.is_cuda else FUSED_NORM_ON_CPU


# ---------------------------------------------------------------------------------------------------------------
# block-scaled GEMMs


def fp8_mm(q: Tensor, s: Tensor, w: Tensor, w_scale: Tensor, out_dtype: torch.dtype,
           w_scale_t: Tensor | None = None) -> Tensor:
    """y (M, N) = (q * s) @ (w * w_scale).T with float32 accumulation, written in out_dtype.
    q (M, K) float8 with group scales s (M, K/128); w (N, K) float8 with block scales (N/128, K/128); w_scale_t:
    weight_scale_t(w_scale) when the caller keeps it."""
    if _scaled_mm_ok(q, w, out_dtype):
        try:
            return _scaled_mm(q, s, w, w_scale_t if w_scale_t is not None else weight_scale_t(w_scale), out_dtype)
        except (RuntimeError, TypeError, NotImplementedError) as e:  # an unsupported shape or build: emulate it
            key = (tuple(w.shape), out_dtype)
            if key not in _FAILED:
                _FAILED.add(key)
                log.warning("block-scaled torch._scaled_mm failed for weight %s (%s: %s); that GEMM is emulated in "
                            "float32", list(w.shape), type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return (dequantize_act(q, s) @ dequantize_blocks(w, w_scale).t()).to(out_dtype)


SCALED_MM = True  # False: every FP8 GEMM emulated in float32, on CUDA too (for diagnosis)
_FAILED: set = set()  # weight shapes whose block-scaled GEMM failed once (logged once, then emulated)
LD_ALIGN = 4  # cuBLASLt's block-scaled FP8 GEMM wants 16-byte aligned scale columns: M and K/128 multiples of 4
# (measured on H100: other row counts are refused; 6 column groups run and compute a wrong result)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _scaled_mm_ok(q: Tensor, w: Tensor, out_dtype: torch.dtype) -> bool:
    if not (q.is_cuda and SCALED_MM and _EMULATION[0] == "off" and hasattr(torch, "_scaled_mm")):
        return False
    if out_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    N, K = w.shape
    return (K % (GROUP * LD_ALIGN) == 0 and N % GROUP == 0 and (tuple(w.shape), out_dtype) not in _FAILED
            and torch.cuda.get_device_capability(q.device)[0] >= 9)


def col_major(t: Tensor) -> Tensor:
    """t (R, C) as a contiguous column-major tensor (strides (1, R)): the layout torch._scaled_mm takes block scales
    in (a column-major view of a taller buffer is refused). A copy only when t is not laid out so already."""
    R, C = t.shape
    if t.stride(0) == 1 and (C == 1 or t.stride(1) == R):
        return t
    return t.t().contiguous().t()


def weight_scale_t(w_scale: Tensor) -> Tensor:
    """A weight's (N/128, K/128) block scales as the (K/128, N/128) column-major operand of torch._scaled_mm."""
    return col_major(w_scale.t())


def _scaled_mm(q: Tensor, s: Tensor, w: Tensor, w_scale_t: Tensor, out_dtype: torch.dtype) -> Tensor:
    """torch._scaled_mm with 1x128 activation and 128x128 weight block scales on Hopper: the activations' scales
    column-major (M, K/128), the weight passed transposed (K, N) with its scales transposed (K/128, N/128), both
    with 16-byte aligned columns, and M a multiple of 4 (shorter inputs are padded). Measured: a misaligned scale
    operand is not refused, it computes a wrong result; tests/test_w8a8.py's GPU test pins the layout."""
    M = q.shape[0]
    if M % LD_ALIGN:
        pad = _round_up(M, LD_ALIGN) - M
        q = torch.cat([q, q.new_zeros((pad, q.shape[1]))])
        s = torch.cat([s, s.new_ones((pad, s.shape[1]))])
    y = torch._scaled_mm(q, w.t(), scale_a=col_major(s), scale_b=w_scale_t, out_dtype=out_dtype)
    return y[:M] if M % LD_ALIGN else y


def fp8_grouped_mm(q: Tensor, s: Tensor, w: Tensor, w_scale: Tensor, ends: Sequence[int],
                   out_dtype: torch.dtype, w_scale_t: Sequence[Tensor] | None = None) -> Tensor:
    """Rows grouped by expert: rows [ends[j-1], ends[j]) of q (N, K) times expert j's weight w[j] (E, Nout, K) with
    block scales w_scale[j]. Rows past ends[-1] are not computed (left zero). On the tensor cores each group's rows
    should start on a multiple of 4 (group_layout), so its scale rows are an aligned view, not a copy."""
    out = torch.zeros((q.shape[0], w.shape[1]), dtype=out_dtype, device=q.device)
    if _scaled_mm_ok(q, w[0], out_dtype):
        s = s.contiguous()  # row-major: each group's scales are then copied to their own column-major block
        if w_scale_t is None:
            w_scale_t = [weight_scale_t(w_scale[j]) for j in range(w.shape[0])]
    start = 0
    for j, stop in enumerate(ends):
        if stop > start:
            out[start:stop] = fp8_mm(q[start:stop], s[start:stop], w[j], w_scale[j], out_dtype,
                                     None if w_scale_t is None else w_scale_t[j])
        start = stop
    return out


def linear(x: Tensor | Quantized, weight: Tensor, scale_inv: Tensor, bias: Tensor | None = None,
           out_dtype: torch.dtype | None = None, ue8m0: bool = False) -> Tensor:
    """The W8A8 linear: x (..., K) quantised per token group (power-of-two scales with ue8m0; or given Quantized),
    times the FP8 weight (N, K); out_dtype defaults to x's. A bias is added in float32 before the one rounding."""
    out_dtype = out_dtype or x.dtype
    lead = x.shape[:-1]
    if isinstance(x, Quantized):  # quantised by norm_quant already
        q, s = x.q, x.s
    elif _EMULATION[0] == "dequantised":
        y = F.linear(x, dequantize_blocks(weight, scale_inv, x.dtype), bias)
        return y if y.dtype == out_dtype else y.to(out_dtype)
    else:
        q, s = quantize_act(x.reshape(-1, x.shape[-1]), ue8m0=ue8m0)
    if bias is None:
        y = fp8_mm(q, s, weight, scale_inv, out_dtype)
    else:
        y = (fp8_mm(q, s, weight, scale_inv, torch.float32) + bias.float()).to(out_dtype)
    return y.view(*lead, weight.shape[0])


# ---------------------------------------------------------------------------------------------------------------
# the module and the model rewrite


class Fp8Linear(nn.Module):
    """A linear layer holding a float8_e4m3fn `weight` (out, in) and its float32 `weight_scale_inv`
    (ceil(out/128), ceil(in/128)), computed W8A8. Parameter names are the checkpoint's. `ue8m0` (set by
    to_ue8m0, after loading): the weight re-quantised to power-of-two block scales, the input quantised with
    power-of-two scales."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, bias_dtype=None, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty((out_features, in_features), dtype=FP8, device=device),
                                   requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty((cdiv(out_features, GROUP), cdiv(in_features, GROUP)), dtype=torch.float32, device=device),
            requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=bias_dtype, device=device),
                                 requires_grad=False) if bias else None
        self.ue8m0 = False

    @classmethod
    def like(cls, lin: nn.Linear) -> "Fp8Linear":
        b = lin.bias
        return cls(lin.in_features, lin.out_features, b is not None, None if b is None else b.dtype, lin.weight.device)

    @torch.compiler.disable  # a Triton kernel and a cuBLAS call: a compiled graph around them must not re-lower them
    def forward(self, x: Tensor | Quantized, out_dtype: torch.dtype | None = None) -> Tensor:
        return linear(x, self.weight, self.weight_scale_inv, self.bias, out_dtype, self.ue8m0)

    @torch.no_grad()
    def to_ue8m0(self) -> None:
        """Re-quantise the loaded weight to power-of-two block scales (requant_ue8m0) and quantise inputs so; once."""
        if not self.ue8m0:
            w, s = requant_ue8m0(self.weight, self.weight_scale_inv)
            self.weight.copy_(w)
            self.weight_scale_inv.copy_(s)
            self.ue8m0 = True

    @staticmethod
    def cat(parts: Sequence["Fp8Linear"]) -> "Fp8Linear | None":
        """One linear of the parts' rows stacked (q|k|v, gate|up), or None when a part's rows do not end on a
        128-row block (its scale block would cover two parts)."""
        if any(p.out_features % GROUP for p in parts[:-1]) or len({(p.in_features, p.ue8m0) for p in parts}) != 1:
            return None
        has_bias = parts[0].bias is not None
        out = Fp8Linear(parts[0].in_features, sum(p.out_features for p in parts), has_bias,
                        parts[0].bias.dtype if has_bias else None, parts[0].weight.device)
        out.weight = nn.Parameter(torch.cat([p.weight for p in parts]), requires_grad=False)
        out.weight_scale_inv = nn.Parameter(torch.cat([p.weight_scale_inv for p in parts]), requires_grad=False)
        if has_bias:
            out.bias = nn.Parameter(torch.cat([p.bias for p in parts]), requires_grad=False)
        out.ue8m0 = parts[0].ue8m0
        return out

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"w8a8, {'ue8m0' if self.ue8m0 else 'float32'} scales")


ATTN_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def use_fp8_linears(model: nn.Module, is_fp8: Callable[[str], bool]) -> list[str]:
    """Replace (on a meta-built model, before tensor parallel and fuse) every attention and dense-MLP nn.Linear whose
    weight name `is_fp8` accepts by an Fp8Linear; return the replaced weights' names. MoE experts are not touched:
    they are stacked FP8 tensors of their own (MoE.set_fp8)."""
    done = []
    for key, block in model.layers.items():
        if block is None:
            continue
        mods = [(f"layers.{key}.self_attn.", block.self_attn, ATTN_LINEARS)]
        if all(hasattr(block.mlp, n) for n in MLP_LINEARS):  # a dense MLP (a MoE block has a router and experts)
            mods.append((f"layers.{key}.mlp.", block.mlp, MLP_LINEARS))
        for prefix, mod, names in mods:
            for n in names:
                lin = getattr(mod, n)
                if isinstance(lin, nn.Linear) and is_fp8(prefix + n + ".weight"):
                    setattr(mod, n, Fp8Linear.like(lin))
                    done.append(prefix + n + ".weight")
    return done


def use_scales(model: nn.Module, fmt: Fp8Scales) -> None:
    """Put a loaded (and sharded) W8A8 model in scale format `fmt` (ModelOptions.fp8_scales). ue8m0, as vLLM with
    DeepGEMM on Hopper: every Fp8Linear's weight re-quantised to power-of-two block scales and its input quantised
    with power-of-two scales; the W8A8 experts quantise both
    GEMMs' inputs with power-of-two scales and keep the checkpoint's weights and float32 block scales. float32: as
    loaded. Blocks are independent, so this may run on a rank's shard."""
    if fmt == "ue8m0":
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.to_ue8m0()
            elif getattr(m, "w8a8", False):  # transformer.MoE with W8A8 experts
                m.ue8m0 = True


def scales_of(model: nn.Module) -> str | None:
    """The scale format a model computes in (ue8m0 or float32), or None when it has no W8A8 layer."""
    for m in model.modules():
        if isinstance(m, Fp8Linear) or getattr(m, "w8a8", False):
            return "ue8m0" if m.ue8m0 else "float32"
    return None


def scale_slice(name: str, dim: int, start: int, stop: int, full: int) -> tuple[int, int, int]:
    """The block-scale rows/columns of a tensor-parallel slice [start, stop) of an FP8 weight along dim: a split
    must fall on 128-blocks, or one scale would serve two ranks (and the activation groups would move)."""
    if start % GROUP or (stop % GROUP and stop != full):
        raise ValueError(f"{name}: tensor-parallel slice [{start}, {stop}) of dim {dim} does not fall on FP8 "
                         f"{GROUP}-blocks")
    return dim, start // GROUP, cdiv(stop, GROUP)
