"""ModelOptions: how a model is built and computed, the one typed door for its numerics settings.

Made once at start-up and checked where it is made: each setting's allowed values are its `Literal` type, written
once below, and `__post_init__` checks every field against its type (nothing downstream checks a value again). The
server makes it in ServerConfig, the CLI and the bench with `ModelOptions.from_env(os.environ, **flags)` (each field
names its POC_* variable and flag here); the engines hand it whole to the builder (parallel/build.py), which hands it
to the loaders and the model, and a rank process gets it in its RankConfig. The model reads it when it is built
(transformer.Transformer): no code outside the model room sets a setting on a built model (tests/test_layers.py).
The defaults are what the network's validators compute. Plain data, no torch: the server's config imports it before
any model code.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Mapping, get_args, get_origin, get_type_hints

from poc.errors import InputError
from poc.switches import env_flag

# each setting's values, written once: the type, and the tuple the flags' help and the tests read
Attention = Literal["auto", "fp8", "fp8kv", "bf16"]  # model/attention.py's recipes, or auto (attention_for)
Fp8Forward = Literal["w8a8", "dequant"]
Fp8Scales = Literal["ue8m0", "float32"]
Fp8Experts = Literal["keep", "dequant"]
TpReduce = Literal["fp32", "model"]
RouterGemm = Literal["auto", "split", "float32"]  # MiniMax-M2's float32 router GEMM (router_gemm_for)
ATTENTIONS, FP8_FORWARDS, FP8_SCALES, FP8_EXPERTS, TP_REDUCES, ROUTER_GEMMS = (
    get_args(t) for t in (Attention, Fp8Forward, Fp8Scales, Fp8Experts, TpReduce, RouterGemm))


def _switch(default, env: str, flag: str | None = None):
    """A field set by the POC_* variable `env` (and the server's flag `flag`, which wins over it)."""
    return field(default=default, metadata={"env": env, "flag": flag})


@dataclass(frozen=True)
class ModelOptions:
    fp8: Fp8Forward = _switch("w8a8", "POC_FP8")  # an FP8 checkpoint's forward: w8a8 (the validators') or dequant
    fp8_scales: Fp8Scales = _switch("ue8m0", "POC_FP8_SCALES", "--fp8-scales")  # W8A8's scale format (Hopper: ue8m0)
    fp8_experts: Fp8Experts = _switch("keep", "POC_FP8_EXPERTS", "--fp8-experts")  # fp8=dequant: MoE experts
    fused_norm: bool = _switch(True, "POC_FP8_FUSED_NORM")  # W8A8 on CUDA: a norm + its readers' quantiser, one kernel
    gluon: bool = _switch(True, "POC_FP8_GLUON")  # W8A8 experts on Hopper: the Gluon kernels, else Triton's (same bits)
    tp_reduce: TpReduce = _switch("fp32", "POC_TP_REDUCE")  # tp/ep partial sums all-reduced in fp32 or the model dtype
    pool_workers: int | None = _switch(None, "POC_POOL_WORKERS")  # threads drawing v1's pool; None: the CPUs
    attention: Attention = _switch("auto", "POC_ATTENTION", "--attention")  # the attention recipe (model/attention.py)
    router_gemm: RouterGemm = _switch("auto", "POC_ROUTER_GEMM")  # a sigmoid router's float32 GEMM (router_gemm_for)
    # not a switch: the engine compiles the decoder layers (CUDA, --compile), and the MoE dispatch's elementwise steps
    # are then compiled kernels too (experts.dispatch_stacked's `fast`); the engines set it when they build
    compiled: bool = False

    def __post_init__(self):
        hints = get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value, allowed = getattr(self, f.name), values(hints[f.name])
            if allowed is not None and value not in allowed:
                raise InputError(f"{_names(f)} must be {' or '.join(allowed)}, got {value!r}", f.name)
            if hints[f.name] is bool and not isinstance(value, bool):
                raise InputError(f"{_names(f)} must be 0 or 1, got {value!r}", f.name)
        if self.pool_workers is not None and (not isinstance(self.pool_workers, int) or self.pool_workers < 1):
            raise InputError(f"POC_POOL_WORKERS must be an integer >= 1, got {self.pool_workers!r}", "pool_workers")

    @classmethod
    def from_env(cls, env: Mapping[str, str], **flags) -> "ModelOptions":
        """The options the POC_* variables of `env` set (an on/off switch takes 0 or 1), `flags` (the server's
        --fp8-scales, --fp8-experts, --attention; None: not given) winning over them, the defaults for the rest. A bad
        value is an InputError naming the variable."""
        hints, kw = get_type_hints(cls), {}
        for f in dataclasses.fields(cls):
            var = f.metadata.get("env")
            raw = env.get(var, "").strip() if var else ""
            if not raw:
                continue
            if hints[f.name] is bool:
                kw[f.name] = env_flag(env, var, f.default, f.name)
            elif f.name == "pool_workers":
                try:
                    kw[f.name] = int(raw)
                except ValueError:
                    raise InputError(f"{var} must be an integer >= 1, got {raw!r}", f.name) from None
            else:
                kw[f.name] = raw
        kw.update({k: str(v).strip() for k, v in flags.items() if v is not None})
        return cls(**kw)

    def attention_for(self, cfg) -> str:
        """The attention recipe a model of `cfg` (a ModelConfig) computes: the one asked for, or with auto the
        validators' own: `fp8` (Q, K, V and P in FP8, vLLM 0.25 on Hopper with an fp8 KV cache) for an FP8
        MiniMax-M2 checkpoint computed W8A8, `bf16` (attention in the model dtype) for every other model."""
        if self.attention != "auto":
            return self.attention
        fp8 = cfg.fp8_block is not None and self.fp8 == "w8a8"
        return "fp8" if cfg.family == "minimax_m2" and fp8 else "bf16"

    def router_gemm_for(self, device) -> str:
        """How a sigmoid router (MiniMax-M2: a float32 gate on the bfloat16 hidden state) computes its float32 GEMM
        on `device`: `split` (the gate as the exact sum of three bfloat16 parts, one bfloat16 GEMM with a float32
        output: every product exact, summed in float32 on the tensor cores; route.split_logits) or `float32` (a
        float32 GEMM: FFMA on CUDA). auto: split on CUDA, float32 elsewhere (the split triples a CPU's work). On an
        H200 at a batch's 65,536 tokens the split takes 0.55 ms a layer against FFMA's 2.09, its logits' mean error
        against float64 2.8e-6 against 7.7e-7 (the tensor cores' accumulation), no token's top 8 chosen otherwise
        (benchmarks/h200/router_gemm.json). The split applies to a bfloat16 model only (its router input is
        bfloat16: the products are exact)."""
        if self.router_gemm != "auto":
            return self.router_gemm
        return "split" if getattr(device, "type", device) == "cuda" else "float32"


def values(hint) -> tuple[str, ...] | None:
    """The allowed values of a Literal-typed setting (its type's arguments); None for another type."""
    return get_args(hint) if get_origin(hint) is Literal else None


def _names(f: dataclasses.Field) -> str:
    """How a setting is named to a person: its flag and its variable, or the field."""
    names = [n for n in (f.metadata.get("flag"), f.metadata.get("env")) if n]
    return " / ".join(names) or f.name
