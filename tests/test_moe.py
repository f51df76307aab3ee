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
