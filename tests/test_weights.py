"""Checkpoint loading: layouts, dtypes, heads, every bad-input case, and peak host memory."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from poc.errors import InputError
from poc.model.config import PRESETS, ModelConfig
from poc.model.transformer import Transformer
from poc.model.weights import expected_keys, index_checkpoint, load_model, read_tensor

ROOT = Path(__file__).resolve().parents[1]

HF_CONFIG = {  # the shape of PRESETS["tiny"], as a Qwen3 config.json
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "vocab_size": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 4096,
    "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu",
}


def hf_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A random state dict named as in an HF file (`model.` prefix, lm_head without)."""
    torch.manual_seed(seed)
    m = Transformer(PRESETS["tiny"], with_head=True)
    sd = {}
    for k, v in m.state_dict().items():
        sd[k if k == "lm_head.weight" else f"model.{k}"] = torch.randn(v.shape)
    return sd


def write_checkpoint(path: Path, sd: dict, config: dict | None = None, shards: int = 1, index: bool = True,
                     dtype: torch.dtype | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config or HF_CONFIG))
    sd = {k: v.to(dtype) if dtype else v for k, v in sd.items()}
    if shards == 1:
        save_file(sd, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    keys = sorted(sd)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: sd[k] for k in keys[i::shards]}
        save_file(part, str(path / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    if index:
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


@pytest.fixture
def ckpt(tmp_path):
    sd = hf_state_dict()
    return write_checkpoint(tmp_path / "m", sd), sd


def error_of(path, **kw) -> InputError:
    with pytest.raises(InputError) as e:
        load_model(path, progress=False, **kw)
    assert "\n" not in e.value.message  # one line
    return e.value


def test_loads_every_tensor_exactly(ckpt):
    path, sd = ckpt
    model, cfg = load_model(path, with_head=True, progress=False)
    assert cfg == PRESETS["tiny"]
    got = model.state_dict()
    assert set(got) == {k.removeprefix("model.") for k in sd}
    for k, v in sd.items():
        assert torch.equal(got[k.removeprefix("model.")], v), k
    assert not any(p.requires_grad for p in model.parameters()) and not model.training
    assert model.rope_cos.shape == (4096, 16) and not model.rope_cos.is_meta


def test_without_head_leaves_out_embedding_and_head(ckpt):
    model, _ = load_model(ckpt[0], progress=False)
    assert model.embed_tokens is None and model.lm_head is None
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in model.state_dict())
    assert model(torch.randn(2, 5, 64)).shape == (2, 64)


def test_tied_head_is_the_embedding(tmp_path):
    sd = hf_state_dict()
    del sd["lm_head.weight"]
    path = write_checkpoint(tmp_path, sd, dict(HF_CONFIG, tie_word_embeddings=True))
    model, cfg = load_model(path, with_head=True, progress=False)
    assert cfg.tie_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, sd["model.embed_tokens.weight"])
    assert "lm_head.weight" not in expected_keys(model)


@pytest.mark.parametrize("index", [True, False], ids=["index", "no-index"])
def test_sharded_equals_single_file(tmp_path, ckpt, index):
    path, sd = ckpt
    sharded = write_checkpoint(tmp_path / "sharded", sd, shards=3, index=index)
    assert len(list(sharded.glob("*.safetensors"))) == 3
    one, _ = load_model(path, with_head=True, progress=False)
    three, _ = load_model(sharded, with_head=True, progress=False)
    a, b = one.state_dict(), three.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(("file_dtype", "config_dtype", "dtype", "want"), [
    (torch.float32, "float32", "auto", torch.float32),
    (torch.bfloat16, "bfloat16", "auto", torch.bfloat16),
    (torch.float32, None, "auto", torch.float32),  # no dtype in config.json: float32
    (torch.float32, "float32", torch.float16, torch.float16),
    (torch.float32, "float32", "bfloat16", torch.bfloat16),
    (torch.bfloat16, "bfloat16", torch.float32, torch.float32),
])
def test_dtypes(tmp_path, file_dtype, config_dtype, dtype, want):
    sd = hf_state_dict()
    config = {k: v for k, v in HF_CONFIG.items() if k != "torch_dtype"}
    if config_dtype:
        config["dtype"] = config_dtype  # transformers 5 writes "dtype"
    path = write_checkpoint(tmp_path, sd, config, dtype=file_dtype)
    model, _ = load_model(path, dtype=dtype, with_head=True, progress=False)
    assert {p.dtype for p in model.parameters()} == {want}
    assert model.rope_cos.dtype == torch.float32  # the table stays float32, cast at use
    w = model.state_dict()["layers.1.mlp.up_proj.weight"]
    assert torch.equal(w, sd["model.layers.1.mlp.up_proj.weight"].to(file_dtype).to(want))
    assert model(torch.randn(2, 4, 64, dtype=want)).dtype == want


