"""The MoE block's routing (model/route.py): the top-k choice and the padded expert layout, against their rules
written out here, on the CPU (the torch path) and on CUDA (the Triton kernels against torch)."""

import pytest
import torch

from poc.model import fp8, route

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton routing kernels)")
GR = fp8.GROUP_ROWS


def _choices(T: int, E: int, k: int, seed: int) -> torch.Tensor:
    """(T, k) distinct experts per token; where E allows, the last expert is never chosen (an empty group) and a
    third of the tokens choose expert 1 (a group over many tiles)."""
    g = torch.Generator().manual_seed(seed)
    if T == 0:
        return torch.zeros(0, k, dtype=torch.long)
    spare = E - 1 >= k
    idx = torch.stack([torch.randperm(E - 1 if spare else E, generator=g)[:k] for _ in range(T)])
    if spare and E - 3 >= k - 1:
        rest = torch.stack([torch.randperm(E - 3, generator=g)[:k - 1] + 2 for _ in range(T // 3)])
        idx[: T // 3] = torch.cat([torch.ones(T // 3, 1, dtype=torch.long), rest], 1)
    return idx


def check_layout(key: torch.Tensor, n_experts: int, k: int, slot, tile_expert, a_rows) -> None:
    """The layout's rules, checked from the slots' experts alone: each expert's rows are a run that starts on a
    multiple of GR, in expert order, holding its slots in slot order, padded with -1 rows to a multiple of GR; each
    row tile knows its expert (n_experts past the last); a slot of no expert here points past the rows."""
    N = key.numel()
    n_rows = (N + GR - 1) // GR * GR + n_experts * GR
    assert a_rows.shape == (n_rows,) and a_rows.dtype == torch.int32
    assert tile_expert.shape == (n_rows // GR,) and tile_expert.dtype == torch.int32
    assert slot.shape == (N,) and slot.dtype == torch.int64
    key, slot, tile_expert, a_rows = key.cpu(), slot.cpu(), tile_expert.cpu(), a_rows.cpu()
    want_rows = torch.full((n_rows,), -1, dtype=torch.int32)
    want_tiles = torch.full((n_rows // GR,), n_experts, dtype=torch.int32)
    start = 0
    for e in range(n_experts):
        mine = (key == e).nonzero().squeeze(1)  # slot order
        assert torch.equal(slot[mine], torch.arange(start, start + mine.numel()))
        want_rows[start:start + mine.numel()] = (mine // k).to(torch.int32)
        stop = start + (mine.numel() + GR - 1) // GR * GR
        want_tiles[start // GR:stop // GR] = e
        start = stop
    others = (key < 0) | (key >= n_experts)
    assert bool((slot[others] == n_rows).all())
    assert torch.equal(a_rows, want_rows)
    assert torch.equal(tile_expert, want_tiles)


@pytest.mark.parametrize("T,E,k,first,n_local", [(100, 16, 4, 0, 16), (300, 32, 8, 0, 32), (77, 16, 2, 4, 8),
                                                 (1, 8, 8, 0, 8), (0, 8, 2, 0, 8)])
def test_torch_layout_follows_the_rules(T, E, k, first, n_local):
    idx = _choices(T, E, k, seed=T)
    key = torch.remainder(idx.reshape(-1) - first, E)
    check_layout(key, n_local, k, *route.slot_layout_torch(key, n_local, k, GR))
    # it is fp8.padded_layout's layout, per slot (what experts_w8a8 computes on)
    mine = key < n_local
    rows = torch.where(mine, key, n_local).argsort(stable=True)[: int(mine.sum())]
    ends = torch.searchsorted(key[rows], torch.arange(1, n_local + 1))
    slot, tiles, a_rows = route.slot_layout(key, n_local, k, GR)
    dest, tiles2, a_rows2 = fp8.padded_layout(rows, k, ends, n_slots=key.numel())
    assert torch.equal(slot[rows], dest) and torch.equal(tiles, tiles2) and torch.equal(a_rows, a_rows2)


def test_topk_on_cpu_is_torch_topk():
    p = torch.softmax(torch.randn(50, 16), -1)
    for got, want in zip(route.topk(p, 4), torch.topk(p, 4, dim=-1)):
        assert torch.equal(got, want)


def _tied_probs(T: int, E: int, seed: int) -> torch.Tensor:
    """Router probabilities as the model makes them, from bf16 logits: ties are everywhere (coarse logits), plus
    rows of all-equal values, zeros (underflow), -0 and a NaN row."""
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
@pytest.mark.parametrize("T,E,k,first,n_local", [(8192, 128, 8, 0, 128), (3001, 64, 4, 0, 64), (517, 16, 2, 4, 8),
                                                 (1, 8, 8, 0, 8), (0, 8, 2, 0, 8)])
def test_cuda_layout_is_the_torch_layout(T, E, k, first, n_local):
    idx = _choices(T, E, k, seed=T).cuda()
    key = torch.remainder(idx.reshape(-1) - first, E)
    got = route.slot_layout(key, n_local, k, GR)
    want = route.slot_layout_torch(key, n_local, k, GR)
    for a, b in zip(got, want):
        assert a.is_cuda and a.dtype == b.dtype and torch.equal(a, b)
    check_layout(key, n_local, k, *got)


@CUDA
@pytest.mark.gpu
@torch.no_grad()
def test_cuda_w8a8_moe_block_routes_through_the_slot_layout(monkeypatch):
    """A W8A8 MoE block on CUDA (the top-k kernel, the layout from route.slot_layout, the expert kernels, the combine
    through the slots) gives the bits of the sort-based way written out here: torch.topk, the stable sort, the
    layout of fp8.padded_layout, experts_w8a8, the combine through dest. The block takes the slot layout (counted)."""
    from poc.model.config import ModelConfig
    from poc.model.transformer import MoE, _act, _combine, _positions, _softmax, sum_exact

    E, F, D, k = 16, 256, 256, 4
    cfg = ModelConfig(dim=D, n_layers=1, n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=384, vocab_size=128,
                      family="qwen3_moe", n_experts=E, n_experts_per_tok=k, moe_ffn_dim=F, norm_topk_prob=True)
    g = torch.Generator().manual_seed(6)
    w13 = (torch.randn(E, 2 * F, D, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    w2 = (torch.randn(E, D, F, generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    s13 = (torch.rand(E, 2 * F // 128, D // 128, generator=g) * 2e-5 + 1e-5).cuda()
    s2 = (torch.rand(E, D // 128, F // 128, generator=g) * 2e-5 + 1e-5).cuda()
    moe = MoE(cfg).bfloat16().cuda()
    moe.set_fp8(w13, s13, w2, s2, w8a8=True)
    x = torch.randn(3, 200, D, generator=g).bfloat16().cuda()
    calls = []
    real = route.slot_layout
    monkeypatch.setattr(route, "slot_layout", lambda *a: calls.append(1) or real(*a))
    got = moe(x)
    assert len(calls) == 1
    xt = x.view(-1, D)
    T = xt.shape[0]
    w, idx = torch.topk(_softmax(moe.gate(xt).float()), k, dim=-1)
    w = (w / sum_exact(w)).bfloat16()
    key = idx.reshape(-1)
    rows = key.argsort(stable=True)
    ends = torch.searchsorted(key[rows], torch.arange(1, E + 1, device="cuda"))
    y, dest = fp8.experts_w8a8(xt, rows, k, ends, w13, s13, w2, s2, _act)
    want = _combine(y, w.reshape(-1), dest[_positions(rows)], y.shape[0], T, k, torch.bfloat16)
    assert torch.equal(got.view(T, D), want) and want.abs().amax() > 0
