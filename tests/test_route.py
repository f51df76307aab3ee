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


def test_split_bf16_is_exact_for_every_normal_float32():
    """route.split_bf16: hi + mid + lo gives back every float32 bit for bit, over many binades and signs, including
    values with all 24 significant bits set and values just above float32's smallest normal."""
    g = torch.Generator().manual_seed(5)
    m = torch.randn(256, 96, generator=g) * torch.logspace(-30, 30, 96)
    full = torch.tensor([1 - 2 ** -24, -(2 - 2 ** -23), 1 + 2 ** -23, 3.0000002, -0.1, 2 ** -100 * (1 + 2 ** -23)])
    w = torch.cat([m.flatten(), full, torch.finfo(torch.float32).tiny * 2 ** 20 * (1 + torch.rand(64, generator=g))])
    w = w.reshape(-1, 2)
    parts = route.split_bf16(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (3 * w.shape[0], 2)
    hi, mid, lo = parts.float().chunk(3)
    assert torch.equal((hi + mid) + lo, w)
    assert (mid != 0).any() and (lo != 0).any()  # the split needs all three terms for these values
    # the plain rounding to bf16 would not do: the remainder is what a bf16 router would lose
    assert not torch.equal(w.bfloat16().float(), w)


def _router_errors(device: str):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(512, 3072, generator=g) * 2).bfloat16().to(device)  # a normed hidden state: bf16
    w = (torch.randn(256, 3072, generator=g) / 3072 ** 0.5).to(device)  # the float32 router
    exact = x.double() @ w.double().t()
    split = route.router_logits(x, route.split_bf16(w))
    plain = torch.nn.functional.linear(x.float(), w)
    hi_only = torch.nn.functional.linear(x.float(), w.bfloat16().float())  # a router rounded to bf16
    return split, *((y.double() - exact).abs() for y in (split, plain, hi_only)), exact


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.gpu])])
def test_router_logits_are_as_precise_as_a_float32_gemm(device):
    """The float32 router through route.router_logits (three bf16 GEMMs with float32 products and sums) against
    float64: within the error of the float32 x float32 GEMM itself (torch.nn.functional.linear of the widened x),
    which leaves the router's choices as they were. On CUDA the bf16 GEMMs run on tensor cores (mm with a float32
    output); a reduced-precision sum there, or a lost term of the split, would show as errors far above these."""
    if device == "cuda":
        assert not torch.backends.cuda.matmul.allow_tf32
    split, err, err_plain, err_bf16, exact = _router_errors(device)
    assert split.dtype == torch.float32 and split.shape == (512, 256)
    scale = exact.abs().amax()
    assert err_plain.amax() < 1e-5 * scale  # the float32 GEMM's own error: what "true float32" allows
    assert err.amax() <= 2 * err_plain.amax() + 1e-7 * scale, (err.amax(), err_plain.amax())
    assert err.mean() <= 2 * err_plain.mean()
    assert err_bf16.amax() > 100 * err.amax()  # a router rounded to bf16 (one term of the split) is far outside
