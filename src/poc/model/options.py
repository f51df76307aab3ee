"""ModelOptions: how a model is built and computed, chosen once at start-up and passed down.

The server reads them in ServerConfig (flags and POC_* environment variables, server/config.py), the CLI and the
bench in their argument parsing; the engines hand them to the loaders, the tensor-parallel rewrite and the compute
(a rank process gets them in its RankConfig), and nothing below reads the environment. The defaults are what the
network's validators compute. Plain data, no torch: the server's config imports it before any model code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from poc.errors import InputError

# each setting's values, written once: the type, and the tuple the checks and the flags' help read
Attention = Literal["auto", "fp8", "fp8kv", "bf16"]  # model/attention.py's recipes, or auto (attention_for)
Fp8Forward = Literal["w8a8", "dequant"]
Fp8Scales = Literal["ue8m0", "float32"]
Fp8Experts = Literal["keep", "dequant"]
TpReduce = Literal["fp32", "model"]
ATTENTIONS, FP8_FORWARDS, FP8_SCALES, FP8_EXPERTS, TP_REDUCES = (
    get_args(t) for t in (Attention, Fp8Forward, Fp8Scales, Fp8Experts, TpReduce))


@dataclass(frozen=True)
class ModelOptions:
    fp8: Fp8Forward = "w8a8"  # an FP8 checkpoint's forward: w8a8 (the validators' recipe) or dequant (POC_FP8)
    fp8_scales: Fp8Scales = "ue8m0"  # W8A8's scale format: ue8m0 (Hopper validators) or float32 (POC_FP8_SCALES)
    fp8_experts: Fp8Experts = "keep"  # with fp8=dequant, a Qwen3-MoE's FP8 experts: keep or dequant at load
    fused_norm: bool = True  # W8A8 on CUDA: a norm and its readers' quantiser in one kernel (POC_FP8_FUSED_NORM)
    gluon: bool = True  # W8A8 experts on Hopper: the Gluon kernels, else the Triton ones, same bits (POC_FP8_GLUON)
    tp_reduce: TpReduce = "fp32"  # tp/ep partial sums all-reduced in fp32 or in the model dtype (POC_TP_REDUCE)
    pool_workers: int | None = None  # threads drawing v1's pool; None: the CPUs, a rank its share (POC_POOL_WORKERS)
    attention: Attention = "auto"  # the attention recipe (model/attention.py; POC_ATTENTION, --attention)

    def __post_init__(self):
        for name, value, allowed in (("POC_ATTENTION", self.attention, ATTENTIONS),
                                     ("POC_FP8", self.fp8, FP8_FORWARDS),
                                     ("POC_FP8_SCALES", self.fp8_scales, FP8_SCALES),
                                     ("POC_FP8_EXPERTS", self.fp8_experts, FP8_EXPERTS),
                                     ("POC_TP_REDUCE", self.tp_reduce, TP_REDUCES)):
            if value not in allowed:
                raise InputError(f"{name} must be {' or '.join(allowed)}, got {value!r}", name.lower()[4:])
        if self.pool_workers is not None and (not isinstance(self.pool_workers, int) or self.pool_workers < 1):
            raise InputError(f"POC_POOL_WORKERS must be an integer >= 1, got {self.pool_workers!r}", "pool_workers")

    def attention_for(self, cfg) -> str:
        """The attention recipe a model of `cfg` (a ModelConfig) computes: the one asked for, or with auto the
        validators' own: `fp8` (Q, K, V and P in FP8, vLLM 0.25 on Hopper with an fp8 KV cache) for an FP8
        MiniMax-M2 checkpoint computed W8A8, `bf16` (attention in the model dtype) for every other model."""
        if self.attention != "auto":
            return self.attention
        fp8 = cfg.fp8_block is not None and self.fp8 == "w8a8"
        return "fp8" if cfg.family == "minimax_m2" and fp8 else "bf16"
