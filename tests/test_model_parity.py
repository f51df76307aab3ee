"""Our Transformer against transformers' Llama/Qwen2/Qwen3 built from the same tiny random checkpoints."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poc.model.config import ModelConfig  # noqa: E402
from poc.model.transformer import Transformer, apply_rope, rope_freqs, rope_table  # noqa: E402
from poc.model.weights import load_model  # noqa: E402
from .checkpoints import DENSE_CASES, LLAMA3_ROPE, make_hf, unit_rows  # noqa: E402
from .parity import check_hidden_and_logits, check_reflections  # noqa: E402


@pytest.fixture(params=sorted(DENSE_CASES))
def case(request, tmp_path):
    family, overrides = DENSE_CASES[request.param]
    hf = make_hf(tmp_path, family, **overrides)
    ours, cfg = load_model(tmp_path, dtype=torch.float32, with_head=True, progress=False)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1))
    return hf, ours, cfg, x


@torch.no_grad()
def test_hidden_state_and_logits_parity(case):
    hf, ours, _, x = case
    check_hidden_and_logits(hf, ours, x, last_rtol=1e-6, last_atol=1e-6)
    assert hf(inputs_embeds=x).logits.shape == (3, 11, 128)


def test_config_mapping(case):
    hf, _, cfg, _ = case
    c = hf.config
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads) == (64, 3, 4, c.num_key_value_heads)
    assert cfg.head_dim == getattr(c, "head_dim", None) or 64 // 4
    assert cfg.tie_embeddings == c.tie_word_embeddings
    assert cfg.qk_norm == (cfg.family == "qwen3")
    assert cfg.qkv_bias == (cfg.family == "qwen2" or bool(getattr(c, "attention_bias", False)))


def test_rope_matches_hf(case):
    """The table equals HF's rotary embedding bit for bit (with Llama-3.1 scaling where configured)."""
    hf, ours, cfg, x = case
    torch.testing.assert_close(rope_freqs(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling),
                               hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    pos = torch.arange(11)[None]
    cos_hf, sin_hf = hf.model.rotary_emb(x, pos)
    cos, sin = rope_table(cfg.head_dim, 11, cfg.rope_theta, cfg.rope_scaling)
    assert cos.shape == (11, cfg.head_dim) and cos.dtype == torch.float32
    torch.testing.assert_close(cos, cos_hf[0], rtol=0, atol=0)
    torch.testing.assert_close(sin, sin_hf[0], rtol=0, atol=0)
    q = torch.randn(2, cfg.n_heads, 11, cfg.head_dim)
    rot_hf, _ = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(q, q, cos_hf, sin_hf)
    torch.testing.assert_close(apply_rope(q, cos, sin), rot_hf, rtol=0, atol=0)


def test_llama3_scaling_changes_low_frequencies():
    plain = rope_freqs(64, 500000.0)
    scaled = rope_freqs(64, 500000.0, {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_type"})
    wavelen = 2 * math.pi / plain
    assert torch.equal(scaled[wavelen < 2048], plain[wavelen < 2048])
    torch.testing.assert_close(scaled[wavelen > 8192], plain[wavelen > 8192] / 8)
    medium = (wavelen >= 2048) & (wavelen <= 8192)
    assert medium.any() and (scaled[medium] < plain[medium]).all() and (scaled[medium] > plain[medium] / 8).all()


@torch.no_grad()
def test_reflections_match_hooked_hf(case):
    check_reflections(*case)


@torch.no_grad()
def test_pipeline_stages_compose(case):
    """Two stages (fewer ModuleDict keys, global layer indices) chained equal the whole model."""
    _, ours, cfg, x = case
    vs = unit_rows(cfg.n_layers, cfg.dim)
    whole = ours(x, reflections=vs)
    first, second = Transformer(cfg), Transformer(cfg)
    first.load_state_dict(ours.state_dict(), strict=False)
    second.load_state_dict(ours.state_dict(), strict=False)
    del first.layers["2"]
    first.norm = None
    for k in ("0", "1"):
        del second.layers[k]
    h = first(x, reflections=vs)
    assert h.shape == x.shape  # a stage without the final norm hands on every position
    torch.testing.assert_close(second(h, reflections=vs), whole, rtol=0, atol=1e-6)


@torch.no_grad()
def test_meta_build_then_init_rope(tmp_path):
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48, vocab_size=16,
                      max_seq_len=64)
    with torch.device("meta"):
        m = Transformer(cfg)
    assert m.rope_cos.is_meta and m.embed_tokens is None and m.lm_head is None
    m.to_empty(device="cpu")
    m.init_rope("cpu", n_pos=100)
    assert not m.rope_cos.is_meta and m.rope_cos.shape == (100, 16)
    assert "rope_cos" not in m.state_dict()
    cos, _ = rope_table(16, 100, cfg.rope_theta)
    assert torch.equal(m.rope_cos, cos)


@torch.no_grad()
def test_rope_table_grows_on_demand():
    cfg = ModelConfig(dim=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, ffn_dim=48, vocab_size=16,
                      max_seq_len=8)
    m = Transformer(cfg)
    y = m(torch.randn(2, 20, 32))
    assert y.shape == (2, 32) and m.rope_cos.shape[0] == 20


@torch.no_grad()
def test_bf16_close_to_fp32(tmp_path):
    """Low-precision path: same checkpoint in bfloat16 stays near the float32 result."""
    make_hf(tmp_path, "qwen3")
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    ref, _ = load_model(tmp_path, dtype=torch.float32, progress=False)
    low, _ = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    want = ref(x, reflections=unit_rows(3, 64))
    got = low(x.bfloat16(), reflections=unit_rows(3, 64))
    assert got.dtype == torch.bfloat16
    assert (got.float() - want).abs().max().item() < 0.05 * want.abs().max().item()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_matches_cpu(tmp_path):
    """Loaded straight onto the GPU (through the staging block for bf16): same result as on the CPU."""
    make_hf(tmp_path, "qwen3")
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(5))
    vs = unit_rows(3, 64)
    cpu, _ = load_model(tmp_path, dtype=torch.float32, progress=False)
    gpu, _ = load_model(tmp_path, dtype=torch.float32, device="cuda", progress=False)
    assert {p.device.type for p in gpu.parameters()} == {"cuda"} and gpu.rope_cos.is_cuda
    want = cpu(x, reflections=vs, last_only=False)
    got = gpu(x.cuda(), reflections=vs.cuda(), last_only=False).cpu()
    assert (got - want).abs().max().item() < 1e-4
    low, _ = load_model(tmp_path, dtype=torch.bfloat16, device="cuda", progress=False)
    got = low(x.cuda().bfloat16(), reflections=vs.cuda(), last_only=False).float().cpu()
    assert (got - want).abs().max().item() < 0.05 * want.abs().max().item()
