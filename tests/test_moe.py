"""Qwen3-MoE: our Transformer against transformers' Qwen3MoeForCausalLM built from the same tiny random checkpoint."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poc.errors import InputError  # noqa: E402
from poc.model.config import ModelConfig  # noqa: E402
from poc.model.transformer import MLP, MoE, Transformer  # noqa: E402
from poc.model.weights import load_model  # noqa: E402
from tests.test_model_parity import hooked_hf_forward, randomize, unit_rows  # noqa: E402

CASES = {  # name: config overrides; both layer kinds appear in each
    "mlp-only-layer-norm-topk": dict(num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[1],
                                     norm_topk_prob=True),
    "sparse-step-2-no-norm": dict(num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2, mlp_only_layers=[],
                                  norm_topk_prob=False),
    "top-3-of-6-tied": dict(num_experts=6, num_experts_per_tok=3, decoder_sparse_step=1, mlp_only_layers=[0],
                            norm_topk_prob=True, tie_word_embeddings=True),
}


def hf_moe_config(**overrides):
    kw = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=24, vocab_size=128, max_position_embeddings=512,
              rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
              tie_word_embeddings=False)
    kw.update(overrides)
    cfg = transformers.Qwen3MoeConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def make_hf_moe(tmp_path, **overrides):
    hf = transformers.Qwen3MoeForCausalLM(hf_moe_config(**overrides))
    randomize(hf)
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return hf.eval()


@pytest.fixture(params=sorted(CASES))
def case(request, tmp_path):
    hf = make_hf_moe(tmp_path, **CASES[request.param])
    ours, cfg = load_model(tmp_path, dtype=torch.float32, with_head=True, progress=False)
    x = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1))
    return hf, ours, cfg, x


def test_config_and_layer_kinds(case):
    hf, ours, cfg, _ = case
    c = hf.config
    assert cfg.family == "qwen3_moe" and cfg.qk_norm
    assert (cfg.n_experts, cfg.n_experts_per_tok, cfg.moe_ffn_dim) == (c.num_experts, c.num_experts_per_tok, 32)
    assert cfg.norm_topk_prob == c.norm_topk_prob and cfg.mlp_only_layers == tuple(c.mlp_only_layers)
    kinds = [isinstance(b.mlp, MoE) for b in ours.layers.values()]
    assert kinds == [type(layer.mlp).__name__ == "Qwen3MoeSparseMoeBlock" for layer in hf.model.layers]
    assert any(kinds) and not all(kinds)
    assert all(isinstance(b.mlp, MLP) for b in ours.layers.values() if not isinstance(b.mlp, MoE))


@torch.no_grad()
def test_hidden_state_and_logits_parity(case):
    hf, ours, cfg, x = case
    want = hf.model(inputs_embeds=x).last_hidden_state
    got = ours(x, last_only=False)
    assert got.shape == want.shape == (3, 11, 64)
    assert (got - want).abs().max().item() < 1e-5
    assert want.abs().max().item() > 0.5
    torch.testing.assert_close(ours(x), got[:, -1], rtol=0, atol=1e-5)
    want_logits = hf(inputs_embeds=x).logits.float()
    assert (ours(x, last_only=False, logits=True) - want_logits).abs().max().item() < 1e-5
    ours.fuse()  # fused q/k/v and per-expert gate/up: same numbers up to GEMM summation order
    assert (ours(x, last_only=False) - want).abs().max().item() < 1e-5


@torch.no_grad()
def test_reflections_match_hooked_hf(case):
    hf, ours, cfg, x = case
    vs = unit_rows(cfg.n_layers, cfg.dim)

    want = hooked_hf_forward(hf, vs, x)
    got = ours(x, reflections=vs, last_only=False)
    assert (got - want).abs().max().item() < 1e-5
    assert (got - ours(x, last_only=False)).abs().max().item() > 0.1


@torch.no_grad()
def test_moe_block_bf16_matches_hf(tmp_path):
    """In bfloat16 the sparse block alone (router, top-k weights, expert sums) rounds as transformers' does."""
    hf = make_hf_moe(tmp_path, **CASES["top-3-of-6-tied"]).to(torch.bfloat16)
    ours, _ = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    want = hf.model.layers[1].mlp(x)
    got = ours.layers["1"].mlp(x)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, want)


