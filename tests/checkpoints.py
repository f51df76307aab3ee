"""Tiny random checkpoints written on the fly: transformers' Llama/Qwen2/Qwen3/Qwen3-MoE saved with random weights,
their FP8 form as Qwen ships it (with a dequantised bf16 twin), and unit reflection vectors. Nothing is downloaded.

The factories need transformers (a test extra): a test module that calls them skips itself without it
(`pytest.importorskip("transformers")`).
"""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import load_file, save_file

from poc.model.weights import dequantize_fp8

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

DENSE_CASES = {  # name: (family, config overrides)
    "llama-gqa": ("llama", {}),
    "llama-mha-tied-bias": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)),
    "llama3-rope-scaling": ("llama", dict(max_position_embeddings=131072, rope_theta=500000.0,
                                          rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-gqa": ("qwen3", {}),
    "qwen3-mha-tied": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
}

MOE_CASES = {  # name: Qwen3-MoE config overrides; both layer kinds appear in each
    "mlp-only-layer-norm-topk": dict(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                                     norm_topk_prob=True),
    "sparse-step-2-no-norm": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[],
                                  norm_topk_prob=False),
    "top-3-of-6-tied": dict(num_experts=6, num_experts_per_tok=3, decoder_sparse_step=1, mlp_only_layers=[0],
                            norm_topk_prob=True, tie_word_embeddings=True),
}


def hf_config(family: str, **overrides):
    import transformers

    kw = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False)
    if family == "qwen3":
        kw["head_dim"] = 24  # Qwen3 decouples head_dim from hidden/heads (0.6B: 16 x 128 > 1024)
    kw.update(overrides)
    if "rope_parameters" not in kw:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": kw["rope_theta"]}
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}
    return cls[family](**kw)


def randomize(model: torch.nn.Module) -> None:
    """Weights large enough that attention is far from uniform, and norms/biases far from their 1/0 init."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 1.5 / math.sqrt(p.shape[-1]))


def make_hf(tmp_path, family: str, **overrides):
    """A randomized transformers Llama/Qwen2/Qwen3 (eval mode, eager attention) saved as safetensors in tmp_path."""
    import transformers

    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    cfg = hf_config(family, **overrides)
    cfg._attn_implementation = "eager"
    hf = cls(cfg)
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf.eval()


def hf_moe_config(**overrides):
    import transformers

    kw = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=128, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              tie_word_embeddings=False)
    kw.update(overrides)
    cfg = transformers.Qwen3MoeConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def make_hf_moe(tmp_path, **overrides):
    """A randomized transformers Qwen3-MoE (eval mode) saved as safetensors in tmp_path."""
    import transformers

    hf = transformers.Qwen3MoeForCausalLM(hf_moe_config(**overrides))
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf.eval()


def unit_rows(n: int, d: int, seed: int = 2) -> torch.Tensor:
    """n random unit vectors of width d (reflection vectors)."""
    v = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm(dim=-1, keepdim=True)


# --- FP8 as Qwen ships it ------------------------------------------------------------------------------------------

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def quantize(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block amax/448 scales (what Qwen's weight_scale_inv holds) and the weight / scale rounded to e4m3."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block), math.ceil(cols / block)
    padded = torch.zeros(nr * block, nc * block)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, block, nc, block)  # (R, C) -> (R/b, b, C/b, b)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # (R/b, C/b)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nr * block, nc * block)
    return q[:rows, :cols].to(torch.float8_e4m3fn).contiguous(), scale


def quantized(name: str, t: torch.Tensor) -> bool:
    """Qwen's FP8 checkpoints keep embeddings, lm_head, norms and the MoE router in bf16."""
    return t.dim() == 2 and name.endswith(".weight") and not any(
        k in name for k in ("embed_tokens", "lm_head", "norm", "mlp.gate.weight"))


def write_fp8_and_twin(src, fp8_dir, twin_dir) -> int:
    """fp8_dir: the quantised checkpoint; twin_dir: the same dequantised weights (rounded to bf16) as a plain
    bf16 checkpoint. Returns how many weights were quantised."""
    sd, cfg = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    fp8, twin = {}, {}
    for name, t in sd.items():
        if quantized(name, t):
            q, s = quantize(t)
            fp8[name], fp8[name.removesuffix("weight") + "weight_scale_inv"] = q, s
            twin[name] = dequantize_fp8(q, s).bfloat16()
        else:
            fp8[name] = twin[name] = t.bfloat16()
    for d, tensors, extra in ((fp8_dir, fp8, {"quantization_config": QUANT}), (twin_dir, twin, {})):
        d.mkdir()
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**cfg, "dtype": "bfloat16", **extra}))
    return sum(quantized(n, t) for n, t in sd.items())


# --- MiniMax-M2 as transformers 5.23 saves it, and its FP8 form as MiniMax ships it ------------------------------------

