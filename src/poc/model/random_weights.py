"""Random weights of a real model shape, made on the device: for benchmarks and GPU tests (nothing is downloaded);
what a `random:<preset>[:fp8]` model source (source.RandomPreset) is built from.

N(0, 0.02) matrices and norms near 1, as transformers initialises a fresh model. The model is built on the meta
device and filled in place, so a 30B-parameter bf16 model needs its own size on the GPU and room for its largest
tensor. Each tensor comes from its own stream and is drawn whole before a rank keeps its slice, so a model is the
same on one device and split in any tensor/pipeline-parallel layout.
MoE experts are made stacked (the layout `fuse()` produces). With `fp8_experts` (random:<preset>:fp8) the model is an
FP8 checkpoint's, computed W8A8 (ModelOptions.fp8, the default): attention, dense-MLP and expert weights float8_e4m3fn
with per-128x128-block scales. With fp8="dequant" the experts are FP8 dequantised per layer and the other linears
plain model-dtype weights (what the dequantise forward computes with; a tensor-parallel split need not fall on
128-blocks). To compare the two arithmetics on the same weights, build the W8A8 model and switch
fp8.diagnostic_emulation.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from torch import nn

from poc.model.config import ModelConfig
from poc.model.fp8 import FP8, use_fp8_linears, use_scales
from poc.model.options import ModelOptions
from poc.model.source import FP8_BLOCK
from poc.model.transformer import MoE, Transformer

FP8_SPREAD = 64.0  # the fp8 payload is N(0, 64) (max 448), its scale 0.02 / 64: dequantised N(0, 0.02)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device, fp8_ckpt: bool = False, seed: int = 0,
                 shard: Callable[[Transformer], Mapping[str, tuple[int, int, int]] | None] | None = None,
                 options: ModelOptions | None = None) -> Transformer:
    """A fused, eval-mode headless model of `cfg`'s shape. `shard(model)` runs on the meta model first (e.g. keep a
    pipeline stage, apply tensor/expert parallel) so only this rank's part is ever allocated; it returns the slices
    it cut (parallel.tp.apply_tp's plan: name -> (dim, start, stop) of the full tensor), or None. fp8_ckpt: an FP8
    checkpoint's model, run as options.fp8 says (w8a8 or dequant), W8A8 in scale format
    options.fp8_scales (ue8m0 or float32; the checkpoint-like weights drawn here are then re-quantised,
    fp8.use_scales); the rest of the options as the loader reads them (the attention recipe, the kernels).

    Every tensor is drawn whole from its own stream (seeded by `seed` and its name; each expert of a MoE layer its
    own), then cut to this rank's slice: the same weights on one device and in any tp x pp layout."""
    device = torch.device(device)
    options = options or ModelOptions()
    if fp8_ckpt and cfg.fp8_block is None:  # an FP8 checkpoint's config says so (the attention recipe reads it)
        cfg = replace(cfg, fp8_block=FP8_BLOCK)
    with torch.device("meta"):
        model = Transformer(cfg, options=options)
    keep = set(model.float32_params())
    for name, p in model.named_parameters():  # the model dtype, but for a float32 router
        if name not in keep:
            p.data = p.data.to(dtype)
    w8a8 = fp8_ckpt and options.fp8 == "w8a8"
    if w8a8:
        use_fp8_linears(model, lambda name: True)
    whole = {name: p.shape for name, p in model.named_parameters()}
    plan = (shard(model) or {}) if shard is not None else {}
    moes = {key: b.mlp for key, b in model.layers.items() if b is not None and isinstance(b.mlp, MoE)}
    for moe in moes.values():
        moe.experts = nn.ModuleDict()  # made stacked below, one expert at a time
    model = model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            t = _draw(name, whole[name], p.dtype, device, seed)
            if name in plan:
                dim, start, stop = plan[name]
                t = t.narrow(dim, start, stop - start)
            p.copy_(t)
        for key, moe in moes.items():
            f, d = cfg.moe_ffn_dim, cfg.dim
            mine = range(moe.first, moe.stop)
            if fp8_ckpt:
                w13, s13 = _fp8_experts(f"layers.{key}.mlp.w13", mine, 2 * f, d, device, seed)
                w2, s2 = _fp8_experts(f"layers.{key}.mlp.w2", mine, d, f, device, seed)
                moe.set_fp8(w13, s13, w2, s2, w8a8=w8a8)
            else:
                moe.w13 = torch.empty(len(mine), 2 * f, d, device=device, dtype=dtype)
                moe.w2 = torch.empty(len(mine), d, f, device=device, dtype=dtype)
                for i, j in enumerate(mine):
                    moe.w13[i].normal_(0.0, 0.02, generator=_stream(device, seed, f"layers.{key}.mlp.w13.{j}"))
                    moe.w2[i].normal_(0.0, 0.02, generator=_stream(device, seed, f"layers.{key}.mlp.w2.{j}"))
    model.init_rope(device)
    if w8a8:
        use_scales(model, options.fp8_scales)
    return model.fuse().requires_grad_(False).eval()


def checkpoint_layer(cfg: ModelConfig, layer: int, dtype: torch.dtype, device, fp8_ckpt: bool = False,
                     seed: int = 0) -> dict[str, torch.Tensor]:
    """Layer `layer` of random_model's weights as a checkpoint holds them, under the model's parameter names (experts
    one by one, `mlp.experts.{j}.gate_proj|up_proj|down_proj`), before any re-quantisation: the same draws, for a
    reference that computes from the checkpoint (the GPU accuracy benchmark's float32 emulation, one layer at a
    time)."""
    device = torch.device(device)
    if fp8_ckpt and cfg.fp8_block is None:
        cfg = replace(cfg, fp8_block=FP8_BLOCK)
    with torch.device("meta"):
        block = Transformer(replace(cfg, n_layers=layer + 1)).layers[str(layer)]
    if fp8_ckpt:
        use_fp8_linears(_Holder(block, layer), lambda name: True)
    out = {}
    keep = {"mlp.gate.weight", "mlp.e_score_correction_bias"} if isinstance(block.mlp, MoE) and block.mlp.sigmoid \
        else set()
    for name, p in block.named_parameters():
        if ".experts." in name:
            continue
        pdtype = p.dtype if (p.dtype == FP8 or name.endswith("weight_scale_inv") or name in keep) else dtype
        out[f"layers.{layer}.{name}"] = _draw(f"layers.{layer}.{name}", p.shape, pdtype, device, seed)
    if isinstance(block.mlp, MoE):
        f, d, E = cfg.moe_ffn_dim, cfg.dim, cfg.n_experts
        pre = f"layers.{layer}.mlp"
        if fp8_ckpt:
            w13, s13 = _fp8_experts(f"{pre}.w13", range(E), 2 * f, d, device, seed)
            w2, s2 = _fp8_experts(f"{pre}.w2", range(E), d, f, device, seed)
            fb = f // 128
            for j in range(E):
                out[f"{pre}.experts.{j}.gate_proj.weight"], out[f"{pre}.experts.{j}.up_proj.weight"] = w13[j, :f], w13[j, f:]
                out[f"{pre}.experts.{j}.gate_proj.weight_scale_inv"] = s13[j, :fb]
                out[f"{pre}.experts.{j}.up_proj.weight_scale_inv"] = s13[j, fb:]
                out[f"{pre}.experts.{j}.down_proj.weight"], out[f"{pre}.experts.{j}.down_proj.weight_scale_inv"] = w2[j], s2[j]
        else:
            for j in range(E):
                w13 = torch.empty(2 * f, d, device=device, dtype=dtype).normal_(
                    0.0, 0.02, generator=_stream(device, seed, f"{pre}.w13.{j}"))
                out[f"{pre}.experts.{j}.gate_proj.weight"], out[f"{pre}.experts.{j}.up_proj.weight"] = w13[:f], w13[f:]
                out[f"{pre}.experts.{j}.down_proj.weight"] = torch.empty(d, f, device=device, dtype=dtype).normal_(
                    0.0, 0.02, generator=_stream(device, seed, f"{pre}.w2.{j}"))
    return out


def checkpoint_norm(cfg: ModelConfig, dtype: torch.dtype, device, seed: int = 0) -> torch.Tensor:
    """The final norm's weight of random_model's draws (checkpoint_layer's companion)."""
    return _draw("norm.weight", (cfg.dim,), dtype, torch.device(device), seed)


class _Holder(nn.Module):
    """A model-like holder of one block (fp8.use_fp8_linears walks `layers`)."""

    def __init__(self, block, layer: int):
        super().__init__()
        self.layers = nn.ModuleDict({str(layer): block})


def _stream(device: torch.device, seed: int, name: str) -> torch.Generator:
    """The generator of one tensor: seeded by the model's seed and the tensor's name."""
    return torch.Generator(device=device).manual_seed((seed << 32) | zlib.crc32(name.encode()))


def _draw(name: str, shape, dtype: torch.dtype, device: torch.device, seed: int) -> torch.Tensor:
    """Tensor `name` of the whole model: FP8 payloads N(0, FP8_SPREAD), block scales 0.02 / FP8_SPREAD within 10%,
    norms N(1, 0.05), everything else N(0, 0.02)."""
    g = _stream(device, seed, name)
    if dtype == FP8:
        return fp8_payload(shape, device, g)
    if name.endswith("weight_scale_inv"):
        return torch.empty(shape, device=device, dtype=dtype).uniform_(0.9, 1.1, generator=g).mul_(0.02 / FP8_SPREAD)
    if name.endswith("norm.weight"):
        return torch.empty(shape, device=device, dtype=dtype).normal_(1.0, 0.05, generator=g)
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g)


def fp8_payload(shape, device, g) -> torch.Tensor:
    """float8_e4m3fn values N(0, FP8_SPREAD) clamped to the format's range."""
    return torch.empty(shape, device=device).normal_(0.0, FP8_SPREAD, generator=g).clamp_(-448, 448).to(FP8)


def _fp8_experts(name: str, experts: range, rows: int, cols: int, device,
                 seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts `experts` of a stacked FP8 weight: (n, rows, cols) float8_e4m3fn and its (n, ceil(rows/128),
    ceil(cols/128)) fp32 weight_scale_inv, each expert from its own stream."""
    w = torch.empty(len(experts), rows, cols, device=device, dtype=FP8)
    s = torch.empty(len(experts), -(-rows // 128), -(-cols // 128), device=device)
    for i, j in enumerate(experts):  # one expert at a time: the fp32 draw stays small
        g = _stream(device, seed, f"{name}.{j}")
        w[i] = fp8_payload((rows, cols), device, g)
        s[i].uniform_(0.9, 1.1, generator=g)
    return w, s * (0.02 / FP8_SPREAD)