@torch.no_grad()
def test_stacked_grouped_and_expert_ranges(tmp_path, monkeypatch):
    """The fused block (stacked experts) in bf16: the per-expert loop and the grouped GEMM give the unfused block's
    numbers, and two halves of the experts (expert parallel without the all-reduce) add up to the whole."""
    from poc.model import transformer

    make_hf_moe(tmp_path, **CASES["mlp-only-layer-norm-topk"])
    ours, _ = load_model(tmp_path, dtype=torch.bfloat16, progress=False)
    moe = ours.layers["0"].mlp
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    want = moe(x)
    halves = []
    for first, stop in ((0, 4), (4, 8)):
        part = MoE(ours.cfg)
        part.load_state_dict(moe.state_dict())
        part = part.bfloat16()
        part.keep_experts(first, stop)
        assert sorted(int(k) for k in part.experts) == list(range(first, stop))
        halves.append(part)
    fp32_parts = [transformer._dispatch_modules(h, *_routing(h, x)) for h in halves]
    assert torch.equal((fp32_parts[0] + fp32_parts[1]).bfloat16().view_as(want), want)
    moe.fuse()
    assert moe.w13.shape == (8, 64, 64) and moe.w2.shape == (8, 64, 32) and len(moe.experts) == 0
    assert torch.equal(moe(x), want)  # stacked, loop over experts
    monkeypatch.setattr(transformer, "GROUPED_MM_ON_CPU", True)
    assert transformer._grouped_mm_ok(x.view(-1, 64), moe.w13)
    assert torch.equal(moe(x), want)  # stacked, one grouped GEMM per projection
    for h in halves:
        h.fuse()
    parts = [transformer._dispatch_stacked(h, *_routing(h, x)) for h in halves]
    assert torch.equal((parts[0] + parts[1]).bfloat16().view_as(want), want)


def _routing(moe, x):
    t = x.reshape(-1, x.shape[-1])
    probs = torch.softmax(moe.gate(t).float(), dim=-1)
    w, idx = torch.topk(probs, moe.top_k, dim=-1)
    if moe.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return t, w.to(x.dtype), idx


@torch.no_grad()
def test_fp8_kept_in_memory_equals_dequantised_at_load():
    """Stacked FP8 experts dequantised per call give the same block output as the experts dequantised once."""
    from poc.model.transformer import dequantize_blocks
    from poc.model.weights import dequantize_fp8

    cfg = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=384, vocab_size=128,
                      family="qwen3_moe", n_experts=4, n_experts_per_tok=2, moe_ffn_dim=192)
    g = torch.Generator().manual_seed(4)
    w13 = (torch.randn(4, 384, 256, generator=g) * 8).to(torch.float8_e4m3fn)  # 192 rows: a partial edge block
    w2 = (torch.randn(4, 256, 192, generator=g) * 8).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(4, 3, 2, generator=g) / 100, torch.rand(4, 2, 2, generator=g) / 100
    for j in range(4):
        assert torch.equal(dequantize_blocks(w13[j], s13[j], torch.bfloat16), dequantize_fp8(w13[j], s13[j]).bfloat16())
    dense = MoE(cfg).bfloat16()
    kept = MoE(cfg).bfloat16()
    kept.gate.weight.copy_(dense.gate.weight)
    dense.fuse()
    dense.w13, dense.w2 = dequantize_blocks(w13, s13, torch.bfloat16), dequantize_blocks(w2, s2, torch.bfloat16)
    kept.set_fp8(w13, s13, w2, s2)
    x = torch.randn(3, 5, 256, generator=g).bfloat16()
    assert kept.w13.dtype == torch.float8_e4m3fn
    assert torch.equal(kept(x), dense(x))


def test_bad_moe_configs():
    base = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                family="qwen3_moe", n_experts=4, n_experts_per_tok=2, moe_ffn_dim=32)
    assert [ModelConfig(**base).is_moe_layer(i) for i in range(2)] == [True, True]
    assert [ModelConfig(**base, decoder_sparse_step=2).is_moe_layer(i) for i in range(2)] == [False, True]
    assert [ModelConfig(**base, mlp_only_layers=[0]).is_moe_layer(i) for i in range(2)] == [False, True]
    with pytest.raises(InputError, match="num_experts_per_tok=5"):
        ModelConfig(**dict(base, n_experts_per_tok=5))
    with pytest.raises(InputError, match="moe_ffn_dim=0"):
        ModelConfig(**dict(base, moe_ffn_dim=0))
    hf = hf_moe_config(num_experts=4, num_experts_per_tok=2).to_dict()
    hf["architectures"] = ["Qwen3MoeForCausalLM"]
    assert ModelConfig.from_hf(hf).n_experts == 4
    del hf["num_local_experts"]
    hf["num_experts"] = 4  # the Hub's name
    assert ModelConfig.from_hf(hf).n_experts == 4
    hf["quantization_config"] = {"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}
    with pytest.raises(InputError, match="e5m2"):
        ModelConfig.from_hf(hf)


def test_tensor_parallel_refuses_moe_layers():
    from poc.parallel.tp import apply_tp

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                      family="qwen3_moe", n_experts=4, n_experts_per_tok=2, moe_ffn_dim=32, decoder_sparse_step=2)
    with torch.device("meta"):
        model = Transformer(cfg)
    assert apply_tp(model, 0, 1, None) == {}  # tp=1 is the plain model
    with pytest.raises(ValueError, match="MoE"):
        apply_tp(model, 0, 2, None)
