"""Pipeline stages: a stage is the same Transformer with fewer layer keys; activations move with send/recv.

Blocks stay keyed by their global layer index, so checkpoint names match and the v2 reflection of layer i is row
i of the full table on whichever stage holds it (spec-v2 §b). A stage without the final norm returns the
un-normed (B, S, D) output of its last layer, which the next stage receives as its input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from poc.model.transformer import Transformer
from poc.parallel.layout import stage_layers


def keep_stage(model: Transformer, stage: int, n_stages: int) -> Transformer:
    """Delete the layers outside this stage's range; the norm and lm_head stay on the last stage only."""
    if n_stages == 1:
        return model
    keep = stage_layers(model.cfg.n_layers, n_stages)[stage]
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    if stage != n_stages - 1:
        model.norm = None
        model.lm_head = None
    if stage != 0:
        model.embed_tokens = None
    return model


def send(h: torch.Tensor, dst: int, group=None) -> None:
    """Hand a stage's (B, S, D) output to the next stage (global rank `dst`)."""
    dist.send(h.contiguous(), dst, group=group)


def recv(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, src: int, group=None) -> torch.Tensor:
    """The previous stage's (B, S, D) output (global rank `src`); shape and dtype are known from the job."""
    h = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(h, src, group=group)
    return h
