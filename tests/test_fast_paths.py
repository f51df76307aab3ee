"""The engine's fast paths compute the same function as the plain forward (CPU; the GPU run repeats it)."""

from dataclasses import replace

import pytest
import torch

from poc.model.config import PRESETS
from poc.model.transformer import Transformer

CASES = {
    "qwen3-gqa": PRESETS["tiny"],
    "llama-mha-bias": replace(PRESETS["tiny"], qk_norm=False, qkv_bias=True, n_kv_heads=4, family="llama"),
    "llama-scaled": replace(PRESETS["tiny"], qk_norm=False, family="llama", rope_scaling={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
}


def _model(cfg):
    torch.manual_seed(0)
    m = Transformer(cfg, with_head=True).float()
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.normal_(1.0, 0.1) if "norm" in n else p.normal_(0.0, 0.2)
    return m.eval()


@pytest.mark.parametrize("name", CASES)
@torch.no_grad()
def test_fused_and_last_position_match_full_forward(name):
    cfg = CASES[name]
    m = _model(cfg)
    x = torch.randn(3, 11, cfg.dim)
    refl = torch.nn.functional.normalize(torch.randn(cfg.n_layers, cfg.dim), dim=1)
    full = m(x, reflections=refl, last_only=False)[:, -1]
    logits_full = m.lm_head(m(x, last_only=False)[:, -1]).float()
    last = m(x, reflections=refl, last_only=True)
    torch.testing.assert_close(last, full, rtol=0, atol=1e-5)
    n_params = sum(p.numel() for p in m.parameters())
    m.fuse()
    assert m.layers["0"].self_attn.q_proj is None and m.layers["0"].mlp.gate_up_proj is not None
    assert sum(p.numel() for p in m.parameters()) == n_params  # fused, not copied
    torch.testing.assert_close(m(x, reflections=refl, last_only=True), full, rtol=0, atol=1e-5)
    torch.testing.assert_close(m(x, reflections=refl, last_only=False)[:, -1], full, rtol=0, atol=1e-5)
    torch.testing.assert_close(m(x, last_only=True, logits=True), logits_full, rtol=0, atol=1e-5)
    # the final layer's attention really uses every key: perturbing an early position moves the output
    x2 = x.clone()
    x2[:, 0] += 1.0
    assert (m(x2, reflections=refl) - last).abs().max() > 1e-4
