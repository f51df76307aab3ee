"""The MoE router (model/route.py): its top-k, torch.topk on the CPU and on CUDA the Triton kernel against torch.topk
and against the rule written out here; MiniMax-M2's float32 router GEMM as three exact bfloat16 parts, against
float64 and a float32 GEMM."""

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


# ---------------------------------------------------------------------------------------------------------------
# the sigmoid router's float32 GEMM as three bfloat16 parts (route.split3 / split_logits, ModelOptions.router_gemm)


def _gate(E: int, D: int, seed: int) -> torch.Tensor:
    """A float32 gate with every bit used and exponents far apart (2^-60 .. 2^20), a few bfloat16 values exactly."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(E, D, generator=g) * torch.exp2(torch.randint(-60, 21, (E, D), generator=g).float())
    w[0, :8] = torch.tensor([0.0, -0.0, 1.0, -2.5, 3.0e-5, 448.0, 1e-30, -7.0])
    return w


def _float32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The classic bound of a float32 dot product of length D (any summation order): D u sum |x_i w_i|, u = 2^-24."""
    return x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().t())


def test_split3_parts_are_bfloat16_and_sum_to_the_float32_gate_exactly():
    w = _gate(64, 384, 0)
    parts = route.split3(w)
    assert parts.dtype == torch.bfloat16 and parts.shape == (192, 384)
    hi, mid, lo = parts.double().chunk(3)
    assert torch.equal(hi + mid + lo, w.double())  # float64 holds the sum exactly: nothing of w is lost
    assert (mid != 0).float().mean() > 0.9 and (lo != 0).float().mean() > 0.5  # the parts carry real bits
    assert torch.equal(hi, w.bfloat16().double())
    tiny = torch.tensor([[2.0 ** -120 * (1 + 2.0 ** -20)]])  # its last bits fall below bfloat16's subnormals
    with pytest.raises(ValueError, match="do not split exactly"):
        route.split3(tiny)


def test_split_logits_are_a_float32_gemm_of_every_bit():
    """The split's logits of a bfloat16 x lie within the float32 dot-product bound of the float64 product, and on
    average as close to it as a float32 GEMM's; the bfloat16 gate alone (one part) is hundreds of times farther, so
    the comparison sees a lost bit."""
    w = torch.randn(64, 3072, generator=torch.Generator().manual_seed(1)) * 0.02
    x = torch.randn(512, 3072, generator=torch.Generator().manual_seed(2)).bfloat16()
    exact = x.double() @ w.double().t()
    split = route.split_logits(x, route.split3(w))
    assert split.dtype == torch.float32 and split.shape == (512, 64)
    err = (split.double() - exact).abs()
    err_f32 = (torch.nn.functional.linear(x.float(), w).double() - exact).abs()
    assert (err <= _float32_bound(x, w)).all() and err.mean() < 2 * err_f32.mean(), (err.mean(), err_f32.mean())
    one_part = (x.double() @ w.bfloat16().double().t() - exact).abs()
    assert one_part.mean() > 100 * err_f32.mean()
    # the top 8 of the sigmoid scores: those of the float64 product
    assert torch.equal(torch.topk(split, 8).indices, torch.topk(exact, 8).indices)


@torch.no_grad()
def test_the_minimax_router_option_builds_the_split_for_bfloat16_models():
    """router_gemm=split: a bfloat16 MiniMax block routes through the parts (the float32 GEMM's experts and, to
    float32's accuracy, its weights) and says so; a float32 model keeps the float32 GEMM; auto is float32 on the CPU;
    a bad value is refused naming its variable."""
    from poc.errors import InputError
    from poc.model.config import PRESETS
    from poc.model.options import ModelOptions
    from poc.model.random_weights import random_model

    cfg = PRESETS["tiny-minimax"]
    split = random_model(cfg, torch.bfloat16, "cpu", options=ModelOptions(router_gemm="split"))
    plain = random_model(cfg, torch.bfloat16, "cpu")
    assert split.computes()["router"] == "split" and plain.computes()["router"] == "float32"
    moe, ref = split.layers["0"].mlp, plain.layers["0"].mlp
    assert moe.gate_parts is not None and ref.gate_parts is None and torch.equal(moe.gate.weight, ref.gate.weight)
    x = torch.randn(2000, cfg.dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    (w1, i1), (w2, i2) = moe.route(x), ref.route(x)
    assert torch.equal(i1, i2)
    torch.testing.assert_close(w1, w2, rtol=1e-6, atol=0)
    assert ((moe.router_logits(x).double() - ref.router_logits(x).double()).abs()
            <= 2 * _float32_bound(x, moe.gate.weight)).all()
    f32 = random_model(cfg, torch.float32, "cpu", options=ModelOptions(router_gemm="split"))
    assert f32.computes()["router"] == "float32"
    assert random_model(PRESETS["tiny"], torch.float32, "cpu").computes()["router"] is None  # no sigmoid router
    with pytest.raises(InputError, match="POC_ROUTER_GEMM"):
        ModelOptions.from_env({"POC_ROUTER_GEMM": "tf32"})


@CUDA
@pytest.mark.gpu
@torch.no_grad()
def test_cuda_split_router_is_as_close_to_float64_as_the_float32_gemm():
    """On CUDA (cuBLAS's bfloat16 GEMM with a float32 output, tensor cores) at MiniMax-M2.7's router shape: every
    logit within the float32 dot-product bound of float64, the mean error within 4x the FFMA GEMM's, the experts the
    float64 product chooses (but for near-ties), and the same bits compiled."""
    torch.backends.cuda.matmul.allow_tf32 = False
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(256, 3072, device="cuda", generator=g) * 0.02
    x = torch.randn(16384, 3072, device="cuda", generator=g).bfloat16()
    exact = x.double() @ w.double().t()
    bound = _float32_bound(x, w)
    parts = route.split3(w)
    split = route.split_logits(x, parts)
    ffma = torch.nn.functional.linear(x.float(), w)
    err_s, err_f = (split.double() - exact).abs(), (ffma.double() - exact).abs()
    assert (err_s <= bound).all() and (err_f <= bound).all()
    assert err_s.mean() < 4 * err_f.mean(), (err_s.mean().item(), err_f.mean().item())
    top = torch.topk(exact, 8).indices
    assert (torch.topk(split, 8).indices != top).any(-1).float().mean() < 1e-3
    compiled = torch.compile(route.split_logits, fullgraph=True)
    assert torch.equal(compiled(x, parts), split)
