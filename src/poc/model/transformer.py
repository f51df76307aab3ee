"""The Llama/Qwen2/Qwen3/Qwen3-MoE decoder as one single-device forward pass on input embeddings.

Parameter names are those of the HF checkpoints without their `model.` prefix, so loading is a prefix strip.
There is no token lookup and no KV cache: a proof-of-compute pass is one causal forward over (B, S, D) embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from poc.model import fp8, route
from poc.model.config import ModelConfig
from poc.model.fp8 import Fp8Linear, dequantize_blocks

# enable_gqa arrived in torch 2.5; before that the kv heads are repeated by hand
_SDPA_HAS_GQA = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32, round to the input dtype, then scale in the model dtype (HF and the v1 reference agree)
        y = x.float()
        y = y * torch.rsqrt(sum_exact(y.pow(2)) / y.shape[-1] + self.eps)
        return _mul(y.to(x.dtype), self.weight)


def sum_exact(t: Tensor) -> Tensor:
    """Sum along the last dim (keepdim) accumulated in float64, returned in float32.

    The terms here are squares or products of bf16/fp16 values (at most 22 significant bits), so their float64 sum is
    exact for any realistic spread of magnitudes: every reduction order gives the same bits. Eager PyTorch and a
    compiled graph (Triton's reduction tree) therefore agree exactly, where a float32 sum differs in the last bit
    for about a third of the rows and the model's chaotic depth amplifies that. For float32 models it is simply a
    more accurate sum. The float64 -> float32 rounding is written out so both paths round the same way."""
    return t.double().sum(-1, keepdim=True).float()


def rope_freqs(head_dim: int, theta: float, scaling: dict | None = None, device=None) -> Tensor:
    """Inverse frequencies (head_dim/2,) in float32, with the Llama-3.1 rule when `scaling` is given."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if scaling is None:
        return freqs
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / freqs
    smooth = (old_ctx / wavelen - low) / (high - low)
    medium = (1 - smooth) * freqs / factor + smooth * freqs
    scaled = torch.where(wavelen > old_ctx / low, freqs / factor, medium)
    return torch.where(wavelen < old_ctx / high, freqs, scaled)


def rope_table(head_dim: int, n_pos: int, theta: float, scaling: dict | None = None,
               device=None) -> tuple[Tensor, Tensor]:
    """(cos, sin), float32, in the duplicated rotate_half form (n_pos, head_dim): column i and i + head_dim/2 agree."""
    freqs = rope_freqs(head_dim, theta, scaling, device)
    angles = torch.arange(n_pos, dtype=torch.float32, device=device)[:, None] * freqs[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # (n_pos, hd/2) -> (n_pos, hd)
    return angles.cos(), angles.sin()


def rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x (..., S, D) by the table rows (S, D); cos/sin are rounded to x's dtype first, the math is fp32."""
    cos, sin = cos.to(x.dtype).float(), sin.to(x.dtype).float()
    return (x.float() * cos + rotate_half(x).float() * sin).to(x.dtype)


# Half-precision elementwise ops round where eager PyTorch rounds: a bf16/fp16 op computes in fp32 and rounds its
# output once. They are written as plain ops in the model dtype, so a compiled graph keeps each op's rounding
# (inductor's emulate_precision_casts rounds the output of every low-precision op, inside fused kernels too). An
# explicit x.to(bf16).float() is avoided: older inductors fold that chain into x.float() and lose the rounding.


def _mul(a: Tensor, b: Tensor) -> Tensor:
    """a * b in a's dtype (computed in fp32, rounded once)."""
    return a * b if a.dtype == b.dtype else (a.float() * b.float()).to(a.dtype)


def _add(a: Tensor, b: Tensor) -> Tensor:
    """a + b in a's dtype (computed in fp32, rounded once)."""
    return a + b if a.dtype == b.dtype else (a.float() + b.float()).to(a.dtype)


def reflect(x: Tensor, v: Tensor) -> Tensor:
    """Householder reflection x - 2 (x.v) v along the last dim, in x's dtype (v a unit vector of that dtype),
    rounding as the reference's plain tensor ops do: x*v, the sum, 2*dot*v and the difference."""
    dot = sum_exact(_mul(x, v)).to(x.dtype)
    return x - _mul(dot * 2, v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # local head counts: tensor parallel slices the projections and lowers these, never the config
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.dim, bias=cfg.o_bias)
        self.qkv_proj: nn.Linear | None = None  # set by fuse()
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def fuse(self) -> None:
        """Replace q/k/v by one projection (one GEMM instead of three); same numbers per output element."""
        if self.qkv_proj is not None:
            return
        if isinstance(self.q_proj, Fp8Linear):  # FP8 W8A8: stacked weights and block scales, when blocks allow
            qkv = Fp8Linear.cat([self.q_proj, self.k_proj, self.v_proj])
            if qkv is not None:
                self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = qkv, None, None, None
            return
        ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        qkv = nn.Linear(ws[0].shape[1], sum(w.shape[0] for w in ws), bias=self.q_proj.bias is not None,
                        device=ws[0].device, dtype=ws[0].dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat(ws))
            if qkv.bias is not None:
                qkv.bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
        self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = qkv, None, None, None

    def reads_fp8(self) -> bool:
        """Whether only an FP8 linear reads this block's input (the fused q|k|v): it may come quantised."""
        return isinstance(self.qkv_proj, Fp8Linear)

    def reads_ue8m0(self) -> bool:
        """Whether that FP8 reader quantises its input with power-of-two scales."""
        return self.reads_fp8() and self.qkv_proj.ue8m0

    def _project(self, x: Tensor | fp8.Quantized, last_only: bool) -> tuple[Tensor, Tensor, Tensor]:
        q_dim = self.n_heads * self.head_dim
        if self.qkv_proj is not None and (not last_only or isinstance(self.qkv_proj, Fp8Linear)):
            q, k, v = _split3(self.qkv_proj(x), q_dim)  # FP8: every row's q, the last one kept
            return (q[:, -1:] if last_only else q), k, v
        xq = x[:, -1:] if last_only else x  # the last layer of a last-position pass needs one query
        if self.qkv_proj is None:
            return self.q_proj(xq), self.k_proj(x), self.v_proj(x)
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        q = F.linear(xq, w[:q_dim], None if b is None else b[:q_dim])
        kv = F.linear(x, w[q_dim:], None if b is None else b[q_dim:])
        k, v = kv.chunk(2, dim=-1)
        return q, k, v

    def forward(self, x: Tensor | fp8.Quantized, cos: Tensor, sin: Tensor, last_only: bool = False) -> Tensor:
        """Causal self-attention; with last_only, only the last position's output (B, 1, D) is computed. x may come
        quantised when reads_fp8()."""
        B, S, _ = x.shape
        q, k, v = self._project(x, last_only)
        Sq = q.shape[1]
        q = q.view(B, Sq, self.n_heads, self.head_dim)  # (B, Sq, H*D) -> (B, Sq, H, D)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D)
        q, k = apply_rope(q, cos[S - Sq:], sin[S - Sq:]), apply_rope(k, cos, sin)
        gqa = self.n_heads != self.n_kv_heads
        if gqa and not _SDPA_HAS_GQA:
            # kv head j serves query heads j*n_rep ... j*n_rep + n_rep - 1: repeat_interleave, not a tile
            n_rep = self.n_heads // self.n_kv_heads
            k, v = k.repeat_interleave(n_rep, dim=1), v.repeat_interleave(n_rep, dim=1)
        extra = {"enable_gqa": True} if gqa and _SDPA_HAS_GQA else {}
        # a single last query sees every key: no mask (SDPA's causal mask is top-left aligned)
        y = _sdpa(q, k, v, Sq > 1, 1 / math.sqrt(self.head_dim), bool(extra))
        y = y.transpose(1, 2).reshape(B, Sq, self.n_heads * self.head_dim)  # (B, H, Sq, D) -> (B, Sq, H*D)
        return self.o_proj(y)


@torch.compiler.disable
def _sdpa(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float, gqa: bool) -> Tensor:
    """The attention kernel, always run as eager PyTorch runs it (flash/memory-efficient SDPA): a compiled graph
    around it must not re-lower attention with different half-precision rounding."""
    extra = {"enable_gqa": True} if gqa else {}
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale, **extra)


def _split3(qkv: Tensor, q_dim: int) -> tuple[Tensor, Tensor, Tensor]:
    kv = (qkv.shape[-1] - q_dim) // 2
    return qkv.split([q_dim, kv, kv], dim=-1)


class MLP(nn.Module):
    def __init__(self, dim: int, ffn_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.up_proj = nn.Linear(dim, ffn_dim, bias=False)
        self.down_proj = nn.Linear(ffn_dim, dim, bias=False)

        self.gate_up_proj: nn.Linear | None = None  # set by fuse()

    def fuse(self) -> None:
        """One GEMM for gate and up."""
        if self.gate_up_proj is not None:
            return
        if isinstance(self.gate_proj, Fp8Linear):
            gu = Fp8Linear.cat([self.gate_proj, self.up_proj])
            if gu is not None:
                self.gate_up_proj, self.gate_proj, self.up_proj = gu, None, None
            return
        g, u = self.gate_proj.weight, self.up_proj.weight
        gu = nn.Linear(g.shape[1], 2 * g.shape[0], bias=False, device=g.device, dtype=g.dtype)
        with torch.no_grad():
            gu.weight.copy_(torch.cat([g, u]))
        self.gate_up_proj, self.gate_proj, self.up_proj = gu, None, None

    def reads_fp8(self) -> bool:
        """Whether only an FP8 linear reads this block's input (the fused gate|up): it may come quantised."""
        return isinstance(self.gate_up_proj, Fp8Linear)

    def reads_ue8m0(self) -> bool:
        """Whether that FP8 reader quantises its input with power-of-two scales."""
        return self.reads_fp8() and self.gate_up_proj.ue8m0

    def forward(self, x: Tensor | fp8.Quantized) -> Tensor:
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(_mul(F.silu(g), u))  # silu of a bf16 tensor: fp32 math, one rounding


class MoE(nn.Module):
    """Qwen3-MoE sparse block: softmax router over experts, top-k, optional renormalisation, no shared expert.

    Names as the Hub checkpoints: `gate` (the router, E x D) and `experts.{j}.gate_proj/up_proj/down_proj`.
    `fuse()` stacks the experts into `w13` (E, 2F, D) and `w2` (E, D, F), the layout of one grouped GEMM on CUDA.
    `keep_experts(first, stop)`: the experts this rank holds (expert parallel); tokens routed elsewhere add
    nothing here, and with `group` set the fp32 partial sums are all-reduced over the ranks and rounded once.
    FP8 weights may stay FP8 in memory (`w13_scale`/`w2_scale`, 128x128 blocks): computed W8A8 (`w8a8`, the
    validators' recipe: fp8.experts_w8a8) or dequantised per layer.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.n_experts_per_tok, cfg.norm_topk_prob
        self.first, self.stop = 0, cfg.n_experts
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False)
        self.experts = nn.ModuleDict({str(j): MLP(cfg.dim, cfg.moe_ffn_dim) for j in range(self.first, self.stop)})
        self.w13: Tensor | None = None  # set by fuse(): (E_local, 2F, D)
        self.w2: Tensor | None = None  # (E_local, D, F)
        self.w13_scale: Tensor | None = None  # FP8 kept in memory: per-128x128-block scales of w13 / w2
        self.w2_scale: Tensor | None = None
        self.w8a8 = False  # FP8 experts: W8A8 GEMMs (quantised activations) instead of dequantised weights
        self.ue8m0 = False  # W8A8 experts: power-of-two activation scales (fp8.use_scales)
        self.group = None  # expert-parallel process group (all-reduce of the fp32 partial sums)
        self.fast = False  # compiled elementwise steps in the dispatch (set by the engine when it compiles)
        self.reduce_in_model_dtype = False  # all-reduce rounded partials (POC_TP_REDUCE=model) instead of fp32 ones

    def keep_experts(self, first: int, stop: int) -> None:
        """Hold only experts first..stop-1 (before loading or fuse)."""
        self.experts = nn.ModuleDict({k: m for k, m in self.experts.items() if first <= int(k) < stop})
        self.first, self.stop = first, stop

    def fuse(self) -> None:
        if self.w13 is not None:
            return
        ex = [self.experts[str(j)] for j in range(self.first, self.stop)]
        for e in ex:
            e.fuse()
        self.w13 = torch.stack([e.gate_up_proj.weight.detach() for e in ex])
        self.w2 = torch.stack([e.down_proj.weight.detach() for e in ex])
        self.experts = nn.ModuleDict()  # the stacked copies are the only ones kept

    def set_fp8(self, w13: Tensor, w13_scale: Tensor, w2: Tensor, w2_scale: Tensor, w8a8: bool = False) -> None:
        """Keep float8_e4m3fn stacked weights with their weight_scale_inv blocks (E, rows/128, cols/128); w8a8: run
        them as the validators do (quantised activations), else dequantise them per layer."""
        self.w13, self.w13_scale, self.w2, self.w2_scale = w13, w13_scale.float(), w2, w2_scale.float()
        self.w8a8 = w8a8
        self.experts = nn.ModuleDict()

    def reads_fp8(self) -> bool:
        """Whether FP8 GEMMs read this block's input (the W8A8 experts; the router reads it in 16 bits too): it
        may come Quantized with the 16-bit activation kept."""
        return self.w8a8 and self.w13_scale is not None

    def reads_ue8m0(self) -> bool:
        """Whether the FP8 GEMMs quantise this block's input with power-of-two scales."""
        return self.reads_fp8() and self.ue8m0

    def forward(self, x: Tensor | fp8.Quantized) -> Tensor:
        xq = None
        if isinstance(x, fp8.Quantized):  # norm_quant's, keeping the 16-bit form for the router
            xq, x = x, x.x
        B, S, D = x.shape
        x = x.reshape(B * S, D)  # (B, S, D) -> (T, D)
        # as transformers: softmax in fp32, top-k, renormalise in fp32, weights rounded to the model dtype
        probs = _softmax(self.gate(x).float())  # (T, E)
        weights, experts = route.topk(probs, self.top_k)  # (T, k): torch.topk's choice (a kernel on CUDA)
        if self.norm_topk_prob:
            weights = weights / sum_exact(weights)
        weights = weights.to(x.dtype)
        if self.w13 is None:
            out = _dispatch_modules(self, x, weights, experts)
        else:
            out = _dispatch_stacked(self, x, weights, experts, xq)
        if self.group is not None:  # each rank summed its own experts' terms: add the fp32 partials, round once
            if self.reduce_in_model_dtype:  # or round each rank's partial and add those (half the bytes)
                out = out.to(x.dtype)
            torch.distributed.all_reduce(out, group=self.group)
        return out.to(x.dtype).view(B, S, D)


def _softmax(z: Tensor) -> Tensor:
    """Softmax over the last dim, written out (max, exp, exact sum, one division) so that eager PyTorch and a
    compiled graph compute the same bits: a fused softmax kernel and Triton's sum differ in the order they add."""
    e = torch.exp(z - z.amax(-1, keepdim=True))
    return e / sum_exact(e)


def _routed(moe: MoE, index: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, experts) of the (token, choice) pairs this rank serves, sorted by expert; rows index T*k."""
    flat = index.reshape(-1)  # (T*k,): token t's choices at t*k ... t*k + k-1
    if moe.first == 0 and moe.stop == moe.gate.out_features:
        order = flat.argsort(stable=True)
    else:
        order = ((flat >= moe.first) & (flat < moe.stop)).nonzero().squeeze(1)
        order = order[flat[order].argsort(stable=True)]
    return order, flat[order] - moe.first


@torch.compiler.disable
def _dispatch_modules(moe: MoE, x: Tensor, weights: Tensor, index: Tensor) -> Tensor:
    """Sum over each token's k chosen experts of weight * expert(token), one GEMM chain per expert (unfused).
    Each weighted output is rounded to the model dtype; the k of a token are summed in fp32 (T, D), the caller
    rounds once, as transformers' default (grouped_mm) and vLLM's fused MoE do. Data-dependent shapes: kept out of
    compiled graphs."""
    T, k = index.shape
    rows, local = _routed(moe, index)
    counts = torch.bincount(local, minlength=moe.stop - moe.first).tolist()
    w = weights.reshape(-1)
    out = x.new_zeros(T * k, x.shape[1])  # (T*k, D), in (token, choice) order; zero where another rank serves
    start = 0
    for j, n in enumerate(counts):
        if n:
            r = rows[start:start + n]
            out[r] = _mul(moe.experts[str(moe.first + j)](x[r // k]), w[r, None])
        start += n
    return out.view(T, k, -1).double().sum(dim=1).float()  # (T*k, D) -> (T, k, D) -> (T, D), exact


@torch.compiler.disable
def _dispatch_stacked(moe: MoE, x: Tensor, weights: Tensor, index: Tensor, xq: fp8.Quantized | None = None) -> Tensor:
    """As _dispatch_modules over the stacked experts: the (token, choice) pairs are sorted so that this rank's
    experts come first, in expert order, and one grouped GEMM per projection (torch._grouped_mm on CUDA; elsewhere
    one GEMM chain per expert) covers exactly those rows. With every expert here all shapes are static (no host
    sync: rows past the last group get weight zero); under expert parallel one host sync per layer sizes the
    gather to this rank's rows. FP8 weights run W8A8 (`moe.w8a8`) or are dequantised for the duration of this call.
    With `moe.fast` (the engine compiles) the elementwise steps run as compiled kernels. xq: x quantised already
    (norm_quant), for the W8A8 experts."""
    T, k = index.shape
    E, n_local = moe.gate.out_features, moe.stop - moe.first
    key = torch.remainder(index.reshape(-1) - moe.first, E)  # this rank's experts -> 0 .. n_local-1, first
    rows = key.argsort(stable=True)  # (T*k,) into (token, choice) order
    pos = _positions(rows)  # (T*k,): where each (token, choice) pair sits in that order
    ends = torch.searchsorted(key[rows], torch.arange(1, n_local + 1, device=x.device))  # group j: [ends[j-1], ends[j])
    partial = n_local < E
    if partial:  # expert parallel: one host sync per layer, then only this rank's rows are gathered and computed
        n = int(ends[-1])
        if n == 0:
            return x.new_zeros(T, x.shape[1], dtype=torch.float32)
        rows = rows[:n]
    fast = moe.fast and x.is_cuda
    act = _fast(_act, partial) if fast else _act
    combine = _fast(_combine, partial) if fast else _combine
    n_valid = ends[-1]
    if moe.w8a8 and moe.w13_scale is not None and fp8.current_recipe() != "dequant":  # the validators' recipe
        y, dest = fp8.experts_w8a8(x, rows, k, ends, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale, act, xq,
                                   ue8m0=moe.ue8m0)
        # outputs in a padded layout: route each (token, choice) slot through dest; another rank's slots stay out
        pos = torch.where(pos < n_valid, dest[pos.clamp(max=dest.numel() - 1)], y.shape[0])
        n_valid = y.shape[0]
    else:
        y = _experts(moe, x[rows // k], ends, act)
    # the sum leaves the kernel in fp32 only where fp32 partials are all-reduced; otherwise rounded there (fused)
    out_dtype = torch.float32 if moe.group is not None and not moe.reduce_in_model_dtype else x.dtype
    return combine(y, weights.reshape(-1), pos, n_valid, T, k, out_dtype)


def _experts(moe: MoE, xs: Tensor, ends: Tensor, act) -> Tensor:
    """The expert outputs (N, D) of the routed copies xs (N, D), grouped by expert (group j ends at ends[j]), on
    weights in the model dtype (FP8 ones dequantised for the duration of this call)."""
    w13, w2 = moe.w13, moe.w2
    if moe.w13_scale is not None:
        w13, w2 = dequantize_blocks(w13, moe.w13_scale, xs.dtype), dequantize_blocks(w2, moe.w2_scale, xs.dtype)
    if _grouped_mm_ok(xs, w13):
        offs = ends.to(torch.int32)
        return torch._grouped_mm(act(torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)), w2.transpose(1, 2),
                                 offs=offs)  # (N, D); rows past ends[-1] are not computed
    y = xs.new_zeros(xs.shape)
    start = 0
    for j, stop in enumerate(ends.tolist()):
        if stop > start:
            y[start:stop] = F.linear(act(F.linear(xs[start:stop], w13[j])), w2[j])
        start = stop
    return y


def _act(h: Tensor) -> Tensor:
    """SwiGLU on the fused gate|up output, rounding as the unfused MLP does."""
    g, u = h.chunk(2, dim=-1)
    return _mul(F.silu(g), u)


def _positions(rows: Tensor) -> Tensor:
    """The inverse permutation of `rows`: pos[rows[p]] = p."""
    return torch.empty_like(rows).scatter_(0, rows, torch.arange(rows.numel(), device=rows.device))


def _combine(y: Tensor, w: Tensor, pos: Tensor, n_valid: Tensor, T: int, k: int,
             out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The block's output (T, D): for each token, the sum over its k choices of expert output times routing weight
    (each product rounded to the model dtype, the sum exact: sum_exact's argument), as float32 rounded to
    out_dtype.

    y holds the expert outputs in expert-sorted order, one row per computed (token, choice) pair: all T*k of them,
    or under expert parallel only this rank's first n_valid. pos maps each (token, choice) slot to its row of y;
    slots at or past n_valid are another rank's and count as zero. Written as k gathers of whole rows added in
    float64 (exact, so their order is free): a compiled graph makes it one elementwise kernel over (T, D) that reads
    each token's k rows of y once, contiguously, and writes only the result. (As one (T, k, D) sum over k it was a
    reduction kernel whose loads strided across the k rows: 4.9 ms against 0.9 at 64k tokens on the H100.)"""
    pos, w = pos.view(T, k), w.view(T, k)
    zero = torch.zeros((), dtype=y.dtype, device=y.device)
    acc = None
    for c in range(k):
        p = pos[:, c]
        term = torch.where((p < n_valid)[:, None], _mul(y[p.clamp(max=y.shape[0] - 1)], w[:, c, None]), zero)
        acc = term.double() if acc is None else acc + term.double()
    return acc.float().to(out_dtype)


_FAST: dict = {}


def _fast(fn, dynamic: bool = False):
    """fn compiled once per process (the engine's compile settings); dynamic: one graph for any row count."""
    if (fn, dynamic) not in _FAST:
        from poc.model.compile import maybe_compile

        _FAST[fn, dynamic] = maybe_compile(fn, True, dynamic=dynamic)
    return _FAST[fn, dynamic]


GROUPED_MM_ON_CPU = False  # tests switch the grouped GEMM on for CPU tensors (torch >= 2.9 has a CPU kernel)


def _grouped_mm_ok(xs: Tensor, w: Tensor) -> bool:
    """torch._grouped_mm: bf16 on Hopper or newer (or the CPU kernel when a test asks), 16-byte aligned rows."""
    if xs.dtype != torch.bfloat16 or w.dtype != torch.bfloat16 or not hasattr(torch, "_grouped_mm"):
        return False
    if xs.shape[1] % 8 or w.shape[1] % 8:
        return False
    if xs.is_cuda:
        return torch.cuda.get_device_capability(xs.device)[0] >= 9
    return GROUPED_MM_ON_CPU


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer) else MLP(cfg.dim, cfg.ffn_dim)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, last_only: bool = False) -> tuple[Tensor, Tensor]:
        """The split pair (mlp branch, residual) as vLLM returns it; the layer output is their sum.

        last_only: compute only the last position (B, 1, D) (keys and values still see every position)."""
        res = x[:, -1:] if last_only else x
        fuse = fp8.FUSED_NORM  # else the norms stay in the compiled graph, their readers quantise
        if fuse and self.self_attn.reads_fp8():  # the norm and the projections' quantiser in one pass
            h = fp8.norm_quant(self.input_layernorm, x, ue8m0=self.self_attn.reads_ue8m0())[1]
        else:
            h = self.input_layernorm(x)
        y = self.self_attn(h, cos, sin, last_only)
        if fuse and self.mlp.reads_fp8():  # the residual add, the norm and the quantiser in one pass
            r, h = fp8.norm_quant(self.post_attention_layernorm, y, residual=res, keep=isinstance(self.mlp, MoE),
                                  ue8m0=self.mlp.reads_ue8m0())
        else:
            r = _add(res, y)
            h = self.post_attention_layernorm(r)
        return self.mlp(h), r


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, with_head: bool = False):
        super().__init__()
        self.cfg = cfg
        # PoC feeds embeddings and v2 reads hidden states: the token table and head exist only when asked for
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim) if with_head else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False) if with_head else None
        self.tie_weights()
        self.register_buffer("rope_cos", torch.empty(0), persistent=False)
        self.register_buffer("rope_sin", torch.empty(0), persistent=False)
        self.init_rope()

    def fuse(self) -> "Transformer":
        """Fuse q/k/v and gate/up into single GEMMs (after loading and any sharding)."""
        for block in self.layers.values():
            if block is not None:
                block.self_attn.fuse()
                block.mlp.fuse()
        return self

    def tie_weights(self) -> None:
        """Point lm_head at embed_tokens' matrix (needed again after load_state_dict(assign=True))."""
        if self.cfg.tie_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight

    def init_rope(self, device=None, n_pos: int | None = None) -> None:
        """(Re)build the float32 RoPE table for n_pos positions (default max_seq_len) on device (default: current)."""
        if device is None:
            device = None if self.rope_cos.is_meta else self.rope_cos.device
        n_pos = n_pos or self.cfg.max_seq_len
        if torch.empty(0, device=device).is_meta:
            # shapes only: meta kernels for the table's math would pull in torch._dynamo and sympy (~70 MB of RSS)
            self.rope_cos = torch.empty(n_pos, self.cfg.head_dim, device=device)
            self.rope_sin = torch.empty(n_pos, self.cfg.head_dim, device=device)
            return
        self.rope_cos, self.rope_sin = rope_table(
            self.cfg.head_dim, n_pos, self.cfg.rope_theta, self.cfg.rope_scaling, device=device)

    @staticmethod
    def layer_step(block: Block, h: Tensor, cos: Tensor, sin: Tensor, v: Tensor | None, last: bool) -> Tensor:
        """One decoder layer and its reflection. The engine compiles this function once and every layer reuses the
        graph (parameters are graph inputs), so compile time does not grow with depth."""
        a, r = block(h, cos, sin, last)
        if v is not None:
            # both halves, in the model dtype, as the fork's hook does to vLLM's (hidden, residual) pair
            a, r = reflect(a, v), reflect(r, v)
        return _add(a, r)

    def forward(self, h: Tensor, reflections: Tensor | None = None, last_only: bool = True,
                logits: bool = False, step=None) -> Tensor:
        """Embeddings (B, S, D) -> final-norm hidden states (B, D) or (B, S, D), or fp32 logits (B, [S,] V).

        reflections (n_layers_global, D), unit rows: after layer i both parts of its output are reflected by row i.
        step: a replacement for layer_step with its signature (the engine passes a compiled one).
        A pipeline stage without `norm` returns the un-normed (B, S, D) output of its last layer.
        """
        B, S, _ = h.shape
        if self.rope_cos.is_meta or self.rope_cos.shape[0] < S or self.rope_cos.device != h.device:
            self.init_rope(h.device, max(S, self.cfg.max_seq_len))
        # the tables rounded to the model dtype here, outside any compiled step (apply_rope rounds them anyway)
        cos, sin = self.rope_cos[:S].to(h.dtype), self.rope_sin[:S].to(h.dtype)
        if reflections is not None:
            reflections = reflections.to(device=h.device, dtype=h.dtype)
        blocks = [(k, b) for k, b in self.layers.items() if b is not None]  # None: another stage's layer
        for i, (key, block) in enumerate(blocks):
            # a last-position pass needs only the last query and MLP row in the final layer (exact, and
            # about one layer's FLOPs saved); a pipeline stage without the norm hands on every position
            last = last_only and self.norm is not None and i == len(blocks) - 1
            v = reflections[int(key)].contiguous() if reflections is not None else None  # a fresh (D,) tensor
            h = (step or self.layer_step)(block, h, cos, sin, v, last)
        if self.norm is None:
            return h
        if last_only:
            h = h[:, -1]  # (B, S|1, D) -> (B, D): the norm is per position, so slice first
        h = self.norm(h)
        if logits:
            if self.lm_head is None:
                raise ValueError("logits=True needs a model built with with_head=True")
            return self.lm_head(h).float()
        return h
