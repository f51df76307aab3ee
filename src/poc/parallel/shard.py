"""This rank's model: build on meta, keep the stage's layers, shard for tensor parallel, then fill only those slices.

A checkpoint rank reads its rows / columns straight from the safetensors files (weights.iter_state_dict with a
shard plan) and, of a Qwen3-MoE sparse layer, only its own experts' tensors (FP8 ones with their scales), so its
peak host memory is about its shard; the whole model is checked against the file headers first. A v1 rank draws
the weight pool on its device (the pool is a fraction of the model) and places only its own slice of each
parameter.
"""

from __future__ import annotations

from pathlib import Path

import torch

from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.model.random_init import hf_name, interleaved_to_half, pool_tensor, v1_config
from poc.model.transformer import Transformer
from poc.model.fp8 import fp8_mode
from poc.model.weights import (check_checkpoint, expected_keys, finish_fp8, index_checkpoint, iter_state_dict,
                               keep_fp8_experts, resolve_dtype, use_fp8)
from poc.parallel.pp import keep_stage
from poc.parallel.tp import apply_tp
from poc.protocol import v1


def load_shard(path: str | Path, dtype, device, stage: int = 0, n_stages: int = 1, tp_rank: int = 0,
               tp_size: int = 1, tp_group=None, fp8_experts: str | None = None,
               fp8: str | None = None, fp8_scales: str | None = None,
               tp_reduce: str = "fp32") -> tuple[Transformer, ModelConfig]:
    """A headless checkpoint model holding only this rank's stage layers and tensor-parallel slices, in eval mode.
    An FP8 checkpoint's W8A8 linears are sliced on 128-blocks with their scales (fp8.scale_slice), then take their
    scale format on the slice (fp8.use_scales: UE8M0 re-quantises per 128x128 block, so a slice is re-quantised as
    that part of the whole). tp_reduce: how the partial sums are all-reduced (tp.apply_tp)."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"model directory {path} does not exist", "model")
    cfg = ModelConfig.from_hf(path)
    dtype = resolve_dtype(dtype, cfg)
    with torch.device("meta"):
        model = Transformer(cfg, with_head=False)
    refs = index_checkpoint(path)
    dtypes, stack_experts = use_fp8(model, refs, fp8, fp8_experts)
    check_checkpoint(refs, model, expected_keys(model))  # the whole model against the file headers: reads nothing
    keep_stage(model, stage, n_stages)
    plan = apply_tp(model, tp_rank, tp_size, tp_group, tp_reduce)
    names = expected_keys(model)
    if stack_experts:  # only this rank's experts
        kept = keep_fp8_experts(model, refs, torch.device(device), w8a8=fp8_mode(fp8) == "w8a8")
        names = [n for n in names if n not in kept]
    sd = dict(iter_state_dict(refs, names, dtype, device, shard=plan, dtypes=dtypes))
    model.load_state_dict(sd, assign=True, strict=False)
    del sd
    left = [n for n, t in model.state_dict(keep_vars=True).items() if t.is_meta]
    if left:
        raise InputError(f"checkpoint did not fill {', '.join(left)}", "model")
    model.init_rope(torch.device(device))
    model.requires_grad_(False)
    finish_fp8(model, fp8, fp8_scales)
    return model.eval(), cfg


def build_v1_shard(p: v1.V1Params, block_hash: str, dtype: torch.dtype, device, stage: int = 0,
                   n_stages: int = 1, tp_rank: int = 0, tp_size: int = 1, tp_group=None, tp_reduce: str = "fp32",
                   workers: int | None = None) -> Transformer:
    """v1's random model (random_init.build_v1_model) as this rank's shard: same values, only its slices. workers:
    threads drawing the pool (random_init.pool_tensor)."""
    device = torch.device(device)
    cfg = v1_config(p)
    with torch.device("meta"):
        model = Transformer(cfg, with_head=True)
    model.embed_tokens = None  # in the pool's total, never used
    keep_stage(model, stage, n_stages)
    plan = apply_tp(model, tp_rank, tp_size, tp_group, tp_reduce)
    want = set(model.state_dict(keep_vars=True))
    pool = pool_tensor(block_hash, v1.pool_size(p.total_params), device, workers)
    sd = {}
    for ref, shape in v1.param_shapes(p):
        name = hf_name(ref)
        if name is None or name not in want:
            continue
        w = v1.place(pool, ref, shape, block_hash)  # float32, this one parameter in full (transient)
        if ref.endswith(("wq.weight", "wk.weight")):  # a permutation inside each head: slice after it
            w = interleaved_to_half(w, p.n_heads if ref.endswith("wq.weight") else p.n_kv_heads)
        if name in plan:
            dim, start, stop = plan[name]
            w = w.narrow(dim, start, stop - start)
        sd[name] = w.to(dtype, copy=True).contiguous()  # fp32 pool -> dtype, as the reference
        del w
    del pool
    model.load_state_dict(sd, strict=True, assign=True)
    model.init_rope(device, p.seq_len)
    model.requires_grad_(False)
    return model.eval()