def test_bad_dtype_name(ckpt):
    assert error_of(ckpt[0], dtype="int8").field == "dtype"


def test_conversion_through_a_small_staging_block(tmp_path, monkeypatch):
    import poc.model.weights as weights

    monkeypatch.setattr(weights, "CHUNK_BYTES", 1000)  # 250 floats per read: blocks straddle rows and tensors
    sd = hf_state_dict()
    model, _ = load_model(write_checkpoint(tmp_path, sd), dtype=torch.bfloat16, progress=False)
    got = model.state_dict()["layers.0.mlp.down_proj.weight"]
    assert torch.equal(got, sd["model.layers.0.mlp.down_proj.weight"].bfloat16())


def test_read_tensor_slices(ckpt):
    """The entry point a tensor-parallel loader needs: only some rows or columns of a tensor."""
    path, sd = ckpt
    ref = index_checkpoint(path)["layers.0.self_attn.q_proj.weight"]
    full = sd["model.layers.0.self_attn.q_proj.weight"]
    assert ref.shape == (64, 64) and ref.dtype == "F32" and ref.nbytes == 64 * 64 * 4
    assert torch.equal(read_tensor(ref, slice(16, 32)), full[16:32])
    assert torch.equal(read_tensor(ref, (slice(None), slice(0, 8))), full[:, :8])


def test_ignores_tensors_it_does_not_need(tmp_path):
    sd = hf_state_dict()
    sd["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.randn(8)
    model, _ = load_model(write_checkpoint(tmp_path, sd), progress=False)
    assert "layers.0.self_attn.rotary_emb.inv_freq" not in model.state_dict()


# --- bad inputs: each one a one-line InputError -----------------------------------------------------------------

def test_missing_directory(tmp_path):
    e = error_of(tmp_path / "nope")
    assert "does not exist" in e.message and "nope" in e.message


def test_missing_config(ckpt):
    (ckpt[0] / "config.json").unlink()
    assert "no config.json" in error_of(ckpt[0]).message


def test_config_not_json(ckpt):
    (ckpt[0] / "config.json").write_text("{hidden_size: 64,")
    assert "not valid JSON" in error_of(ckpt[0]).message


def test_unsupported_architecture(ckpt):
    (ckpt[0] / "config.json").write_text(json.dumps(dict(HF_CONFIG, architectures=["GPT2LMHeadModel"])))
    e = error_of(ckpt[0])
    assert "GPT2LMHeadModel" in e.message and e.field == "architectures"
    (ckpt[0] / "config.json").write_text(json.dumps(dict(HF_CONFIG, model_type="gpt2")))
    assert "gpt2" in error_of(ckpt[0]).message


def test_config_missing_key(ckpt):
    (ckpt[0] / "config.json").write_text(json.dumps({k: v for k, v in HF_CONFIG.items() if k != "hidden_size"}))
    e = error_of(ckpt[0])
    assert "hidden_size" in e.message and e.field == "hidden_size"


def test_unsupported_rope_type(ckpt):
    config = dict(HF_CONFIG, rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6})
    (ckpt[0] / "config.json").write_text(json.dumps(config))
    assert "yarn" in error_of(ckpt[0]).message


def test_truncated_file(ckpt):
    f = ckpt[0] / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    e = error_of(ckpt[0])
    assert "model.safetensors" in e.message and "not a valid safetensors file" in e.message


def test_garbage_header(ckpt):
    f = ckpt[0] / "model.safetensors"
    f.write_bytes(b"\x17\x00\x00\x00\x00\x00\x00\x00not json at all, really" + bytes(1000))
    assert "not a valid safetensors file" in error_of(ckpt[0]).message
    f.write_bytes(bytes(range(256)) * 4)  # a header length far beyond the file
    assert "not a valid safetensors file" in error_of(ckpt[0]).message


def test_no_safetensors_files(ckpt):
    (ckpt[0] / "model.safetensors").unlink()
    assert "no *.safetensors" in error_of(ckpt[0]).message


