"""The MoE router's top-k (model/route.py): torch.topk on the CPU; on CUDA the Triton kernel against torch.topk and
against the rule written out here."""

import pytest
import torch

from poc.model import route

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton top-k kernel)")


def test_topk_on_cpu_is_torch_topk_and_the_op_is_well_formed():
    p = torch.softmax(torch.randn(50, 16), -1)
    for got, want in zip(route.topk(p, 4), torch.topk(p, 4, dim=-1)):
        assert torch.equal(got, want)
    # the custom op that compiled graphs hold: its schema, fake (shape) function and eager result agree
    torch.library.opcheck(torch.ops.poc.route_topk, (p, 4))
    v, i = torch.ops.poc.route_topk(p, 4)
    assert v.shape == i.shape == (50, 4) and i.dtype == torch.int64


def _tied_probs(T: int, E: int, seed: int) -> torch.Tensor:
    """Router probabilities as the model makes them, from bf16 logits: ties are everywhere (coarse logits), plus
    rows of all-equal values, zeros (underflow), -0 and a NaN."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(T, E, generator=g) * 2).to(torch.bfloat16).float()
    z[::7] = torch.round(z[::7])  # a few distinct values per row: many ties across the k-th
    z[1] = 0.0
    z[2, ::3] = -200.0
    p = torch.softmax(z, -1)
    p[3] = 0.0
    p[4, ::2] = -0.0
    p[5, 7] = float("nan")
    return p


def _selection(i: torch.Tensor) -> torch.Tensor:
    return i.sort(dim=1).values


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("T,E,k", [(4099, 128, 8), (1000, 60, 4), (64, 8, 8), (33, 128, 1)])
def test_cuda_topk_selects_what_torch_topk_selects(T, E, k):
    """The kernel's choice is torch.topk's on CUDA (the set of experts; the order of equal values is free), and
    the rule both follow: the k largest, ties at the k-th value to the lower index, NaN largest. Also inside a
    compiled graph (the custom op)."""
    p = _tied_probs(T, E, seed=T).cuda()
    v, i = route.topk(p, k)
    tv, ti = torch.topk(p, k, dim=-1)
    assert torch.equal(_selection(i), _selection(ti))
    assert torch.equal(v.view(torch.int32), p.gather(1, i).view(torch.int32))  # the values of the chosen
    assert bool((v[:, :-1] >= v[:, 1:]).logical_or(v[:, :-1].isnan()).all())  # sorted, largest first
    # the rule, on the CPU: a stable descending sort of torch's bit order
    u = p.cpu().view(torch.int32).long() & 0xFFFFFFFF
    key = torch.where(u >= 2 ** 31, 0xFFFFFFFF - u, u + 2 ** 31)
    key = torch.where(p.cpu().isnan(), 0xFFFFFFFF, key)
    rule = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(i.cpu(), rule)
    ties = (p.gather(1, ti[:, -1:]) == p).sum(1) > 1  # rows where the k-th value is not unique
    assert int(ties.sum()) > T // 20  # the case this test is about does occur
    compiled = torch.compile(lambda x: route.topk(torch.softmax(x, -1), k), fullgraph=True)
    assert torch.equal(compiled(p)[1], route.topk(torch.softmax(p, -1), k)[1])


@CUDA
@pytest.mark.gpu
@torch.no_grad()
def test_cuda_moe_block_with_the_kernel_gives_torch_topk_bits(monkeypatch):
    """A bf16 MoE block on CUDA (its logits are bf16: ties at the k-th are common) with the top-k kernel gives the
    bits of the same block with torch.topk."""
    from poc.model.config import ModelConfig
    from poc.model.transformer import MoE

    cfg = ModelConfig(dim=256, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=384, vocab_size=128,
                      family="qwen3_moe", n_experts=32, n_experts_per_tok=8, moe_ffn_dim=128, norm_topk_prob=True)
    torch.manual_seed(3)
    moe = MoE(cfg).bfloat16().cuda()
    moe.fuse()
    x = torch.randn(4, 300, 256, device="cuda").bfloat16()
    calls = []
    real = route.topk
    monkeypatch.setattr(route, "topk", lambda p, k: calls.append(1) or real(p, k))
    got = moe(x)
    assert calls
    monkeypatch.setattr(route, "topk", lambda p, k: torch.topk(p, k, dim=-1))
    assert torch.equal(got, moe(x)) and got.abs().amax() > 0
