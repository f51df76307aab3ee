"""`--layout auto`: the fastest layout of replicas x pp x tp that fits the GPUs, from the model's shape and the GPUs'
memory. Pure arithmetic on a ModelConfig and a list of GPU sizes (`choose`); `detect_gpus` reads the visible GPUs.

The rule, from what was measured (benchmarks/README.md):
- a layout fits when every GPU holds its share of the weights (a pipeline stage its layers, the largest stage; a tp
  rank 1/tp of each linear and of the experts) plus the activations of a batch of 32 at seq_len 1024 (the MLNode's
  batch, memory.v2_estimate), within `headroom` of its memory less RESERVE (CUDA context, NCCL, the allocator);
- the fewest GPUs a replica needs wins: replicas of a smaller group beat one larger group (two replicas of
  Qwen3-30B-A3B-FP8 on two H100 served 1.97x one GPU, where pp=2 gave 1.63x);
- within a group of g GPUs, pipeline stages beat tensor parallelism (Qwen3-235B-A22B-FP8 on four H100: pp=4
  59.7 nonces/s, tp=4 31.7 in poc.bench): pp=g first, then mixes with fewer stages, tp=g last; a split the model
  cannot take (heads, kv heads, experts by tp; layers by pp) is skipped.
So Qwen3-235B-A22B-FP8 (W8A8, ~235 GB) is pp=4 on four H100 (80 GB: two GPUs cannot hold it) and two replicas of
pp=2 on four H200 (141 GB); a model one GPU holds runs as one replica a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from poc.engine import memory
from poc.errors import InputError
from poc.model.options import ModelOptions
from poc.model.source import ModelSource
from poc.model.source import parse as parse_source
from poc.parallel.layout import Layout, stage_layers

GiB = 1 << 30
RESERVE = 3 * GiB  # a GPU's memory that no layout plans on: the CUDA context, NCCL's buffers, the allocator's slack
FIT_BATCH, FIT_SEQ = 32, 1024  # the batch a layout must hold besides its weights: the MLNode's, at PoC v2's seq_len


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int


@dataclass(frozen=True)
class Choice:
    tp: int
    pp: int
    replicas: int
    why: str  # the chosen layout's numbers and the better ones that did not fit

    def label(self) -> str:
        return label(self.tp, self.pp, self.replicas)


def label(tp: int, pp: int, replicas: int) -> str:
    parts = [p for p in (f"pp={pp}" if pp > 1 else "", f"tp={tp}" if tp > 1 else "") if p] or ["one GPU"]
    return (f"{replicas} replicas of " if replicas > 1 else "") + " x ".join(parts)


def layer_bytes(cfg, i: int, dtype_bytes: int, fp8: str | None) -> tuple[int, int]:
    """(split, whole) bytes of layer i's weights: what tensor parallelism divides (attention projections, the dense
    MLP, the experts) and what every tp rank keeps (norms, the router). fp8: None (the model dtype), "w8a8" (every
    linear FP8, one byte and a 4-byte scale per 128x128 block) or "experts" (only the experts FP8)."""
    q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    attn = cfg.dim * q + 2 * cfg.dim * kv + q * cfg.dim
    lin = 1 + 4 / (128 * 128) if fp8 else dtype_bytes
    attn_b = attn * (lin if fp8 == "w8a8" else dtype_bytes)
    all_heads = cfg.qk_norm and cfg.qk_norm_all_heads  # MiniMax's q/k norm: split with the heads
    attn_b += (q + kv) * dtype_bytes if all_heads else 0
    norms = (2 * cfg.dim + (2 * cfg.head_dim if cfg.qk_norm and not all_heads else 0)) * dtype_bytes
    if cfg.is_moe_layer(i):
        mlp = 3 * cfg.dim * cfg.moe_ffn_dim * cfg.n_experts * lin
        # MiniMax's: float32, and on CUDA also its three bfloat16 parts (route.split3: ModelOptions.router_gemm)
        router = cfg.dim * cfg.n_experts * (4 + 3 * 2 if cfg.router == "sigmoid" else dtype_bytes)
        return int(attn_b + mlp), norms + router + (4 * cfg.n_experts if cfg.routing_bias else 0)
    mlp = 3 * cfg.dim * cfg.ffn_dim * (lin if fp8 == "w8a8" else dtype_bytes)
    return int(attn_b + mlp), norms


def rank_weight_bytes(cfg, tp: int, pp: int, dtype_bytes: int, fp8: str | None) -> int:
    """The weights one GPU of a tp x pp group holds: its stage's layers (the largest stage), 1/tp of what splits."""
    out = 0
    for layers in stage_layers(cfg.n_layers, pp):
        split = whole = 0
        for i in layers:
            s, w = layer_bytes(cfg, i, dtype_bytes, fp8)
            split, whole = split + s, whole + w
        out = max(out, split // tp + whole + cfg.dim * dtype_bytes)  # + the final norm
    return out


def candidates(n_gpus: int):
    """(tp, pp, replicas) in the order of preference: the smallest group first; within a group, pp before tp."""
    for g in range(1, n_gpus + 1):
        if n_gpus % g:
            continue
        for pp in range(g, 0, -1):
            if g % pp == 0:
                yield g // pp, pp, n_gpus // g


def need_bytes(cfg, tp: int, pp: int, dtype_bytes: int, fp8: str | None, batch: int = FIT_BATCH,
               seq_len: int = FIT_SEQ) -> tuple[int, int]:
    """(weights, activations) one GPU of a tp x pp group holds for a batch of this shape."""
    return (rank_weight_bytes(cfg, tp, pp, dtype_bytes, fp8),
            memory.v2_estimate(cfg, batch, seq_len, dtype_bytes, tp=tp, cuda=True, fused=True,
                               w8a8=fp8 == "w8a8").device_total)


def room_bytes(total_bytes: int, headroom: float = 0.9) -> float:
    """What a layout may plan on of a GPU with `total_bytes`."""
    return headroom * (total_bytes - RESERVE)


def choose(cfg, gpus: list[Gpu], dtype_bytes: int, fp8: str | None = None, headroom: float = 0.9) -> Choice:
    """The first candidate layout that splits the model and fits the smallest GPU; InputError when none does."""
    if not gpus:
        return Choice(1, 1, 1, "no GPU visible: one process")
    cap = min(g.total_bytes for g in gpus)
    room = room_bytes(cap, headroom)
    skipped = []
    for tp, pp, replicas in candidates(len(gpus)):
        name = label(tp, pp, replicas)
        try:
            Layout(tp * pp, tp, pp).check_config(cfg)
        except InputError as e:
            skipped.append(f"not {name} ({e.message.split(': ', 1)[-1]})")
            continue
        w, act = need_bytes(cfg, tp, pp, dtype_bytes, fp8)
        if w + act > room:
            skipped.append(f"not {name} ({w / GiB:.1f} GiB of weights a GPU)")
            continue
        why = (f"{len(gpus)} x {gpus[0].name} ({cap / GiB:.1f} GiB): {name}: {w / GiB:.1f} GiB of weights + "
               f"{act / GiB:.1f} GiB for a batch of {FIT_BATCH} x {FIT_SEQ} a GPU fit in {room / GiB:.1f} GiB "
               f"({headroom:.0%} of {cap / GiB:.1f} - {RESERVE / GiB:.0f} GiB)")
        return Choice(tp, pp, replicas, why + ("; " + "; ".join(skipped) if skipped else ""))
    raise InputError(f"--layout auto: the model does not fit {len(gpus)} x {gpus[0].name} ({cap / GiB:.1f} GiB) in "
                     f"any layout: " + "; ".join(skipped), "layout")


def detect_gpus() -> list[Gpu]:
    """The visible CUDA devices (CUDA_VISIBLE_DEVICES applies) and their memory, without allocating on them."""
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(Gpu(p.name, int(p.total_memory)))
    return out


def for_model(model: "str | ModelSource | None", dtype: str = "auto", gpus: list[Gpu] | None = None,
              options: ModelOptions | None = None) -> Choice:
    """choose() for a server's --model (a model source, or the string naming a checkpoint directory or
    random:<preset>[:fp8]) on `gpus` (default: the visible ones), its FP8 weights computed as `options` say
    (ModelOptions.fp8, .fp8_experts). Without a model (PoC v1 only: each request brings its own, which one GPU holds)
    every GPU is a replica."""
    gpus = detect_gpus() if gpus is None else gpus
    if not model:
        n = max(1, len(gpus))
        return Choice(1, 1, n, f"no --model (PoC v1: one GPU holds a request's model): {label(1, 1, n)}")
    cfg, dtype_bytes, kind = model_shape(model, dtype, options)
    return choose(cfg, gpus, dtype_bytes, kind)


def model_shape(model: "str | ModelSource", dtype: str = "auto", options: ModelOptions | None = None):
    """(ModelConfig, bytes per model-dtype element, fp8 kind for layer_bytes) of a --model (a source, or the string
    that names one), read without loading; an FP8 checkpoint computed as `options` say (fp8: w8a8 or dequant; under
    dequant fp8_experts)."""
    from poc.dtypes import BYTES

    o = options or ModelOptions()
    cfg = parse_source(model).config()  # a preset's :fp8 is in its config, as an FP8 checkpoint's is
    name = (cfg.torch_dtype or "float32") if dtype == "auto" else dtype
    kind = None
    if cfg.fp8_block is not None:
        kind = "w8a8" if o.fp8 == "w8a8" else ("experts" if o.fp8_experts == "keep" else None)
    return cfg, BYTES[name], kind