def test_index_names_missing_shard(tmp_path, ckpt):
    path = write_checkpoint(tmp_path / "s", ckpt[1], shards=2)
    (path / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in error_of(path).message


def test_shape_mismatch(ckpt):
    (ckpt[0] / "config.json").write_text(json.dumps(dict(HF_CONFIG, intermediate_size=96)))
    e = error_of(ckpt[0])
    assert "mlp" in e.message and "[128, 64]" in e.message and "[96, 64]" in e.message


def test_missing_tensor(tmp_path):
    sd = hf_state_dict()
    del sd["model.layers.1.self_attn.k_norm.weight"]
    e = error_of(write_checkpoint(tmp_path, sd))
    assert "layers.1.self_attn.k_norm.weight" in e.message and "lacks 1" in e.message
    sd = hf_state_dict()
    del sd["lm_head.weight"]  # untied: the head is needed only with_head
    load_model(write_checkpoint(tmp_path / "b", sd), progress=False)
    assert "lm_head.weight" in error_of(tmp_path / "b", with_head=True).message


def test_quantized_tensor(tmp_path):
    sd = hf_state_dict()
    sd["model.norm.weight"] = sd["model.norm.weight"].to(torch.int8)
    assert "only float" in error_of(write_checkpoint(tmp_path, sd)).message


# --- config -------------------------------------------------------------------------------------------------

def test_config_validation_names_the_numbers():
    with pytest.raises(InputError, match="n_heads=6.*n_kv_heads=4"):
        ModelConfig(dim=64, n_layers=1, n_heads=6, n_kv_heads=4, head_dim=16, ffn_dim=64, vocab_size=8)
    with pytest.raises(InputError, match="head_dim=15"):
        ModelConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, head_dim=15, ffn_dim=64, vocab_size=8)
    with pytest.raises(InputError, match="n_layers=0.*ffn_dim=-1"):
        ModelConfig(dim=64, n_layers=0, n_heads=4, n_kv_heads=4, head_dim=16, ffn_dim=-1, vocab_size=8)


def test_config_from_hf_variants():
    base = dict(HF_CONFIG, architectures=["LlamaForCausalLM"], model_type="llama")
    del base["head_dim"], base["num_key_value_heads"]
    c = ModelConfig.from_hf(base)
    assert (c.head_dim, c.n_kv_heads, c.qk_norm, c.qkv_bias, c.family) == (16, 4, False, False, "llama")
    c = ModelConfig.from_hf(dict(base, attention_bias=True))
    assert c.qkv_bias and c.o_bias
    c = ModelConfig.from_hf(dict(base, architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert c.qkv_bias and not c.o_bias
    old_style = dict(base, rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    c = ModelConfig.from_hf(old_style)
    assert c.rope_theta == 500000.0 and c.rope_scaling["factor"] == 8.0
    new_style = dict(base, rope_parameters={"rope_type": "default", "rope_theta": 123.0})
    del new_style["rope_theta"]
    assert ModelConfig.from_hf(new_style).rope_theta == 123.0 and ModelConfig.from_hf(new_style).rope_scaling is None
    assert hash(ModelConfig.from_hf(old_style)) == hash(ModelConfig.from_hf(old_style))
    with pytest.raises(InputError, match="wrong type"):
        ModelConfig.from_hf(dict(base, hidden_size="big"))


def test_presets():
    q = PRESETS["qwen3-0.6b"]
    assert (q.dim, q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim, q.ffn_dim) == (1024, 28, 16, 8, 128, 3072)
    assert q.tie_embeddings and q.qk_norm and q.vocab_size == 151936
    q = PRESETS["qwen3-8b"]
    assert (q.dim, q.n_layers, q.n_heads, q.n_kv_heads, q.head_dim, q.ffn_dim) == (4096, 36, 32, 8, 128, 12288)
    assert not q.tie_embeddings


# --- memory -------------------------------------------------------------------------------------------------

def test_peak_host_memory_is_about_one_copy(tmp_path):
    """Load a ~60 MB float32 checkpoint in a fresh process: peak RSS above baseline < 1.3x the weights."""
    script = ROOT / "scripts" / "measure_load_rss.py"
    out = subprocess.run([sys.executable, str(script), "--size-mb", "50", "--shape", "qwen3-0.6b",
                          "--workdir", str(tmp_path)], capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert 40e6 < res["weight_bytes"] < 80e6
    assert res["ratio_vmhwm"] < 1.3, res