MINIMAX_RELEASE_FIELDS = {  # config.json fields of the release that transformers 5.23 does not write
    "architectures": ["MiniMaxM2ForCausalLM"], "use_qk_norm": True, "qk_norm_type": "per_layer",
    "scoring_func": "sigmoid", "use_routing_bias": True, "shared_intermediate_size": 0, "use_mtp": True,
    "num_mtp_modules": 3, "mtp_transformer_layers": 1}


def hf_minimax_config(**overrides):
    import transformers

    kw = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, rotary_dim=8, vocab_size=128, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=5e6, num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False, bos_token_id=1,
              eos_token_id=2)
    kw.update(overrides)
    cfg = transformers.MiniMaxM2Config(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def make_hf_minimax(tmp_path, bias_std: float = 0.1, **overrides):
    """A randomized transformers MiniMaxM2ForCausalLM (eval mode, eager attention) saved in tmp_path in the
    release's layout (transformers 5.23 writes block_sparse_moe / experts.E.w1|w2|w3), its config.json given the
    release's own fields (rotary_dim, scoring_func, use_routing_bias, the MTP declaration, ...). The routing bias
    is N(0, bias_std): large enough to change many tokens' chosen experts."""
    import transformers

    hf = transformers.MiniMaxM2ForCausalLM(hf_minimax_config(**overrides))
    randomize(hf)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in hf.model.layers:
            b = layer.mlp.e_score_correction_bias
            b.copy_(bias_std * torch.randn(b.shape, generator=g))
    hf.save_pretrained(tmp_path, safe_serialization=True)
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg.update(MINIMAX_RELEASE_FIELDS, rotary_dim=hf.config.rotary_dim, rope_theta=hf.config.rope_parameters["rope_theta"])
    path.write_text(json.dumps(cfg))
    return hf.eval()


# a MiniMax-M2 whose every linear and expert splits on 128-blocks (so they run W8A8 as in production, also at tp=2):
# 256 wide, 4 heads and 2 kv heads of 128 (rotary_dim 64), 8 experts of 128, top 2, two layers
MINIMAX_WIDE = dict(hidden_size=256, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                    rotary_dim=64, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2)

MINIMAX_QUANT = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
                 "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}


def minimax_quantized(name: str, t: torch.Tensor) -> bool:
    """MiniMax's FP8 release keeps embeddings, lm_head, norms, the router (float32) and its bias unquantised."""
    return t.dim() == 2 and name.endswith(".weight") and not any(
        k in name for k in ("embed_tokens", "lm_head", "norm", "block_sparse_moe.gate."))


def write_minimax_fp8(src, dst, fmt: str = "float8_e4m3fn", mtp_layers: int = 0, seed: int = 11) -> dict:
    """The checkpoint in src (make_hf_minimax) as MiniMax ships its FP8 release, in dst: the linears float8_e4m3fn
    with float32 128x128 block scales (weight_scale_inv), norms and embeddings bf16, the router and its bias float32,
    quantization_config with `fmt` (float8_e4m3fn as MiniMax writes it; e4m3 as Qwen does); with mtp_layers, that
    many multi-token-prediction layers' tensors under model.layers.{n_layers + i} (as vLLM's loader names them),
    which the PoC forward does not read. Returns the tensors written."""
    sd, cfg = load_file(src / "model.safetensors"), json.loads((src / "config.json").read_text())
    out = {}
    for name, t in sd.items():
        if minimax_quantized(name, t):
            q, s = quantize(t)
            out[name], out[name.removesuffix("weight") + "weight_scale_inv"] = q, s
        elif "block_sparse_moe.gate." in name or name.endswith("e_score_correction_bias"):
            out[name] = t.float()
        else:
            out[name] = t.bfloat16()
    L, D = cfg["num_hidden_layers"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    for i in range(L, L + mtp_layers):  # an MTP module: its own norms, a projection and a decoder layer
        for name, t in list(out.items()):
            if name.startswith("model.layers.0."):
                out[name.replace("model.layers.0.", f"model.layers.{i}.")] = t.clone()
        out[f"model.layers.{i}.enorm.weight"] = torch.ones(D, dtype=torch.bfloat16)
        out[f"model.layers.{i}.hnorm.weight"] = torch.ones(D, dtype=torch.bfloat16)
        out[f"model.layers.{i}.eh_proj.weight"] = torch.randn(D, 2 * D, generator=g).bfloat16()
    dst.mkdir(exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    quant = dict(MINIMAX_QUANT, fmt=fmt)
    (dst / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16", "quantization_config": quant}))
    return out


def random_layers(cfg, dtype, device):
    """weights(i) for tests/minimax_spec.Emulation: layer i of random_model's FP8 checkpoint draws
    (random_weights.checkpoint_layer) under the release's names, less `model.layers.{i}.`."""
    from poc.model.random_weights import checkpoint_layer
    from poc.model.weights import checkpoint_name

    def weights(i: int) -> dict:
        pre = f"model.layers.{i}."
        return {checkpoint_name(n, cfg.family)[len(pre):]: t
                for n, t in checkpoint_layer(cfg, i, dtype, device, fp8_ckpt=True).items()}

    return weights
