"""torch.compile for the model's functions, computing eager's bits: what the engine compiles and how.

The model's few fused helpers (the experts' SwiGLU and combine) and the engines' per-layer steps compile through
maybe_compile, so every compiled graph in the process gets the same inductor settings (eager_numerics).
"""

from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("poc.compute")


def eager_numerics() -> dict:
    """Make inductor's kernels round as eager PyTorch does, so the compiled path gives eager's bits:

    - emulate_precision_casts: round to bf16/fp16 wherever eager would, inside fused kernels;
    - division_rounding: IEEE division (div_rn), where Triton's `/` is an approximate div.full;
    - use_pytorch_libdevice: the CUDA toolkit's libdevice, as eager's kernels use;
    - no FMA contraction (TRITON_DEFAULT_FP_FUSION=0): eager rounds a*b before adding c;
    - no folding of x.to(bf16).float() into x.float() (_keep_lossy_casts).
    The model's reductions are exact (numerics.sum_exact), so their order does not matter either.
    Knobs this torch lacks are skipped; the returned dict says which were set."""
    import torch._inductor.config as inductor_config

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")
    set_ = {}
    try:
        import triton

        lang = getattr(getattr(triton, "knobs", None), "language", None)
        if lang is not None and hasattr(lang, "default_fp_fusion"):
            lang.default_fp_fusion = os.environ["TRITON_DEFAULT_FP_FUSION"] == "1"
            set_["fp_fusion"] = lang.default_fp_fusion
    except ImportError:
        pass
    if hasattr(inductor_config, "emulate_precision_casts"):
        inductor_config.emulate_precision_casts = True
        set_["emulate_precision_casts"] = True
    en = getattr(inductor_config, "eager_numerics", None)
    for knob in ("division_rounding", "use_pytorch_libdevice"):
        if en is not None and hasattr(en, knob):
            setattr(en, knob, True)
            set_[knob] = True
    set_["keep_lossy_casts"] = _keep_lossy_casts()
    return set_


def _keep_lossy_casts() -> bool:
    """Stop inductor's `pointless_convert` pass from folding x.to(bf16).float() into x.float().

    That pass (torch <= 2.11 applies it even under emulate_precision_casts; newer versions skip lossy chains
    themselves) drops the rounding to bf16 that eager does, e.g. RMSNorm's normalised value before the weight.
    Its handler is wrapped so that a chain whose middle dtype is narrower than its input is left alone.
    Returns whether the handler was found (False: this torch has no such pass, nothing to do)."""
    try:
        from torch._inductor.fx_passes import joint_graph
    except ImportError:
        return False
    found = False
    for entries in getattr(getattr(joint_graph, "patterns", None), "patterns", {}).values():
        for entry in entries:
            handler = getattr(entry, "handler", None)
            if getattr(handler, "__name__", "") != "pointless_convert":
                continue
            found = True
            if getattr(handler, "_poc_keeps_lossy", False):
                continue

            def keep_lossy(match, *args, _orig=handler, **kwargs):
                arg, dtype1 = kwargs.get("arg"), kwargs.get("dtype1")
                val = getattr(arg, "meta", {}).get("val")
                if isinstance(val, torch.Tensor) and isinstance(dtype1, torch.dtype) and \
                        val.dtype.is_floating_point and dtype1.itemsize < val.dtype.itemsize:
                    return None  # eager rounds to dtype1 here: keep the cast
                return _orig(match, *args, **kwargs)

            keep_lossy.__name__ = "pointless_convert"
            keep_lossy._poc_keeps_lossy = True
            try:
                entry.handler = keep_lossy
            except (AttributeError, TypeError):  # a torch whose pattern entries are frozen: leave the pass alone
                log.warning("could not guard inductor's pointless_convert pass; compiled results may differ from "
                            "eager by bf16 rounding")
                return False
    return found


def maybe_compile(fn, enabled: bool, dynamic: bool = False):
    """torch.compile at fixed shapes when asked (CUDA); the eager function otherwise.

    Inductor is set to compute eager's bits first (eager_numerics)."""
    if not enabled:
        return fn
    import torch._dynamo.config as dynamo_config

    eager_numerics()
    # one graph per (batch, seq_len, last-layer) shape, shared by every engine in the process: the default
    # limit of 8 would silently fall back to eager after a few shapes
    dynamo_config.cache_size_limit = max(dynamo_config.cache_size_limit, 256)
    if hasattr(dynamo_config, "accumulated_cache_size_limit"):
        dynamo_config.accumulated_cache_size_limit = max(dynamo_config.accumulated_cache_size_limit, 4096)
    return torch.compile(fn, dynamic=dynamic)


_SHAPES_SEEN: set = set()


def note_new_shape(what: str, batch: int, seq_len: int) -> bool:
    """Log, once per process and shape, that a compiled path meets a new (batch, seq_len): that batch compiles
    first (tens of seconds on a large model; the graphs are then reused). Returns whether the shape was new."""
    key = (what, batch, seq_len)
    if key in _SHAPES_SEEN:
        return False
    _SHAPES_SEEN.add(key)
    log.info("%s: compiling for batch %d x seq_len %d (once per shape in this process: this batch takes longer)",
             what, batch, seq_len, extra={"every_rank": True})  # every rank process says it: a cold replica shows
    return True
