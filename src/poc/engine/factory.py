"""make_engine(): the one place an engine is chosen, for the server, the CLI and the bench.

One device does everything: an Engine in this process. Several (tensor or pipeline parallel, or replicas): a
DistEngine over that many rank processes. layout="auto": tp, pp and replicas are what poc.engine.auto picks for the
model on the visible GPUs (one process on the CPU), logged with its reasons.
"""

from __future__ import annotations

import logging

import torch

from poc.engine.base import EngineBase
from poc.engine.compute import resolve_device
from poc.engine.engine import Engine
from poc.errors import InputError
from poc.model.options import ModelOptions
from poc.model.source import ModelSource
from poc.model.source import parse as parse_source

log = logging.getLogger("poc.engine")


def world_for(device: torch.device, tp: int, pp: int, replicas: int | None = None, devices: int | None = None) -> int:
    """How many ranks: on CUDA every usable GPU (or `devices` of them, or `replicas` groups), whole groups of
    tp x pp only; on CPU tp x pp x replicas (default 1) processes."""
    group = tp * pp
    if device.type != "cuda":
        return group * (replicas or 1)
    have = torch.cuda.device_count()
    n = devices or have
    if n > have:
        raise InputError(f"--devices {n} but only {have} GPUs are visible", "devices")
    if replicas:
        n = min(n, replicas * group)
    if n < group:
        raise InputError(f"tp={tp} x pp={pp} needs {group} GPUs; {n} are usable", "tp")
    if n % group:
        log.warning("%d GPUs do not split into groups of tp x pp = %d: using %d", n, group, n - n % group)
    return n - n % group


def make_engine(device: str | None = None, model_dir: "str | ModelSource | None" = None, dtype: str = "auto",
                tp: int = 1, pp: int = 1, replicas: int | None = None, devices: int | None = None, layout: str = "",
                **kw) -> EngineBase:
    """An Engine in this process when one device does everything, else a DistEngine over world ranks (`kw`: the
    engines' own: compile, options (ModelOptions: the server's ServerConfig.options), and DistEngine's, e.g.
    diagnostics (RankDiagnostics)). replicas None (or 0): on CUDA as many as the visible GPUs allow. model_dir
    (a checkpoint directory or random:<preset>[:fp8]) is parsed here, once (model/source.py)."""
    source = parse_source(model_dir) if model_dir else None
    if layout == "auto":
        from poc.engine import auto

        o = kw.get("options") or ModelOptions()
        gpus = auto.detect_gpus() if device in (None, "", "auto") or device.startswith("cuda") else []
        choice = auto.for_model(source, dtype, gpus, o)
        log.info("--layout auto: %s", choice.why)
        tp, pp, replicas = choice.tp, choice.pp, choice.replicas
    elif layout:
        raise InputError(f"layout must be auto (or left out), got {layout!r}", "layout")
    world = world_for(resolve_device(device), tp, pp, replicas, devices)
    if world == 1:
        return Engine(device=device, model_dir=source, dtype=dtype, compile=kw.pop("compile", False),
                      options=kw.pop("options", None))
    from poc.engine.dist import DistEngine

    return DistEngine(device=device, model_dir=source, dtype=dtype, tp=tp, pp=pp, world=world, **kw)
