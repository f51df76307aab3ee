"""Random weights of a real model shape, made on the device: for benchmarks and GPU tests (nothing is downloaded).

N(0, 0.02) matrices and norms near 1, as transformers initialises a fresh model. The model is built on the meta
device and filled in place, so a 30B-parameter bf16 model needs its own size on the GPU and nothing more.
MoE experts are made stacked (the layout `fuse()` produces). With `fp8_experts` (random:<preset>:fp8) the model is an
FP8 checkpoint's, computed W8A8 (fp8.fp8_mode, the default): attention, dense-MLP and expert weights float8_e4m3fn
with per-128x128-block scales. With fp8="dequant" the experts are FP8 dequantised per layer and the other linears
plain model-dtype weights (what the dequantise forward computes with; a tensor-parallel split need not fall on
128-blocks). To compare the two arithmetics on the same weights, build the W8A8 model and switch fp8.recipe.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from poc.model.config import ModelConfig
from poc.model.fp8 import FP8, fp8_mode, use_fp8_linears
from poc.model.transformer import MoE, Transformer

RANDOM_PREFIX = "random:"  # a model "directory" of the form random:<preset>[:fp8] (benchmarks, demos)
FP8_SPREAD = 64.0  # the fp8 payload is N(0, 64) (max 448), its scale 0.02 / 64: dequantised N(0, 0.02)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device, fp8_experts: bool = False, seed: int = 0,
                 shard: Callable[[Transformer], None] | None = None, fp8: str | None = None) -> Transformer:
    """A fused, eval-mode headless model of `cfg`'s shape. `shard(model)` runs on the meta model first (e.g. keep a
    pipeline stage, apply tensor/expert parallel) so only this rank's part is ever allocated. fp8_experts: an FP8
    checkpoint's model, run as fp8 says (fp8.fp8_mode: w8a8 or dequant)."""
    device = torch.device(device)
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    w8a8 = fp8_experts and fp8_mode(fp8) == "w8a8"
    if w8a8:
        use_fp8_linears(model, lambda name: True)
    if shard is not None:
        shard(model)
    moes = [b.mlp for b in model.layers.values() if b is not None and isinstance(b.mlp, MoE)]
    for moe in moes:
        moe.experts = nn.ModuleDict()  # made stacked below, one layer at a time
    model = model.to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dtype == FP8:
                p.copy_(_fp8_payload(p.shape, device, g))
            elif name.endswith("weight_scale_inv"):
                p.uniform_(0.9, 1.1, generator=g).mul_(0.02 / FP8_SPREAD)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.05, generator=g)
            else:
                p.normal_(0.0, 0.02, generator=g)
        for moe in moes:
            n, f, d = moe.stop - moe.first, cfg.moe_ffn_dim, cfg.dim
            if fp8_experts:
                moe.set_fp8(*_fp8(n, 2 * f, d, device, g), *_fp8(n, d, f, device, g), w8a8=w8a8)
            else:
                moe.w13 = torch.empty(n, 2 * f, d, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g)
                moe.w2 = torch.empty(n, d, f, device=device, dtype=dtype).normal_(0.0, 0.02, generator=g)
    model.init_rope(device)
    return model.fuse().requires_grad_(False).eval()


def _fp8_payload(shape, device, g) -> torch.Tensor:
    """float8_e4m3fn values N(0, FP8_SPREAD) clamped to the format's range."""
    return torch.empty(shape, device=device).normal_(0.0, FP8_SPREAD, generator=g).clamp_(-448, 448).to(FP8)


def _fp8(n: int, rows: int, cols: int, device, g) -> tuple[torch.Tensor, torch.Tensor]:
    """(n, rows, cols) float8_e4m3fn and its (n, ceil(rows/128), ceil(cols/128)) fp32 weight_scale_inv."""
    w = torch.empty(n, rows, cols, device=device, dtype=FP8)
    for j in range(n):  # one expert at a time: the fp32 draw stays small
        w[j] = _fp8_payload((rows, cols), device, g)
    s = torch.empty(n, -(-rows // 128), -(-cols // 128), device=device).uniform_(0.9, 1.1, generator=g)
    return w, s * (0.02 / FP8_SPREAD)


def random_spec(model: str | None) -> tuple[ModelConfig, bool] | None:
    """(config, fp8 experts) for "random:<preset>[:fp8]" (a preset of poc.model.config.PRESETS), else None."""
    if not model or not str(model).startswith(RANDOM_PREFIX):
        return None
    from poc.errors import InputError
    from poc.model.config import PRESETS

    name, _, opt = str(model)[len(RANDOM_PREFIX):].partition(":")
    if name not in PRESETS or opt not in ("", "fp8"):
        raise InputError(f"--model {model!r}: expected random:<preset>[:fp8] with a preset of "
                         f"{', '.join(sorted(PRESETS))}", "model")
    return PRESETS[name], opt == "fp8"
