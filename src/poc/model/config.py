"""Model shape and numerics, read from a Hugging Face config.json (Llama, Qwen2, Qwen3, Qwen3-MoE, MiniMax-M2)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from poc.errors import InputError

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "minimax_m2")
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
                 "Qwen3MoeForCausalLM": "qwen3_moe", "MiniMaxM2ForCausalLM": "minimax_m2"}
ROUTERS = ("softmax", "sigmoid")
FP8_FORMATS = ("e4m3", "float8_e4m3fn")  # quantization_config.fmt: Qwen writes e4m3, MiniMax float8_e4m3fn (the same)
LLAMA3_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab_size: int
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama-3.1 rule: factor, low/high_freq_factor, original_max_position_embeddings
    qkv_bias: bool = False  # Qwen2 always; Llama when attention_bias
    o_bias: bool = False  # Llama/Qwen3 attention_bias also puts a bias on o_proj (Qwen2 never does)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    qk_norm_all_heads: bool = False  # MiniMax-M2: one RMSNorm over all heads' q (and k) at once, weights [H * D]
    rotary_dim: int = 0  # RoPE on the first rotary_dim dims of each head (MiniMax-M2: 64 of 128); 0: the whole head
    tie_embeddings: bool = False  # lm_head shares embed_tokens' matrix
    max_seq_len: int = 4096  # default size of the RoPE table; longer inputs grow it
    family: str = "llama"
    torch_dtype: str | None = None  # the checkpoint's dtype as config.json names it
    # Qwen3-MoE: a layer is sparse when is_moe_layer(i); a dense layer uses the ffn_dim MLP
    n_experts: int = 0  # 0: no MoE layers
    n_experts_per_tok: int = 0  # top-k
    moe_ffn_dim: int = 0  # each expert's intermediate size
    norm_topk_prob: bool = False  # renormalise the top-k router probabilities to sum to 1
    router: str = "softmax"  # softmax (Qwen3-MoE) or sigmoid (MiniMax-M2: a float32 router, see transformer.MoE)
    routing_bias: bool = False  # e_score_correction_bias: added to the scores to choose the experts, not to weigh them
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    fp8_block: tuple[int, int] | None = None  # FP8 checkpoint (quantization_config): its weight_block_size

    def __post_init__(self):
        sizes = ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab_size", "max_seq_len")
        bad = [f"{k}={getattr(self, k)}" for k in sizes if not (isinstance(getattr(self, k), int) and getattr(self, k) > 0)]
        if bad:
            raise InputError(f"model sizes must be positive integers: {', '.join(bad)}", "config")
        if self.n_heads % self.n_kv_heads:
            raise InputError(
                f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}", "config")
        if self.head_dim % 2:
            raise InputError(f"head_dim={self.head_dim} must be even for RoPE", "config")
        if not (isinstance(self.rotary_dim, int) and 0 <= self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise InputError(f"rotary_dim={self.rotary_dim} must be an even number of dims from 0 (the whole head) "
                             f"to head_dim={self.head_dim}", "config")
        if self.router not in ROUTERS:
            raise InputError(f"router={self.router!r} is not one of {', '.join(ROUTERS)}", "config")
        if not self.norm_eps > 0 or not self.rope_theta > 0:
            raise InputError(
                f"norm_eps={self.norm_eps} and rope_theta={self.rope_theta} must be positive", "config")
        if self.family not in FAMILIES:
            raise InputError(f"family={self.family!r} is not one of {', '.join(FAMILIES)}", "config")
        if self.rope_scaling is not None:
            missing = [k for k in LLAMA3_ROPE_KEYS if k not in self.rope_scaling]
            if missing:
                raise InputError(f"rope_scaling lacks {', '.join(missing)}", "rope_scaling")
            s = {k: float(self.rope_scaling[k]) for k in LLAMA3_ROPE_KEYS}
            if s["high_freq_factor"] <= s["low_freq_factor"] or s["factor"] <= 0:
                raise InputError(
                    f"rope_scaling needs high_freq_factor={s['high_freq_factor']} > "
                    f"low_freq_factor={s['low_freq_factor']} and factor={s['factor']} > 0", "rope_scaling")
            object.__setattr__(self, "rope_scaling", s)
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))
        if self.n_experts:
            moe = {k: getattr(self, k) for k in ("n_experts", "n_experts_per_tok", "moe_ffn_dim", "decoder_sparse_step")}
            bad = [f"{k}={v}" for k, v in moe.items() if not (isinstance(v, int) and v > 0)]
            if bad:
                raise InputError(f"MoE sizes must be positive integers: {', '.join(bad)}", "config")
            if self.n_experts_per_tok > self.n_experts:
                raise InputError(
                    f"num_experts_per_tok={self.n_experts_per_tok} exceeds num_experts={self.n_experts}", "config")

    def __hash__(self):  # the generated one would choke on the rope_scaling dict
        scaling = tuple(sorted(self.rope_scaling.items())) if self.rope_scaling else None
        return hash(tuple(scaling if k == "rope_scaling" else v for k, v in self.__dict__.items()))

    def is_moe_layer(self, i: int) -> bool:
        """Layer i uses the sparse MoE block (transformers' Qwen3MoeDecoderLayer rule)."""
        return i not in self.mlp_only_layers and self.n_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    @property
    def rope_dim(self) -> int:
        """The dims of each head that RoPE rotates (the first ones; the rest pass through)."""
        return self.rotary_dim or self.head_dim

    @property
    def n_rep(self) -> int:
        """Query heads per kv head."""
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_hf(cls, path_or_dict: str | Path | dict) -> ModelConfig:
        """Map a HF config.json (a model directory, the file itself, or its parsed dict)."""
        hf = path_or_dict if isinstance(path_or_dict, dict) else _read_json(Path(path_or_dict))
        family = _family(hf)

        def need(key: str) -> Any:
            if hf.get(key) is None:
                raise InputError(f"config.json lacks {key!r}", key)
            return hf[key]

        if hf.get("hidden_act", "silu") != "silu":
            raise InputError(f"hidden_act={hf['hidden_act']!r} is not supported (only silu)", "hidden_act")
        if hf.get("mlp_bias"):
            raise InputError("mlp_bias=true is not supported", "mlp_bias")
        if hf.get("use_sliding_window"):
            raise InputError("use_sliding_window=true is not supported", "use_sliding_window")
        if family == "minimax_m2":
            return _minimax_m2(cls, hf, need)

        rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
        attention_bias = bool(hf.get("attention_bias", False))
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        moe = {}
        if family == "qwen3_moe":
            n_experts = hf.get("num_experts", hf.get("num_local_experts"))  # transformers 5 saves num_local_experts
            if n_experts is None:
                raise InputError("config.json lacks 'num_experts'", "num_experts")
            if hf.get("shared_expert_intermediate_size"):
                raise InputError("shared experts are not supported", "shared_expert_intermediate_size")
            only = hf.get("mlp_only_layers") or []
            if not isinstance(only, list):
                raise InputError(f"mlp_only_layers must be a list, got {only!r}", "mlp_only_layers")
            moe = dict(n_experts=int(n_experts), n_experts_per_tok=int(need("num_experts_per_tok")),
                       moe_ffn_dim=int(need("moe_intermediate_size")),
                       norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                       decoder_sparse_step=int(hf.get("decoder_sparse_step") or 1), mlp_only_layers=tuple(only))
        try:
            dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
            return cls(
                dim=dim,
                n_layers=int(need("num_hidden_layers")),
                n_heads=n_heads,
                n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
                head_dim=int(hf.get("head_dim") or (dim // n_heads if n_heads > 0 else 0)),
                ffn_dim=int(need("intermediate_size")),
                vocab_size=int(need("vocab_size")),
                norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # the HF default for all three families
                rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                rope_scaling=_rope_scaling(hf),
                qkv_bias=family == "qwen2" or attention_bias,
                o_bias=family != "qwen2" and attention_bias,
                qk_norm=family in ("qwen3", "qwen3_moe"),
                tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
                max_seq_len=int(hf.get("max_position_embeddings") or 4096),
                family=family,
                torch_dtype=str(dtype).removeprefix("torch.") if dtype else None,
                fp8_block=_fp8_block(hf),
                **moe,
            )
        except InputError:
            raise
        except (TypeError, ValueError, ZeroDivisionError) as e:
            raise InputError(f"config.json has a value of the wrong type: {e}", "config") from None


def _minimax_m2(cls, hf: dict, need) -> ModelConfig:
    """MiniMax-M2 (MiniMaxM2ForCausalLM, `../shared/spec/minimax-m2.md`): every layer a sparse block of
    num_local_experts with a sigmoid router (use_routing_bias: e_score_correction_bias chooses the experts), the
    q/k norm over all heads (qk_norm_type per_layer) or per head, partial RoPE (rotary_dim, or transformers 5's
    rope_parameters.partial_rotary_factor). The multi-token-prediction modules it declares (use_mtp) are not part
    of the PoC forward: their tensors are skipped by the loader."""
    if hf.get("shared_intermediate_size"):
        raise InputError(f"shared_intermediate_size={hf['shared_intermediate_size']} (a shared expert) is not "
                         "supported", "shared_intermediate_size")
    attn_types = hf.get("attn_type_list")
    if attn_types is not None and (not isinstance(attn_types, list) or any(t != 1 for t in attn_types)):
        raise InputError("attn_type_list must be all 1 (full attention in every layer; MiniMax-M1's lightning "
                         "attention is not supported)", "attn_type_list")
    scoring = hf.get("scoring_func", "sigmoid")
    if scoring not in ROUTERS:
        raise InputError(f"scoring_func={scoring!r} is not supported ({' or '.join(ROUTERS)})", "scoring_func")
    norm_type = hf.get("qk_norm_type", "per_layer")
    if norm_type not in ("per_layer", "per_head"):
        raise InputError(f"qk_norm_type={norm_type!r} is not supported (per_layer or per_head)", "qk_norm_type")
    qk_norm = bool(hf.get("use_qk_norm", True))
    rope = hf.get("rope_parameters") if isinstance(hf.get("rope_parameters"), dict) else {}
    if rope.get("rope_type", "default") != "default":
        raise InputError(f"rope_type={rope.get('rope_type')!r} is not supported for minimax_m2 (default)",
                         "rope_parameters")
    n_heads = int(need("num_attention_heads"))
    dim = int(need("hidden_size"))
    try:
        head_dim = int(hf.get("head_dim") or dim // n_heads)
        rotary = hf.get("rotary_dim")
        if rotary is None:
            rotary = round(head_dim * float(rope.get("partial_rotary_factor", 1.0)))
        dtype = hf.get("torch_dtype") or hf.get("dtype")
        experts = int(need("num_local_experts"))
        return cls(
            dim=dim,
            n_layers=int(need("num_hidden_layers")),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            ffn_dim=int(need("intermediate_size")),  # the experts' width (MiniMax-M2 has no dense MLP)
            vocab_size=int(need("vocab_size")),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            qk_norm=qk_norm,
            qk_norm_all_heads=qk_norm and norm_type == "per_layer",
            rotary_dim=int(rotary) if int(rotary) != head_dim else 0,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_seq_len=int(hf.get("max_position_embeddings") or 4096),
            family="minimax_m2",
            torch_dtype=str(dtype).removeprefix("torch.") if dtype else None,
            fp8_block=_fp8_block(hf),
            n_experts=experts,
            n_experts_per_tok=int(need("num_experts_per_tok")),
            moe_ffn_dim=int(need("intermediate_size")),
            norm_topk_prob=True,  # the chosen experts' weights always sum to 1
            router=scoring,
            routing_bias=bool(hf.get("use_routing_bias", True)),  # transformers always has e_score_correction_bias
        )
    except InputError:
        raise
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise InputError(f"config.json has a value of the wrong type: {e}", "config") from None


def _read_json(path: Path) -> dict:
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise InputError(f"no config.json at {path}", "model")
    try:
        hf = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InputError(f"{path} is not valid JSON: {e}", "model") from None
    if not isinstance(hf, dict):
        raise InputError(f"{path} holds a JSON {type(hf).__name__}, not an object", "model")
    return hf


def _family(hf: dict) -> str:
    archs = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise InputError(
            f"model_type={model_type!r} is not supported (supported: {', '.join(FAMILIES)})", "model_type")
    for arch in archs:
        if ARCHITECTURES.get(arch) != model_type:
            raise InputError(
                f"architecture {arch!r} (model_type {model_type!r}) is not supported "
                f"(supported: {', '.join(ARCHITECTURES)})", "architectures")
    return model_type


def _fp8_block(hf: dict) -> tuple[int, int] | None:
    """The block shape of a block-FP8 checkpoint (fmt e4m3 as Qwen writes it, float8_e4m3fn as MiniMax does; per-block
    weight_scale_inv, dynamic activations); None without quantization_config; any other quantization is an error
    naming what it found."""
    q = hf.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise InputError(f"quantization_config must be an object, got {q!r}", "quantization_config")
    method, fmt, block = q.get("quant_method"), q.get("fmt", "e4m3"), q.get("weight_block_size")
    act = q.get("activation_scheme", "dynamic")
    if method != "fp8" or fmt not in FP8_FORMATS or act != "dynamic":
        raise InputError(f"quantization_config quant_method={method!r} fmt={fmt!r} activation_scheme={act!r} is not "
                         "supported (fp8, e4m3 or float8_e4m3fn, dynamic)", "quantization_config")
    if block != [128, 128]:
        raise InputError(f"quantization_config weight_block_size={block!r} is not supported ([128, 128])",
                         "quantization_config")
    return (128, 128)


def _rope_scaling(hf: dict) -> dict | None:
    """The Llama-3 scaling parameters, None for plain RoPE; any other rope_type is an error."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise InputError(f"rope_scaling must be an object, got {rope!r}", "rope_scaling")
    rope_type = rope.get("rope_type", rope.get("type"))
    if rope_type in (None, "default"):
        return None
    if rope_type != "llama3":
        raise InputError(f"rope_type={rope_type!r} is not supported (default or llama3)", "rope_scaling")
    scaling = {k: rope.get(k) for k in LLAMA3_ROPE_KEYS}
    if scaling["original_max_position_embeddings"] is None:  # HF falls back the same way
        scaling["original_max_position_embeddings"] = hf.get("max_position_embeddings")
    missing = [k for k, v in scaling.items() if v is None]
    if missing:
        raise InputError(f"llama3 rope scaling lacks {', '.join(missing)}", "rope_scaling")
    return scaling


PRESETS = {
    # the shape of golden/v2_tiny/qwen3
    "tiny": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=256,
                        norm_eps=1e-6, rope_theta=1e6, qk_norm=True, family="qwen3", torch_dtype="float32"),
    # tiny with four layers: a pipeline of up to four stages (the CPU tests and smoke runs of pp=4)
    "tiny-4l": ModelConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=256,
                           norm_eps=1e-6, rope_theta=1e6, qk_norm=True, family="qwen3", torch_dtype="float32"),
    "qwen3-0.6b": ModelConfig(dim=1024, n_layers=28, n_heads=16, n_kv_heads=8, head_dim=128, ffn_dim=3072,
                              vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, tie_embeddings=True,
                              max_seq_len=40960, family="qwen3", torch_dtype="bfloat16"),
    "qwen3-8b": ModelConfig(dim=4096, n_layers=36, n_heads=32, n_kv_heads=8, head_dim=128, ffn_dim=12288,
                            vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=40960,
                            family="qwen3", torch_dtype="bfloat16"),
    "tiny-moe": ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=128, vocab_size=256,
                            norm_eps=1e-6, rope_theta=1e6, qk_norm=True, family="qwen3_moe", torch_dtype="float32",
                            n_experts=8, n_experts_per_tok=2, moe_ffn_dim=128, norm_topk_prob=True),
    # Qwen3-MoE shapes (the Hub's config.json): 128 experts, top 8, every layer sparse
    "qwen3-30b-a3b": ModelConfig(dim=2048, n_layers=48, n_heads=32, n_kv_heads=4, head_dim=128, ffn_dim=6144,
                                 vocab_size=151936, norm_eps=1e-6, rope_theta=1e6, qk_norm=True, max_seq_len=40960,
                                 family="qwen3_moe", torch_dtype="bfloat16", n_experts=128, n_experts_per_tok=8,
                                 moe_ffn_dim=768, norm_topk_prob=True),
    "qwen3-235b-a22b": ModelConfig(dim=4096, n_layers=94, n_heads=64, n_kv_heads=4, head_dim=128, ffn_dim=12288,
                                   vocab_size=151936, norm_eps=1e-6, rope_theta=5e6, qk_norm=True, max_seq_len=262144,
                                   family="qwen3_moe", torch_dtype="bfloat16", n_experts=128, n_experts_per_tok=8,
                                   moe_ffn_dim=1536, norm_topk_prob=True),
    # MiniMax-M2 shapes: the release's config.json (MiniMax-M2.7 has M2's shape), and a tiny one for tests and smoke
    # runs (two kv heads and eight experts: tp=2 splits both; rotary_dim < head_dim)
    "minimax-m2.7": ModelConfig(dim=3072, n_layers=62, n_heads=48, n_kv_heads=8, head_dim=128, ffn_dim=1536,
                                vocab_size=200064, norm_eps=1e-6, rope_theta=5e6, qk_norm=True, qk_norm_all_heads=True,
                                rotary_dim=64, max_seq_len=196608, family="minimax_m2", torch_dtype="bfloat16",
                                n_experts=256, n_experts_per_tok=8, moe_ffn_dim=1536, norm_topk_prob=True,
                                router="sigmoid", routing_bias=True),
    "tiny-minimax": ModelConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=128, ffn_dim=128,
                                vocab_size=256, norm_eps=1e-6, rope_theta=5e6, qk_norm=True, qk_norm_all_heads=True,
                                rotary_dim=64, family="minimax_m2", torch_dtype="float32", n_experts=8,
                                n_experts_per_tok=2, moe_ffn_dim=128, norm_topk_prob=True, router="sigmoid",
                                routing_bias=True),
}
