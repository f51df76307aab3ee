"""build(): the one way to get a model, whole or a rank's part of it, from any source.

A source (model/source.py, parsed once) is a checkpoint directory (Checkpoint: safetensors, model/weights.py), a
random preset `random:<preset>[:fp8]` (RandomPreset: random weights of a real shape, model/random_weights.py) or PoC
v1's random model of (params, block hash) (V1Weights: model/random_init.py). A `Part` (pipeline stage,
tensor-parallel rank and group) is applied to the model built on meta before anything is allocated (pp.keep_stage,
tp.apply_tp), so a rank reads or draws only its own layers, slices and experts, and holds the same values as the
whole model in that place. The single-device Engine and the
rank processes (poc.engine) both build through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from poc.model.config import ModelConfig
from poc.model.options import ModelOptions, TpReduce
from poc.model.random_init import build_v1_model
from poc.model.random_weights import random_model
from poc.model.source import ModelSource, RandomPreset, V1Weights, parse
from poc.model.transformer import Transformer
from poc.model.weights import load_model, resolve_dtype
from poc.parallel.pp import keep_stage
from poc.parallel.tp import Plan, apply_tp


@dataclass(frozen=True)
class Part:
    """A rank's part of a model: stage `stage` of `n_stages`, tensor-parallel rank `tp_rank` of `tp_size`; `group`
    the tp process group (None: no all-reduce, the caller sums the partial outputs, as tests do), whose partial sums
    are all-reduced in fp32 or, with tp_reduce "model", rounded to the model dtype first (ModelOptions.tp_reduce)."""

    stage: int = 0
    n_stages: int = 1
    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None
    tp_reduce: TpReduce = "fp32"

    def shard(self, model: Transformer) -> Plan:
        """Cut a meta-built (or built) model down to this part; the slices cut, for the loader."""
        keep_stage(model, self.stage, self.n_stages)
        return apply_tp(model, self.tp_rank, self.tp_size, self.group, self.tp_reduce)


def build(source: str | Path | ModelSource, dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu",
          part: Part | None = None, options: ModelOptions | None = None, *, with_head: bool = False,
          progress: bool = False, stop=None) -> tuple[Transformer, ModelConfig]:
    """(model, config) in eval mode: the whole model, or only `part` of it, built and computed as `options` say
    (ModelOptions; None: the defaults, the validators' arithmetic).

    dtype: "auto" (the checkpoint's or preset's own) or a name / torch dtype; a v1 model takes a torch dtype.
    A checkpoint: headless unless `with_head`, a progress bar on stderr with `progress`; an FP8 one computed as
    options.fp8 says (w8a8 or dequant), W8A8 in scale format options.fp8_scales, its Qwen3-MoE experts kept FP8 or
    dequantised (options.fp8_experts). A preset: headless and fused, `:fp8` an FP8 checkpoint's model. A v1 model:
    with its head, its pool drawn by options.pool_workers threads (None: the CPUs); `stop` (a threading.Event), once
    set, ends the build with random_init.BuildStopped."""
    options = options or ModelOptions()
    shard = part.shard if part is not None else None
    source = parse(source)
    if isinstance(source, V1Weights):
        model = build_v1_model(source.params, source.block_hash, dtype, device, stop=stop, shard=shard,
                               workers=options.pool_workers)
        return model, model.cfg
    if isinstance(source, RandomPreset):
        cfg = source.config()
        model = random_model(cfg, resolve_dtype(dtype, cfg), device, fp8_ckpt=source.fp8, shard=shard, options=options)
        return model, model.cfg
    return load_model(source.path, dtype, device, with_head=with_head, progress=progress, options=options,
                      shard=shard)
