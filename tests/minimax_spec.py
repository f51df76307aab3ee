"""MiniMax-M2's PoC forward as the H100 validators compute it (../shared/spec/minimax-m2.md, "How the H100 validators
compute it", steps 1-10, and poc-v2.md §b for the reflections), transcribed for the tests and the GPU accuracy
benchmark independently of src/poc/model: plain float32 torch ops, every rounding to the model dtype written out
(`Emulation.rnd`), one layer at a time from checkpoint-style weights (the release's names: `block_sparse_moe`,
experts' w1 = gate, w3 = up, w2 = down), so that a 62-layer model is emulated holding one layer.

`Recipe` holds the spec's choices and the variants the accuracy benchmark measures against (the vLLM 0.20-era
attention, bf16 attention, a bf16 router, float32 scales, transformers' expert weighing), each a way a server could
be systematically wrong. Light (torch only): the gloo rank processes and the GPU benchmark import it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

E4M3 = torch.float8_e4m3fn
TILE = 128  # the FP8 attention's query and key tiles, and the FP8 groups and blocks


@dataclass(frozen=True)
class Recipe:
    attention: str = "fp8"  # fp8 (vLLM 0.25: Q, K, V and P in e4m3), fp8kv (0.20: bf16 Q, e4m3 K/V), bf16
    scales: str = "ue8m0"  # activation and dense-weight scales: ue8m0 (Hopper, DeepGEMM) or float32
    router: str = "float32"  # the router's GEMM: float32 (the spec) or bf16 (a server rounding a and W_gate)
    weight_in_down: bool = True  # the routing weight multiplies the down GEMM's float32 output (else transformers')
    tp: int = 1  # a validator's tensor-parallel degree (H100: 4, H200: 2): o_proj's and the experts' bf16 partial
    # sums all-reduced in bf16, the q/k norm's float32 means averaged over the ranks (the same recipe, honest noise)


def e4(x: Tensor) -> Tensor:
    """float32 values of RNE-to-e4m3 after clamping to +-448 (the spec's e4)."""
    return x.float().clamp(-448.0, 448.0).to(E4M3).float()


def pow2_ceil(y: Tensor) -> Tensor:
    """2^ceil(log2(y)) for positive y, from frexp (y = m 2^e, m in [0.5, 1)): y itself when m = 0.5, else 2^e."""
    m, e = torch.frexp(y)
    return torch.where(m == 0.5, y, torch.ldexp(torch.ones_like(y), e))


def quant_groups(x: Tensor, ue8m0: bool) -> Tensor:
    """The per-row, per-128-column activation quantiser, returned dequantised (float32 q * s): amax floored at 1e-10,
    s = amax / 448 (as amax * (1/448)) or with UE8M0 the power of two 2^ceil(log2(amax / 448)); q = e4(x / s)."""
    M, K = x.shape
    G = -(-K // TILE)
    xp = torch.nn.functional.pad(x.float(), (0, G * TILE - K)).view(M, G, TILE)
    amax = xp.abs().amax(-1, keepdim=True).clamp(min=1e-10)
    s = pow2_ceil(amax / 448.0) if ue8m0 else amax * (1.0 / 448.0)
    return (e4(xp / s) * s).view(M, G * TILE)[:, :K]


def dequant_blocks(w: Tensor, s: Tensor) -> Tensor:
    """An FP8 weight (R, C) times its 128x128 block scales, float32."""
    R, C = w.shape
    return w.float() * s.float().repeat_interleave(TILE, 0)[:R].repeat_interleave(TILE, 1)[:, :C]


def requant_ue8m0(w: Tensor, s: Tensor) -> Tensor:
    """A dense FP8 weight re-quantised per 128x128 block to a power-of-two scale (spec step 1, fp8-w8a8.md), returned
    dequantised: w = fp32(w8) * s, amax floored at 1e-4, scale 2^ceil(log2(amax / 448)), e4(w / scale) * scale."""
    R, C = w.shape
    Rb, Cb = -(-R // TILE), -(-C // TILE)
    wf = torch.nn.functional.pad(dequant_blocks(w, s), (0, Cb * TILE - C, 0, Rb * TILE - R))
    blocks = wf.view(Rb, TILE, Cb, TILE)
    sc = pow2_ceil(blocks.abs().amax(dim=(1, 3), keepdim=True).clamp(min=1e-4) / 448.0)
    return (e4(blocks / sc) * sc).view(Rb * TILE, Cb * TILE)[:R, :C]


def rope_tables(n_pos: int, rotary_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin (n_pos, rotary_dim / 2) in float32: inv_freq_j = theta^(-2j / rotary_dim), angles pos * inv_freq."""
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    ang = torch.arange(n_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


class Emulation:
    """The recipe on checkpoint weights: `weights(i)` gives layer i's tensors under their checkpoint names less the
    `model.layers.{i}.` prefix (FP8 weights with their `weight_scale_inv`, or plain ones), `final_norm` the final
    norm's weight. cfg is the model's ModelConfig (its shape only). dtype: the model dtype every `rnd` rounds to."""

    def __init__(self, cfg, weights: Callable[[int], dict[str, Tensor]], final_norm: Tensor,
                 recipe: Recipe = Recipe(), dtype: torch.dtype = torch.bfloat16, layers: list[int] | None = None,
                 exact: bool = False, cache: dict | None = None):
        """exact: every GEMM's products summed in float64 and rounded to float32 once (the same recipe, its
        float32 accumulation order taken out: the honest noise of another GEMM kernel). cache: where the experts'
        dequantised float32 weights are kept (by weight tensor), shared by emulations of the same weights; its owner
        clears it."""
        self.cache = {} if cache is None else cache
        self.cfg, self.weights, self.final_norm, self.r, self.dtype = cfg, weights, final_norm, recipe, dtype
        self.layers = list(range(cfg.n_layers)) if layers is None else layers
        self.mm = (lambda a, b: (a.double() @ b.double()).float()) if exact else torch.matmul

    def rnd(self, x: Tensor) -> Tensor:
        return x.to(self.dtype).float()

    # ---------------------------------------------------------------------------------------------- pieces

    def norm(self, s: Tensor, w: Tensor) -> Tensor:
        """A layer's RMSNorm of the (rounded) residual s: bf(bf(s * rsqrt(mean(s^2) + eps)) * w)."""
        y = self.rnd(s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps))
        return self.rnd(y * w.float())

    def weight(self, W: dict, name: str) -> tuple[Tensor, bool]:
        """(float32 weight, fp8) of a dense linear: an FP8 weight dequantised with its scales, UE8M0 re-quantised
        first when the recipe's scales are UE8M0."""
        w, s = W[name + ".weight"], W.get(name + ".weight_scale_inv")
        if s is None:
            return w.float(), False
        return (requant_ue8m0(w, s) if self.r.scales == "ue8m0" else dequant_blocks(w, s)), True

    def linear(self, a: Tensor, w: Tensor, fp8: bool) -> Tensor:
        """The W8A8 GEMM in float32 (activation quantised when the weight is FP8), unrounded."""
        a2 = a.reshape(-1, a.shape[-1])
        if fp8:
            a2 = quant_groups(a2, self.r.scales == "ue8m0")
        return self.mm(a2, w.t()).view(*a.shape[:-1], w.shape[0])

    def qk_norm(self, x: Tensor, w: Tensor) -> Tensor:
        """Over all heads at once (per_layer): bf(x * rsqrt(mean(x^2) + eps) * w), the weight in float32; under tp the
        ranks' float32 means of their slices, all-reduced and divided by tp."""
        tp = self.r.tp
        var = sum(p.pow(2).mean(-1, keepdim=True) for p in x.chunk(tp, -1)) / tp
        return self.rnd(x * torch.rsqrt(var + self.cfg.norm_eps) * w.float())

    def allreduce(self, parts: list[Tensor]) -> Tensor:
        """Partial sums in the model dtype added rank after rank, each sum rounded (a bf16 all-reduce)."""
        acc = parts[0]
        for p in parts[1:]:
            acc = self.rnd(acc + p)
        return acc

    def rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """x (B, H, S, D): dims [0, R) in NeoX pairs (i, i + R/2), cos/sin rounded, each product and sum rounded."""
        R = 2 * cos.shape[-1]
        c, s = self.rnd(cos), self.rnd(sin)
        x1, x2 = x[..., :R // 2], x[..., R // 2:R]
        o1 = self.rnd(self.rnd(x1 * c) - self.rnd(x2 * s))
        o2 = self.rnd(self.rnd(x2 * c) + self.rnd(x1 * s))
        return torch.cat([o1, o2, x[..., R:]], dim=-1)

    def attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q (B, H, S, D), k and v (B, Hkv, S, D) -> (B, H, S, D), causal, in the recipe's form."""
        B, H, S, D = q.shape
        rep = H // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # query head h reads kv head h // rep
        if self.r.attention != "fp8":  # flash attention in the model dtype: P rounded before PV, l of the unrounded p
            if self.r.attention == "fp8kv":
                k, v = e4(k), e4(v)
            s = self.mm(q, k.transpose(-1, -2)) / math.sqrt(D)
            s = s.masked_fill(torch.ones(S, S, dtype=torch.bool, device=q.device).triu(1), -math.inf)
            p = torch.exp(s - s.amax(-1, keepdim=True))
            return self.rnd(self.mm(self.rnd(p), v) / p.sum(-1, keepdim=True))
        return self.rnd(self.fp8_attention(e4(q), e4(k), e4(v), self.mm))

    @staticmethod
    def fp8_attention(q8: Tensor, k8: Tensor, v8: Tensor, mm=torch.matmul) -> Tensor:
        """Step 6: query tiles of 128; key tiles visited from the diagonal back to the first; running max m of the
        scores, p = exp2(S c - m c), l sums the unquantised p, O accumulates e4(448 p) V8; O / (448 l)."""
        B, H, S, D = q8.shape
        c = math.log2(math.e) / math.sqrt(D)
        out = torch.empty_like(q8)
        for t in range(0, S, TILE):
            rows = torch.arange(t, min(S, t + TILE), device=q8.device)
            qt = q8[:, :, t:t + TILE]
            m = torch.full((B, H, len(rows), 1), -math.inf, device=q8.device)
            l = torch.zeros((B, H, len(rows), 1), device=q8.device)
            o = torch.zeros((B, H, len(rows), D), device=q8.device)
            for j in range(t // TILE, -1, -1):
                cols = torch.arange(j * TILE, min(S, (j + 1) * TILE), device=q8.device)
                s = mm(qt, k8[:, :, j * TILE:j * TILE + len(cols)].transpose(-1, -2))
                s = s.masked_fill(cols[None, :] > rows[:, None], -math.inf)
                m_new = torch.maximum(m, s.amax(-1, keepdim=True))
                scale = torch.exp2((m - m_new) * c)
                p = torch.exp2(s * c - m_new * c)
                l = l * scale + p.sum(-1, keepdim=True)
                o = o * scale + mm(e4(448.0 * p), v8[:, :, j * TILE:j * TILE + len(cols)])
                m = m_new
            out[:, :, t:t + TILE] = o / (448.0 * l)
        return out

    def route(self, a: Tensor, W: dict) -> tuple[Tensor, Tensor]:
        """(weights float32, experts) (T, k): sigmoid of the float32 router, the k largest sigma + bias (descending,
        ties to the lower expert), the unbiased sigmas of those divided by their sum."""
        g = W["block_sparse_moe.gate.weight"].float()
        if self.r.router == "bf16":
            z = self.rnd(self.mm(self.rnd(a), self.rnd(g).t()))
        else:
            z = self.mm(a, g.t())
        sigma = 1.0 / (1.0 + torch.exp(-z))
        bias = W.get("block_sparse_moe.e_score_correction_bias")
        choice = sigma if bias is None else sigma + bias.float()
        idx = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :self.cfg.n_experts_per_tok]
        w = sigma.gather(1, idx)
        return w / w.sum(-1, keepdim=True), idx

    def experts(self, a: Tensor, W: dict) -> Tensor:
        """Step 9: a (T, D) -> (T, D) float32 values of the model dtype."""
        T, D = a.shape
        k = self.cfg.n_experts_per_tok
        w, idx = self.route(a, W)
        ue8 = self.r.scales == "ue8m0"
        fp8 = "block_sparse_moe.experts.0.w1.weight_scale_inv" in W
        a8 = quant_groups(a, ue8) if fp8 else a
        tp = self.r.tp
        F = self.cfg.moe_ffn_dim // tp  # each rank's slice of every expert's intermediate
        terms = torch.zeros(tp, T, k, D, device=a.device)
        for e in idx.unique().tolist():
            tok, slot = (idx == e).nonzero(as_tuple=True)
            p = f"block_sparse_moe.experts.{e}."

            def W_(n):
                t, s = W[p + n + ".weight"], W.get(p + n + ".weight_scale_inv")
                if id(t) not in self.cache:  # experts keep the checkpoint's scales; the tensor held: its id stays
                    self.cache[id(t)] = (t, t.float() if s is None else dequant_blocks(t, s))
                return self.cache[id(t)][1]

            g = self.rnd(self.mm(a8[tok], W_("w1").t()))
            u = self.rnd(self.mm(a8[tok], W_("w3").t()))
            act = self.rnd(self.rnd(g / (1.0 + torch.exp(-g))) * u)
            act = quant_groups(act, ue8) if fp8 else act
            w2 = W_("w2")
            we = w[tok, slot][:, None]
            for r in range(tp):
                y = self.mm(act[:, r * F:(r + 1) * F], w2[:, r * F:(r + 1) * F].t())
                terms[r, tok, slot] = (self.rnd(we * y) if self.r.weight_in_down
                                       else self.rnd(self.rnd(y) * self.rnd(we)))
        parts = []
        for r in range(tp):
            if not self.r.weight_in_down:  # transformers' order: the k terms summed exactly
                parts.append(self.rnd(terms[r].double().sum(1).float()))
                continue
            acc = terms[r, :, 0]
            for c in range(1, k):  # float32, in selection order
                acc = acc + terms[r, :, c]
            parts.append(self.rnd(acc))
        return self.allreduce(parts)

    def reflect(self, x: Tensor, v: Tensor) -> Tensor:
        """poc-v2 §b in the model dtype: dot = sum(x * v) rounded; x - 2 dot v, each op rounded."""
        v = self.rnd(v)
        dot = self.rnd(self.rnd(x * v).sum(-1, keepdim=True))
        return self.rnd(x - self.rnd(2.0 * dot * v))

    # ---------------------------------------------------------------------------------------------- forward

    def layer(self, i: int, h: Tensor, r: Tensor | None, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        cfg, W = self.cfg, self.weights(i)
        B, S, D = h.shape
        r = h if r is None else self.rnd(h + r)  # layer 0: the input is the residual
        a = self.norm(r, W["input_layernorm.weight"])
        out = []
        for n in ("q", "k", "v"):
            w, fp8 = self.weight(W, f"self_attn.{n}_proj")
            out.append(self.rnd(self.linear(a, w, fp8)))
        q, k, v = out
        if cfg.qk_norm:
            q, k = self.qk_norm(q, W["self_attn.q_norm.weight"]), self.qk_norm(k, W["self_attn.k_norm.weight"])
        hd = cfg.head_dim
        q = q.view(B, S, -1, hd).transpose(1, 2)  # (B, S, H*D) -> (B, H, S, D)
        k = k.view(B, S, -1, hd).transpose(1, 2)
        v = v.view(B, S, -1, hd).transpose(1, 2)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        y = self.attention(q, k, v).transpose(1, 2).reshape(B, S, -1)
        w, fp8 = self.weight(W, "self_attn.o_proj")
        cols = y.shape[-1] // self.r.tp  # row parallel: each rank its heads' columns, a bf16 partial sum
        y = self.allreduce([self.rnd(self.linear(y[..., r * cols:(r + 1) * cols], w[:, r * cols:(r + 1) * cols], fp8))
                            for r in range(self.r.tp)])
        r = self.rnd(y + r)
        a = self.norm(r, W["post_attention_layernorm.weight"])
        return self.experts(a.reshape(B * S, D), W).view(B, S, D), r

    @torch.no_grad()
    def forward(self, x: Tensor, reflections: Tensor | None = None) -> Tensor:
        """x (B, S, D) inputs -> the final-norm hidden state of the last position (B, D), float32 values of the
        model dtype; reflections (n_layers, D) unit rows: both halves of layer i's output reflected by row i."""
        B, S, D = x.shape
        cos, sin = rope_tables(S, self.cfg.rope_dim, self.cfg.rope_theta)
        cos, sin = cos.to(x.device), sin.to(x.device)
        h, r = self.rnd(x.float()), None
        for i in self.layers:
            h, r = self.layer(i, h, r, cos, sin)
            if reflections is not None:
                h, r = self.reflect(h, reflections[i].float()), self.reflect(r, reflections[i].float())
        r = self.rnd(h + r)
        return self.norm(r, self.final_norm)[:, -1]


def file_weights(path) -> tuple[Callable[[int], dict[str, Tensor]], Tensor]:
    """(weights(i), final norm) of a checkpoint directory in the release's layout (names `model.layers.{i}.*`)."""
    from pathlib import Path

    from safetensors.torch import load_file

    sd = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        sd.update(load_file(f))

    def weights(i: int) -> dict[str, Tensor]:
        pre = f"model.layers.{i}."
        return {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}

    return weights, sd["model.norm.weight"]
