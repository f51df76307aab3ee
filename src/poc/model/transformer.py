"""The Llama/Qwen2/Qwen3/Qwen3-MoE/MiniMax-M2 decoder as one single-device forward pass on input embeddings.

Parameter names are those of the HF checkpoints without their `model.` prefix, so loading is a prefix strip (a
MiniMax-M2 checkpoint's Mixtral-style MoE names are mapped by the loader: weights.CHECKPOINT_NAMES).
There is no token lookup and no KV cache: a proof-of-compute pass is one causal forward over (B, S, D) embeddings.
The numerics settings (ModelOptions: the attention recipe, the FP8 kernels) are read here when the model is built.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from poc.model import attention, fp8, route
from poc.model.config import ModelConfig
from poc.model.experts import dispatch_modules, dispatch_stacked
from poc.model.fp8 import Fp8Linear
from poc.model.numerics import add, mul, reflect, sigmoid, softmax, sum_exact
from poc.model.options import ModelOptions

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # normalise in fp32, round to the input dtype, then scale in the model dtype (HF and the v1 reference agree)
        y = x.float()
        y = y * torch.rsqrt(sum_exact(y.pow(2)) / y.shape[-1] + self.eps)
        return mul(y.to(x.dtype), self.weight)


class AllHeadsRMSNorm(nn.Module):
    """MiniMax-M2's q/k norm: one RMSNorm over all heads of a token at once (weight [H * D]), computed in float32 and
    rounded once, the weight multiplied in float32 (the validators' recipe; transformers rounds before the weight,
    the same in float32). Under tensor parallel a rank holds some heads: `width` stays the whole H * D, and
    parallel/tp.py makes `sum_squares` all-reduce the ranks' float32 sums of squares."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.eps, self.width = eps, width
        self.weight = nn.Parameter(torch.ones(width))

    def sum_squares(self, y: Tensor) -> Tensor:
        """(..., 1) float32: the sum of this rank's squares (the whole row on one device)."""
        return sum_exact(y * y)

    def forward(self, x: Tensor) -> Tensor:
        y = x.float()
        return (y * torch.rsqrt(self.sum_squares(y) / self.width + self.eps) * self.weight.float()).to(x.dtype)


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


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """MiniMax-M2's RoPE: the first R dims of each head (x (..., S, D), the table (S, R)) rotated in NeoX pairs
    (i, i + R/2), the rest passed through; in the model dtype, each product and the sum rounded (vLLM's rotary kernel
    and transformers compute it so)."""
    R = cos.shape[-1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    rot = x[..., :R]
    rot = rot * cos + rotate_half(rot) * sin
    return rot if R == x.shape[-1] else torch.cat([rot, x[..., R:]], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, options: ModelOptions = ModelOptions()):
        super().__init__()
        # local head counts: tensor parallel slices the projections and lowers these, never the config
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.dim, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.dim, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.dim, bias=cfg.o_bias)
        self.qkv_proj: nn.Linear | None = None  # set by fuse()
        # Qwen3: per head, weight [D]; MiniMax-M2: over all heads at once, weight [H * D] (before the split)
        self.all_heads_norm = cfg.qk_norm and cfg.qk_norm_all_heads
        if not cfg.qk_norm:
            self.q_norm = self.k_norm = None
        elif self.all_heads_norm:
            self.q_norm, self.k_norm = AllHeadsRMSNorm(q_dim, cfg.norm_eps), AllHeadsRMSNorm(kv_dim, cfg.norm_eps)
        else:
            self.q_norm, self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps), RMSNorm(cfg.head_dim, cfg.norm_eps)
        self.partial_rope = cfg.family == "minimax_m2"  # rotary_dim of each head, rounded as MiniMax's validators
        self.recipe = options.attention_for(cfg)  # how softmax(q k^T) v is computed (model/attention.py)

    def fuse(self) -> None:
        """Replace q/k/v by one projection (one GEMM instead of three); same numbers per output element."""
        if self.qkv_proj is not None:
            return
        if isinstance(self.q_proj, Fp8Linear):  # FP8 W8A8: stacked weights and block scales, when blocks allow
            qkv = Fp8Linear.cat([self.q_proj, self.k_proj, self.v_proj])
            if qkv is not None:
                self.qkv_proj, self.q_proj, self.k_proj, self.v_proj = qkv, None, None, None
            return
        parts = [self.q_proj, self.k_proj, self.v_proj]
        bias = None if self.q_proj.bias is None else [p.bias for p in parts]
        self.qkv_proj = _stacked_linear([p.weight for p in parts], bias)
        self.q_proj, self.k_proj, self.v_proj = None, None, None

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
        if self.all_heads_norm:  # MiniMax-M2: over all heads, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, Sq, self.n_heads, self.head_dim)  # (B, Sq, H*D) -> (B, Sq, H, D)
        k = k.view(B, S, self.n_kv_heads, self.head_dim)
        v = v.view(B, S, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.all_heads_norm:  # Qwen3: per head, before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, S, H, D) -> (B, H, S, D)
        rope = apply_partial_rope if self.partial_rope else apply_rope
        q, k = rope(q, cos[S - Sq:], sin[S - Sq:]), rope(k, cos, sin)
        # a single last query sees every key (the last position of a last-position pass)
        y = attention.attend(q, k, v, self.recipe, 1 / math.sqrt(self.head_dim))
        y = y.transpose(1, 2).reshape(B, Sq, self.n_heads * self.head_dim)  # (B, H, Sq, D) -> (B, Sq, H*D)
        return self.o_proj(y)


def _stacked_linear(weights: list[Tensor], biases: list[Tensor] | None = None) -> nn.Linear:
    """One nn.Linear whose rows are `weights` stacked (and `biases`): made on the meta device and given the
    concatenation: no throwaway random initialisation of the fused matrix (on a CPU that fill costs more than placing
    the whole v1 model) and no second copy of it."""
    w = torch.cat([x.detach() for x in weights])
    lin = nn.Linear(w.shape[1], w.shape[0], bias=biases is not None, device="meta", dtype=w.dtype)
    lin.weight = nn.Parameter(w, requires_grad=False)
    if biases is not None:
        lin.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return lin


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
        self.gate_up_proj = _stacked_linear([self.gate_proj.weight, self.up_proj.weight])
        self.gate_proj, self.up_proj = None, None

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
        return self.down_proj(mul(F.silu(g), u))  # silu of a bf16 tensor: fp32 math, one rounding

    def weighted(self, x: Tensor, weight: Tensor) -> Tensor:
        """An expert's output times its rows' float32 routing weights (weight (N,)), multiplied into the down
        projection's float32 accumulator and rounded once (vLLM's fused MoE; MoE with a sigmoid router)."""
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            g, u = self.gate_proj(x), self.up_proj(x)
        h = mul(F.silu(g), u)
        return (F.linear(h.float(), self.down_proj.weight.float()) * weight[:, None].float()).to(x.dtype)


class MoE(nn.Module):
    """A sparse MoE block (no shared expert), with one of two routers (ModelConfig.router):
    - softmax (Qwen3-MoE, as transformers): the router's logits in the model dtype, softmax in float32, top-k,
      optional renormalisation, the weights rounded to the model dtype (experts.py: transformers' weighing);
    - sigmoid (MiniMax-M2, as its validators: ../shared/spec/minimax-m2.md step 8): the router in true float32 (a
      float32 `gate`), sigma = 1 / (1 + exp(-z)); the k experts with the largest sigma + e_score_correction_bias
      (descending, ties to the lower expert: route.topk), weighted by their UNBIASED sigmas divided by their sum,
      kept in float32 and applied to each expert's down projection before its rounding (experts.py `weighted`).

    Names as the Hub checkpoints: `gate` (the router, E x D) and `experts.{j}.gate_proj/up_proj/down_proj`.
    `fuse()` stacks the experts into `w13` (E, 2F, D) and `w2` (E, D, F), the layout of one grouped GEMM on CUDA.
    `keep_experts(first, stop)`: the experts this rank holds (expert parallel); tokens routed elsewhere add
    nothing here. The block knows no process group: with `sum_dtype` float32 it returns its partial sum unrounded,
    and parallel/tp.py installs the all-reduce after it (as after the dense row-parallel linears), rounding once.
    FP8 weights may stay FP8 in memory (`w13_scale`/`w2_scale`, 128x128 blocks): computed W8A8 (`w8a8`, the
    validators' recipe: experts.grouped_w8a8) or dequantised per layer. The block routes; model/experts.py
    dispatches the routed tokens, computes the experts and combines their outputs.
    """

    def __init__(self, cfg: ModelConfig, options: ModelOptions = ModelOptions()):
        super().__init__()
        self.top_k, self.norm_topk_prob = cfg.n_experts_per_tok, cfg.norm_topk_prob
        self.first, self.stop = 0, cfg.n_experts
        self.sigmoid = cfg.router == "sigmoid"
        # MiniMax's router and its bias are float32 in the checkpoint and stay so (float32_params)
        router_dtype = torch.float32 if self.sigmoid else None
        self.gate = nn.Linear(cfg.dim, cfg.n_experts, bias=False, dtype=router_dtype)
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(cfg.n_experts, dtype=torch.float32),
                                                     requires_grad=False) if cfg.routing_bias else None)
        self.experts = nn.ModuleDict({str(j): MLP(cfg.dim, cfg.moe_ffn_dim) for j in range(self.first, self.stop)})
        self.w13: Tensor | None = None  # set by fuse(): (E_local, 2F, D)
        self.w2: Tensor | None = None  # (E_local, D, F)
        self.w13_scale: Tensor | None = None  # FP8 kept in memory: per-128x128-block scales of w13 / w2
        self.w2_scale: Tensor | None = None
        self.w8a8 = False  # FP8 experts: W8A8 GEMMs (quantised activations) instead of dequantised weights (set_fp8)
        self.ue8m0 = False  # W8A8 experts: power-of-two activation scales (fp8.use_scales)
        self.fast = options.compiled  # the layers run compiled: so do the dispatch's elementwise steps (CUDA)
        self.sum_dtype: torch.dtype | None = None  # the output's dtype; None: the input's (parallel.tp: float32)
        self.gluon = options.gluon  # W8A8 on Hopper: the Gluon expert kernels, else Triton's (same bits)
        self.options = options  # fuse() reads router_gemm where the gate's device is known
        # the sigmoid router's gate as route.split3's three bfloat16 parts (fuse(), with router_gemm split)
        self.register_buffer("gate_parts", None, persistent=False)

    def keep_experts(self, first: int, stop: int) -> None:
        """Hold only experts first..stop-1 (before loading or fuse)."""
        self.experts = nn.ModuleDict({k: m for k, m in self.experts.items() if first <= int(k) < stop})
        self.first, self.stop = first, stop

    def fuse(self) -> None:
        gate = self.gate.weight
        if (self.sigmoid and self.gate_parts is None and not gate.is_meta
                and self.options.router_gemm_for(gate.device) == "split"):
            self.gate_parts = route.split3(gate.detach())
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
        weights, index = self.route(x)
        E = self.gate.out_features
        if self.w13 is None:
            mine = [self.experts[str(j)].weighted if self.sigmoid else self.experts[str(j)]
                    for j in range(self.first, self.stop)]
            out = dispatch_modules(x, weights, index, mine, self.first, E, weighted=self.sigmoid)
        else:  # the sum leaves the kernel in sum_dtype (fp32 partials for the all-reduce), else rounded there
            out = dispatch_stacked(x, weights, index, self.w13, self.w2, E, self.first, w13_scale=self.w13_scale,
                                   w2_scale=self.w2_scale, w8a8=self.w8a8, ue8m0=self.ue8m0, xq=xq, fast=self.fast,
                                   gluon=self.gluon, out_dtype=self.sum_dtype or x.dtype, weighted=self.sigmoid)
        return out.to(self.sum_dtype or x.dtype).view(B, S, D)

    def router_logits(self, x: Tensor) -> Tensor:
        """The sigmoid router's logits (T, E) float32 for x (T, D): a float32 GEMM of x and the float32 gate, as the
        split's bfloat16 GEMM (route.split_logits) where fuse() made the parts and x is bfloat16."""
        if self.gate_parts is not None and x.dtype == torch.bfloat16:
            return route.split_logits(x, self.gate_parts)
        return F.linear(x.float(), self.gate.weight.float())

    def router_gemm(self, dtype: torch.dtype) -> str:
        """How this sigmoid router computes its GEMM for a model of `dtype`: split or float32 (router_logits)."""
        return "split" if self.gate_parts is not None and dtype == torch.bfloat16 else "float32"

    def route(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(weights, experts), each (T, k), for the tokens x (T, D): the chosen experts in selection order (by
        descending score, ties to the lower index; a kernel on CUDA) and their routing weights (float32 for the
        sigmoid router, else in the model dtype)."""
        if self.sigmoid:  # true float32: no TF32 (torch's default), or every product exact on the tensor cores
            sigma = sigmoid(self.router_logits(x))  # (T, E)
            bias = self.e_score_correction_bias
            index = route.topk(sigma if bias is None else sigma + bias.float(), self.top_k)[1]
            weights = sigma.gather(1, index)
            return weights / sum_exact(weights), index
        # as transformers: softmax in fp32, top-k, renormalise in fp32, weights rounded to the model dtype
        probs = softmax(self.gate(x).float())  # (T, E)
        weights, index = route.topk(probs, self.top_k)  # (T, k): torch.topk's choice (a kernel on CUDA)
        if self.norm_topk_prob:
            weights = weights / sum_exact(weights)
        return weights.to(x.dtype), index


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0, options: ModelOptions = ModelOptions()):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.self_attn = Attention(cfg, options)
        self.post_attention_layernorm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MoE(cfg, options) if cfg.is_moe_layer(layer) else MLP(cfg.dim, cfg.ffn_dim)
        self.fused_norm = options.fused_norm  # W8A8: norm + quantiser in one pass (fp8.norm_quant)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, last_only: bool = False) -> tuple[Tensor, Tensor]:
        """The split pair (mlp branch, residual) as vLLM returns it; the layer output is their sum.

        last_only: compute only the last position (B, 1, D) (keys and values still see every position)."""
        res = x[:, -1:] if last_only else x
        fuse = self.fused_norm  # else the norms stay in the compiled graph, their readers quantise
        if fuse and self.self_attn.reads_fp8():  # the norm and the projections' quantiser in one pass
            h = fp8.norm_quant(self.input_layernorm, x, ue8m0=self.self_attn.reads_ue8m0())[1]
        else:
            h = self.input_layernorm(x)
        y = self.self_attn(h, cos, sin, last_only)
        if fuse and self.mlp.reads_fp8():  # the residual add, the norm and the quantiser in one pass
            r, h = fp8.norm_quant(self.post_attention_layernorm, y, residual=res, keep=isinstance(self.mlp, MoE),
                                  ue8m0=self.mlp.reads_ue8m0())
        else:
            r = add(res, y)
            h = self.post_attention_layernorm(r)
        return self.mlp(h), r


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig, with_head: bool = False, options: ModelOptions | None = None):
        """options: the numerics settings the model reads now, each module its own (the attention recipe, the W8A8
        kernels, the fused norm, a compiled dispatch); nothing sets them on a built model from outside."""
        super().__init__()
        self.cfg = cfg
        self.options = options = options or ModelOptions()
        self.attention = options.attention_for(cfg)  # the recipe every layer's attention computes
        # PoC feeds embeddings and v2 reads hidden states: the token table and head exist only when asked for
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.dim) if with_head else None
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, options) for i in range(cfg.n_layers)})
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

    def float32_params(self) -> list[str]:
        """The parameters kept in float32 whatever the model dtype: a sigmoid router and its bias (MiniMax-M2
        ships them float32 and its validators compute the router in float32)."""
        names = []
        for key, block in self.layers.items():
            if block is not None and isinstance(block.mlp, MoE) and block.mlp.sigmoid:
                names.append(f"layers.{key}.mlp.gate.weight")
                if block.mlp.e_score_correction_bias is not None:
                    names.append(f"layers.{key}.mlp.e_score_correction_bias")
        return names

    def computes(self) -> dict:
        """What this built model computes (/health says it): {"attention": its recipe (model/attention.py), "fp8":
        None, or for an FP8 checkpoint {"forward": "w8a8" (FP8 GEMMs on quantised activations) or "dequant",
        "scales": W8A8's scale format, "ue8m0" or "float32" (None under dequant)}, "router": a sigmoid router's GEMM,
        split or float32 (MoE.router_gemm; None for another router)}, read off its modules."""
        numerics = None
        if self.cfg.fp8_block is not None:
            scales = fp8.scales_of(self)
            numerics = {"forward": "w8a8" if scales else "dequant", "scales": scales}
        router = None
        for block in self.layers.values():
            if block is not None and isinstance(block.mlp, MoE) and block.mlp.sigmoid:
                router = block.mlp.router_gemm(block.input_layernorm.weight.dtype)  # the model dtype
                break
        return {"attention": self.attention, "fp8": numerics, "router": router}

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
            self.rope_cos = torch.empty(n_pos, self.cfg.rope_dim, device=device)
            self.rope_sin = torch.empty(n_pos, self.cfg.rope_dim, device=device)
            return
        self.rope_cos, self.rope_sin = rope_table(
            self.cfg.rope_dim, n_pos, self.cfg.rope_theta, self.cfg.rope_scaling, device=device)

    @staticmethod
    def layer_step(block: Block, h: Tensor, cos: Tensor, sin: Tensor, v: Tensor | None, last: bool) -> Tensor:
        """One decoder layer and its reflection. The engine compiles this function once and every layer reuses the
        graph (parameters are graph inputs), so compile time does not grow with depth."""
        a, r = block(h, cos, sin, last)
        if v is not None:
            # both halves, in the model dtype, as the fork's hook does to vLLM's (hidden, residual) pair
            a, r = reflect(a, v), reflect(r, v)
        return add(a, r)

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
