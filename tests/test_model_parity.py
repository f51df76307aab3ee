"""Our Transformer against transformers' Llama/Qwen2/Qwen3 built from the same tiny random checkpoints."""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poc.model.config import ModelConfig  # noqa: E402
from poc.model.numerics import reflect  # noqa: E402
from poc.model.transformer import Transformer, apply_rope, rope_freqs, rope_table  # noqa: E402
from poc.model.weights import load_model  # noqa: E402

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}

CASES = {  # name: (family, config overrides)
    "llama-gqa": ("llama", {}),
    "llama-mha-tied-bias": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True)),
    "llama3-rope-scaling": ("llama", dict(max_position_embeddings=131072, rope_theta=500000.0,
                                          rope_parameters=dict(LLAMA3_ROPE, rope_theta=500000.0))),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-gqa": ("qwen3", {}),
    "qwen3-mha-tied": ("qwen3", dict(num_key_value_heads=4, tie_word_embeddings=True)),
}


def hf_config(family: str, **overrides):
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
    cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
           "qwen3": transformers.Qwen3ForCausalLM}[family]
    cfg = hf_config(family, **overrides)
    cfg._attn_implementation = "eager"
    hf = cls(cfg)
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf.eval()


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    family, overrides = CASES[request.param]
    hf = make_hf(tmp_path, family, **overrides)
    ours, cfg = load_model(tmp_path, dtype=torch.float32, with_head=True, progress=False)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1))
    return hf, ours, cfg, x


def check_hidden_and_logits(hf, ours, x, last_rtol: float, last_atol: float):
    """Final-norm hidden states and fp32 logits against transformers (max abs < 1e-5), and the last-position pass
    equal to the last row of the full one. Returns transformers' hidden states."""
    want = hf.model(inputs_embeds=x).last_hidden_state
    got = ours(x, last_only=False)
    assert got.shape == want.shape == (3, 11, 64)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.5  # not a trivially small output
    torch.testing.assert_close(ours(x), got[:, -1], rtol=last_rtol, atol=last_atol)  # last_only = the last row
    want_logits = hf(inputs_embeds=x).logits.float()
    got_logits = ours(x, last_only=False, logits=True)
    assert got_logits.dtype == torch.float32 and got_logits.shape == want_logits.shape
    assert (got_logits - want_logits).abs().max().item() < 1e-5
    torch.testing.assert_close(ours(x, logits=True), got_logits[:, -1], rtol=1e-6, atol=1e-5)
    return want


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


def unit_rows(n: int, d: int, seed: int = 2) -> torch.Tensor:
    v = torch.randn(n, d, generator=torch.Generator().manual_seed(seed))
    return v / v.norm(dim=-1, keepdim=True)


def hooked_hf_forward(hf, vs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """HF's final-norm hidden states with a forward hook reflecting each decoder layer's output by vs[i]."""

    def hook(i):
        def fn(module, args, out):
            if isinstance(out, tuple):
                return (reflect(out[0], vs[i]),) + out[1:]
            return reflect(out, vs[i])
        return fn

    handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(hf.model.layers)]
    try:
        return hf.model(inputs_embeds=x).last_hidden_state
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def test_reflections_match_hooked_hf(case):
    check_reflections(*case)


def check_reflections(hf, ours, cfg, x) -> None:
    """Reflecting (a, r) after every layer = an HF forward hook reflecting each layer's output, norm after
    (dense and MoE models alike)."""
    vs = unit_rows(cfg.n_layers, cfg.dim)

    want = hooked_hf_forward(hf, vs, x)
    got = ours(x, reflections=vs, last_only=False)
    assert (got - want).abs().max().item() < 1e-5
    # mutation check: the reflections really act, and so does the one after the last layer
    assert (got - ours(x, last_only=False)).abs().max().item() > 0.1
    vs_last = vs.clone()
    vs_last[-1] = unit_rows(1, cfg.dim, seed=3)[0]
    assert (got - ours(x, reflections=vs_last, last_only=False)).abs().max().item() > 0.1
    # vectors in the model dtype act the same as float32 ones; the last-position pass (one query in the final
    # layer) differs from the full pass only in float summation order
    torch.testing.assert_close(ours(x, reflections=vs.to(torch.float32)), got[:, -1], rtol=0, atol=1e-5)


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
