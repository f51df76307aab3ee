"""Checkpoints in the forms the Hub ships them (config.json as transformers 4.x and 5.x write it, shard indexes,
extra tensors, FP8 with edge blocks and unconverted modules), each against transformers reading the same directory:
final-norm hidden states in float32 within 1e-5, and a tensor-parallel rank's slices equal to the whole model's."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from poc.model.weights import INDEX_FILE, checkpoint_files, dequantize_fp8, load_model  # noqa: E402
from poc.model.options import ModelOptions  # noqa: E402
from poc.parallel.build import Part, build  # noqa: E402
from .checkpoints import quantize, randomize  # noqa: E402

ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "qwen3_moe": "Qwen3MoeForCausalLM"}
COMMON = {"hidden_act": "silu", "rms_norm_eps": 1e-6, "vocab_size": 128, "max_position_embeddings": 512,
          "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True, "bos_token_id": 1, "eos_token_id": 2}

FORMS = {  # name: (config.json as written on the Hub, checkpoint options)
    # Qwen3-235B-A22B-Instruct-2507 (transformers 4.51): num_experts, torch_dtype, rope_theta at the top
    "qwen3-moe-4x": (dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[], rope_theta=5000000, rope_scaling=None, sliding_window=None,
                          use_sliding_window=False, max_window_layers=3, attention_bias=False,
                          tie_word_embeddings=False, torch_dtype="bfloat16", output_router_logits=False,
                          router_aux_loss_coef=0.001, transformers_version="4.51.0"),
                     dict(shards=True)),
    # the same written by transformers 5: dtype, rope_parameters, num_local_experts
    "qwen3-moe-5x": (dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_local_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                          mlp_only_layers=[1], rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                          sliding_window=None, use_sliding_window=False, attention_bias=False,
                          tie_word_embeddings=False, dtype="bfloat16", transformers_version="5.0.0"),
                     dict(shards=True, extra=True)),
    # Qwen3-8B: untied; tie_word_embeddings left out (transformers' default is False)
    "qwen3-8b": (dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=24, rope_theta=1000000,
                      rope_scaling=None, sliding_window=None, use_sliding_window=False, max_window_layers=3,
                      attention_bias=False, torch_dtype="bfloat16"),
                 dict(shards=True, extra=True)),
    # Qwen3-0.6B: tied, no lm_head in the file
    "qwen3-0.6b-tied": (dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rope_theta=1000000,
                             rope_scaling=None, sliding_window=None, use_sliding_window=False, max_window_layers=2,
                             attention_bias=False, tie_word_embeddings=True, torch_dtype="bfloat16"),
                        dict(drop_head=True)),
    # Qwen2.5: qkv bias, tied, sliding_window set (shorter than the input) but use_sliding_window false
    "qwen2.5-tied-window-off": (dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                     num_attention_heads=4, num_key_value_heads=2, rope_theta=1000000.0,
                                     sliding_window=4, use_sliding_window=False, max_window_layers=1,
                                     tie_word_embeddings=True, torch_dtype="bfloat16"),
                                dict(drop_head=True)),
    # transformers 5's Qwen2 with layer_types written out (window still off)
    "qwen2.5-5x-layer-types": (dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                                    sliding_window=4, use_sliding_window=False, max_window_layers=1,
                                    layer_types=["full_attention"] * 3, tie_word_embeddings=False, dtype="bfloat16"),
                               dict(shards=True)),
    # Llama-3.1 (transformers 4.43): rope_scaling llama3, rope_theta at the top, no head_dim, inv_freq buffers
    "llama3.1-4x": (dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=500000.0,
                         rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 64, "rope_type": "llama3"},
                         attention_bias=False, mlp_bias=False, pretraining_tp=1, tie_word_embeddings=False,
                         torch_dtype="bfloat16"),
                    dict(shards=True, extra=True)),
    # Llama-3.2 as transformers 5 writes it: rope_parameters with llama3 and rope_theta inside, head_dim, tied
    "llama3.2-5x-tied": (dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 64},
                              attention_bias=False, mlp_bias=False, tie_word_embeddings=True, dtype="bfloat16"),
                         dict(drop_head=True)),
}

FP8_FORWARD = "dequant"  # the FP8 forms are checked against transformers' dequantised reading: the dequantise forward
# (the default W8A8 forward is tests/test_w8a8.py's), passed to every loader here


def hub_config(over: dict) -> dict:
    return {"architectures": [ARCH[over["model_type"]]], **COMMON, **over}


def write_hub_checkpoint(path, config: dict, shards: bool = False, extra: bool = False, drop_head: bool = False):
    """transformers' model of `config` (randomised), saved (sharded when asked), with config.json replaced by the
    Hub form; extra: rotary inv_freq buffers and an MTP layer beyond the last one, as some checkpoints carry."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    hf_cfg = transformers.AutoConfig.from_pretrained(path)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    randomize(model)
    model.save_pretrained(path, max_shard_size="40KB" if shards else "1GB")
    (path / "config.json").write_text(json.dumps(config))
    assert (path / INDEX_FILE).is_file() == shards
    n = config["num_hidden_layers"]
    ins = {}
    if extra:
        ins = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.randn(8) for i in range(n)}
        ins.update({f"model.layers.{n}.self_attn.q_proj.weight": torch.randn(5, 3),  # MTP-style extra layer
                    "mtp.norm.weight": torch.randn(7), "model.layers.0.position_ids": torch.arange(4)})
    half = (config.get("torch_dtype") or config.get("dtype")) == "bfloat16"  # stored as the Hub stores it

    def store(sd):
        return {k: v.bfloat16() if half and v.is_floating_point() else v for k, v in sd.items()
                if not (drop_head and k == "lm_head.weight")}

    rewrite(path, store, ins)
    return path


def rewrite(path, fn, insert: dict | None = None) -> None:
    """Apply fn to each file's tensors (keeping the shard index in step); `insert` goes into the last file."""
    files = checkpoint_files(path)
    weight_map = {}
    for i, f in enumerate(files):
        sd = fn(load_file(f))
        if i == len(files) - 1:
            sd.update(insert or {})
        save_file(sd, f, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(sd, f.name))
    if (path / INDEX_FILE).is_file():
        (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def reference(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return hf.eval()


def check_parity(path, ref_path, dim: int):
    ours, cfg = load_model(path, dtype=torch.float32, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    hf = reference(ref_path)
    x = torch.randn(2, 11, dim, generator=torch.Generator().manual_seed(1))
    want = hf.model(inputs_embeds=x).last_hidden_state
    got = ours(x, last_only=False)
    assert want.abs().max().item() > 0.5
    assert (got - want).abs().max().item() < 1e-5
    return ours, cfg


def check_tp_slices(path, whole, dtype=torch.float32) -> None:
    """Each of 2 tp ranks holds exactly its slices of the whole model's parameters (experts: its half)."""
    full = whole.state_dict()
    for rank in (0, 1):
        part, _ = build(path, dtype, "cpu", Part(tp_rank=rank, tp_size=2), options=ModelOptions(fp8=FP8_FORWARD))
        sd = part.state_dict()
        assert sd and set(sd) <= set(full)
        for k, v in sd.items():
            w = full[k]
            if v.shape != w.shape:
                dim = next(d for d in range(w.dim()) if v.shape[d] != w.shape[d])
                n = v.shape[dim]
                w = w.narrow(dim, rank * n, n)
            assert torch.equal(v, w), k


@pytest.mark.parametrize("name", sorted(FORMS))
@torch.no_grad()
def test_hub_form_matches_transformers(name, tmp_path):
    config, opts = FORMS[name]
    path = write_hub_checkpoint(tmp_path / "m", hub_config(config), **opts)
    ours, _ = check_parity(path, path, config["hidden_size"])
    check_tp_slices(path, ours)
    check_tp_slices(path, load_model(path, progress=False, options=ModelOptions(fp8=FP8_FORWARD))[0], "auto")  # as stored (bf16)


# --- FP8 ------------------------------------------------------------------------------------------------------

def fp8_twin(path, fp8_dir, twin_dir, keep_bf16: tuple[str, ...] = (), scale_dtype=torch.float32) -> int:
    """fp8_dir: `path` quantised as Qwen ships FP8 (float8_e4m3fn weights, weight_scale_inv per 128x128 block;
    router, norms, embeddings, lm_head and the names in keep_bf16 unconverted); twin_dir: the dequantised weights in
    float32 as a plain checkpoint. Same shard layout. Returns how many weights were quantised."""
    shutil.copytree(path, fp8_dir)
    shutil.copytree(path, twin_dir)
    count = [0]

    def quantised(name, t):
        return t.dim() == 2 and name.endswith(".weight") and "layers." in name and not any(
            k in name for k in ("norm", "mlp.gate.weight", *keep_bf16)) and not name.startswith("mtp.")

    def to_fp8(sd):
        out = {}
        for k, t in sd.items():
            if quantised(k, t):
                q, s = quantize(t)
                out[k], out[k.removesuffix("weight") + "weight_scale_inv"] = q, s.to(scale_dtype)
                count[0] += 1
            else:
                out[k] = t.bfloat16() if t.is_floating_point() else t
        return out

    def to_twin(sd):
        out = {}
        for k, t in sd.items():
            if quantised(k, t):
                q, s = quantize(t)
                out[k] = dequantize_fp8(q, s.to(scale_dtype))
            else:
                out[k] = t.bfloat16().float() if t.is_floating_point() else t
        return out

    rewrite(fp8_dir, to_fp8)
    rewrite(twin_dir, to_twin)
    cfg = json.loads((fp8_dir / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [128, 128],
                                  "modules_to_not_convert": ["lm_head", "model.embed_tokens", *keep_bf16]}
    (fp8_dir / "config.json").write_text(json.dumps(cfg))
    return count[0]


FP8_FORMS = {  # name: (config overrides on qwen3-moe-4x, names kept bf16, scale dtype)
    # moe width 128: experts kept FP8 in memory; hidden 192: a cropped column block; attention 4 x 48 = 192
    "moe-kept-edge": (dict(hidden_size=192, moe_intermediate_size=128, intermediate_size=320, head_dim=48,
                           mlp_only_layers=[1]), ("layers.0.self_attn.v_proj",), torch.float32),
    # moe width 96 (not a block multiple: dequantised at load), bf16 scales, an unconverted expert
    "moe-dequant-bf16-scales": (dict(hidden_size=160, moe_intermediate_size=96, head_dim=40),
                                ("layers.2.mlp.experts.3.",), torch.bfloat16),
}


@pytest.mark.parametrize("name", sorted(FP8_FORMS))
@torch.no_grad()
def test_fp8_hub_form_matches_dequantised_twin(name, tmp_path):
    over, keep, scale_dtype = FP8_FORMS[name]
    config = hub_config({**FORMS["qwen3-moe-4x"][0], **over})
    src = write_hub_checkpoint(tmp_path / "src", config, shards=True, extra=True)
    assert fp8_twin(src, tmp_path / "fp8", tmp_path / "twin", keep, scale_dtype) > 0
    check_parity(tmp_path / "fp8", tmp_path / "twin", config["hidden_size"])
    twin, _ = load_model(tmp_path / "twin", dtype=torch.float32, progress=False, options=ModelOptions(fp8_experts="dequant", fp8=FP8_FORWARD))
    check_tp_slices(tmp_path / "twin", twin)
    # an FP8 rank's slices: dequantised at load (experts too), equal to the twin's
    for rank in (0, 1):
        a, _ = build(tmp_path / "fp8", torch.float32, "cpu", Part(tp_rank=rank, tp_size=2), options=ModelOptions(fp8_experts="dequant", fp8=FP8_FORWARD))
        b, _ = build(tmp_path / "twin", torch.float32, "cpu", Part(tp_rank=rank, tp_size=2), options=ModelOptions(fp8=FP8_FORWARD))
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
