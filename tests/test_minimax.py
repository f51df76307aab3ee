"""MiniMax-M2 (the chain's PoC model, ../shared/spec/minimax-m2.md): our Transformer against transformers 5.23's
MiniMaxM2ForCausalLM in float32, the release's checkpoint layout (FP8 blocks, float32 router, MTP tensors) and its
refusals, and each step of the validators' recipe against the independent float32 emulation of tests/minimax_spec.py.
"""

import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")

from poc.errors import InputError  # noqa: E402
from poc.model import attention  # noqa: E402
from poc.model.config import ModelConfig  # noqa: E402
from poc.model.options import ModelOptions  # noqa: E402
from poc.model.transformer import AllHeadsRMSNorm, MoE, apply_partial_rope, rope_table  # noqa: E402
from poc.model.weights import load_model  # noqa: E402
from .checkpoints import (MINIMAX_RELEASE_FIELDS, MINIMAX_WIDE, make_hf_minimax, random_layers,  # noqa: E402
                               unit_rows, write_minimax_fp8)
from .minimax_spec import Emulation, Recipe, e4, file_weights  # noqa: E402
from .parity import check_hidden_and_logits, check_reflections  # noqa: E402

X = torch.randn(3, 11, 64, generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float32 MiniMax-M2 (64 wide, 3 layers, rotary_dim 8 of 16, 8 experts top 2, a routing bias, norms far
    from 1) saved by transformers, and ours loaded from its files."""
    d = tmp_path_factory.mktemp("minimax")
    hf = make_hf_minimax(d)
    ours, cfg = load_model(d, dtype=torch.float32, with_head=True, progress=False)
    return hf, ours, cfg, d


@torch.no_grad()
def test_hidden_states_logits_and_reflections_match_transformers(tiny):
    hf, ours, cfg, _ = tiny
    assert (cfg.family, cfg.rotary_dim, cfg.rope_dim, cfg.head_dim) == ("minimax_m2", 8, 8, 16)
    assert cfg.qk_norm_all_heads and cfg.router == "sigmoid" and cfg.routing_bias
    check_hidden_and_logits(hf, ours, X, last_rtol=1e-6, last_atol=1e-6)
    check_reflections(hf, ours, cfg, X)


@torch.no_grad()
def test_the_parity_check_sees_each_minimax_choice(tiny, monkeypatch):
    """The parity test can fail: each MiniMax choice done the Qwen way moves the output far past 1e-5."""
    hf, ours, cfg, _ = tiny
    want = hf.model(inputs_embeds=X).last_hidden_state

    def off():
        return (ours(X, last_only=False) - want).abs().max().item()

    assert off() < 1e-5
    route = MoE.route

    def biased_weights(self, x):  # the bias weighing the experts too
        w, idx = route(self, x)
        w = w + self.e_score_correction_bias[idx]
        return w / w.sum(-1, keepdim=True), idx

    for name, patch in (("bias in the weights", lambda: monkeypatch.setattr(MoE, "route", biased_weights)),
                        ("no routing bias", lambda: monkeypatch.setattr(
                            MoE, "route", lambda self, x: route(_no_bias(self), x))),
                        ("whole-head RoPE", lambda: monkeypatch.setattr(
                            "poc.model.transformer.apply_partial_rope", _whole_rope)),
                        ("per-head q/k norm", lambda: monkeypatch.setattr(AllHeadsRMSNorm, "forward", _per_head))):
        patch()
        assert off() > 1e-3, name
        monkeypatch.undo()
    assert off() < 1e-5


def _no_bias(moe):
    class View:
        pass
    v = View()
    v.__dict__.update(moe.__dict__)
    v.sigmoid, v.gate, v.e_score_correction_bias, v.top_k = True, moe.gate, None, moe.top_k
    v.gate_parts = moe.gate_parts
    v.router_logits = MoE.router_logits.__get__(v)
    return v


def _whole_rope(x, cos, sin):
    D = x.shape[-1]
    c, s = rope_table(D, x.shape[-2], 5e6)
    from poc.model.transformer import apply_rope
    return apply_rope(x, c.to(x.device), s.to(x.device))


def _per_head(self, x):
    y = x.float().unflatten(-1, (-1, 16))
    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
    return (y.flatten(-2) * self.weight.float()).to(x.dtype)


@torch.no_grad()
def test_the_routing_bias_changes_the_chosen_experts_of_many_tokens(tiny):
    _, ours, _, _ = tiny
    moe = ours.layers["0"].mlp
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(3))
    _, with_bias = moe.route(x)
    _, without = moe.route.__func__(_no_bias(moe), x)
    changed = (with_bias.sort(-1).values != without.sort(-1).values).any(-1).float().mean().item()
    assert changed > 0.2, changed


def test_config_json_of_the_release_and_of_transformers(tiny):
    _, _, cfg, d = tiny
    hf = json.loads((d / "config.json").read_text())
    release = {k: v for k, v in hf.items() if k != "rope_parameters"}
    assert ModelConfig.from_hf(release) == cfg  # the release names rotary_dim and rope_theta
    t5 = {k: v for k, v in hf.items() if k not in ("rotary_dim", "rope_theta", *MINIMAX_RELEASE_FIELDS)}
    t5["architectures"] = ["MiniMaxM2ForCausalLM"]
    assert t5["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert ModelConfig.from_hf(t5) == cfg  # transformers 5 writes rope_parameters.partial_rotary_factor
    per_head = ModelConfig.from_hf(dict(hf, qk_norm_type="per_head"))
    assert per_head.qk_norm and not per_head.qk_norm_all_heads
    for bad, field in ((dict(attn_type_list=[1, 0, 1]), "attn_type_list"),
                       (dict(shared_intermediate_size=64), "shared_intermediate_size"),
                       (dict(scoring_func="relu"), "scoring_func"), (dict(qk_norm_type="per_token"), "qk_norm_type"),
                       (dict(rotary_dim=9), "config"), (dict(rotary_dim=32), "config"),
                       (dict(quantization_config=dict(quant_method="fp8", fmt="float8_e5m2",
                                                      weight_block_size=[128, 128])), "quantization_config")):
        with pytest.raises(InputError) as e:
            ModelConfig.from_hf(dict(hf, **bad))
        assert e.value.field == field, (bad, e.value.message)


# --- the release's files --------------------------------------------------------------------------------------------



@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """A MiniMax-M2 of 128-multiple sizes (so every linear and expert runs W8A8 as in production) in the release's
    FP8 layout with three MTP layers, and the bf16 checkpoint it was quantised from."""
    root = tmp_path_factory.mktemp("release")
    make_hf_minimax(root / "src", bias_std=0.05, **MINIMAX_WIDE)
    written = write_minimax_fp8(root / "src", root / "fp8", mtp_layers=3)
    return root, written


@pytest.mark.parametrize("fmt", ["float8_e4m3fn", "e4m3"])
def test_the_release_layout_loads_and_skips_the_mtp_layers(release, tmp_path, fmt, caplog):
    root, _ = release
    d = root / "fp8"
    if fmt == "e4m3":  # Qwen's spelling of the same format
        d = tmp_path / "e4m3"
        d.mkdir()
        (d / "model.safetensors").symlink_to(root / "fp8" / "model.safetensors")
        cfg = json.loads((root / "fp8" / "config.json").read_text())
        cfg["quantization_config"]["fmt"] = "e4m3"
        (d / "config.json").write_text(json.dumps(cfg))
    with caplog.at_level(logging.INFO, logger="poc.weights"):
        model, cfg = load_model(d, dtype=torch.bfloat16, progress=False)
    assert "skipping" in caplog.text and "layers 2, 3, 4" in caplog.text
    assert cfg.fp8_block == (128, 128) and model.attention == "fp8"  # the validators' attention by default
    moe = model.layers["0"].mlp
    assert moe.gate.weight.dtype == torch.float32 and moe.e_score_correction_bias.dtype == torch.float32
    assert moe.w13.dtype == torch.float8_e4m3fn and moe.w8a8 and moe.ue8m0
    assert model.layers["0"].self_attn.q_proj.weight.dtype == torch.float8_e4m3fn
    assert sorted(model.layers) == ["0", "1"]


def _edit(root, tmp_path, change):
    """A copy of the release checkpoint with its tensors changed by `change(tensors)`."""
    from safetensors.torch import load_file, save_file

    sd = load_file(root / "fp8" / "model.safetensors")
    change(sd)
    d = tmp_path / "bad"
    d.mkdir()
    save_file(sd, d / "model.safetensors")
    (d / "config.json").write_text((root / "fp8" / "config.json").read_text())
    return d


@pytest.mark.parametrize("case", ["unexpected", "per-head q_norm", "no scale", "no bias", "fp8 gate"])
def test_a_bad_release_checkpoint_fails_naming_the_tensor(release, tmp_path, case):
    root, _ = release
    name = {"unexpected": "model.layers.1.block_sparse_moe.shared_expert.w1.weight",
            "per-head q_norm": "model.layers.0.self_attn.q_norm.weight",
            "no scale": "model.layers.1.block_sparse_moe.experts.3.w2.weight_scale_inv",
            "no bias": "model.layers.0.block_sparse_moe.e_score_correction_bias",
            "fp8 gate": "model.layers.1.block_sparse_moe.gate.weight"}[case]

    def change(sd):
        if case == "unexpected":
            sd[name] = torch.zeros(128, 256, dtype=torch.bfloat16)
        elif case == "per-head q_norm":
            sd[name] = torch.ones(128, dtype=torch.bfloat16)
        elif case == "fp8 gate":
            sd[name] = sd[name].to(torch.float8_e4m3fn)
        else:
            del sd[name]

    with pytest.raises(InputError) as e:
        load_model(_edit(root, tmp_path, change), progress=False)
    assert name.removesuffix("_scale_inv") in e.value.message, e.value.message  # a lacking scale: its weight


# --- the recipe, step by step, against the independent emulation ---------------------------------------------------

@pytest.fixture(scope="module")
def release_model(release):
    root, _ = release
    model, cfg = load_model(root / "fp8", dtype=torch.bfloat16, progress=False)
    weights, final = file_weights(root / "fp8")
    return model.fuse(), cfg, weights, final


def _inputs(cfg, S=160, B=2, seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, S, cfg.dim, generator=g).bfloat16(), unit_rows(cfg.n_layers, cfg.dim, seed=seed)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@torch.no_grad()
def test_the_forward_is_the_spec_recipe(release_model):
    """The whole bf16 forward (FP8 attention over two 128-key tiles, UE8M0 W8A8, the float32 router and the
    weighing, the reflections) against the emulation: as close as the float32 summation order allows, and each
    recipe variant (a way to be systematically wrong) much farther away."""
    model, cfg, weights, final = release_model
    x, vs = _inputs(cfg)
    ours = model(x, reflections=vs).float()
    emu = {r: Emulation(cfg, weights, final, r).forward(x, vs) for r in (
        Recipe(), Recipe(attention="fp8kv"), Recipe(attention="bf16"), Recipe(router="bf16"),
        Recipe(scales="float32"), Recipe(weight_in_down=False))}
    spec = emu[Recipe()]
    d = _rel(ours, spec)
    assert d < 2e-3, d
    assert (ours == spec).float().mean().item() > 0.9  # bit for bit almost everywhere
    for r, y in emu.items():
        if r != Recipe():
            assert _rel(y, spec) > 5 * max(d, 1e-4), (r, _rel(y, spec), d)


@pytest.mark.parametrize("recipe", ["fp8kv", "bf16"])
@torch.no_grad()
def test_the_other_attention_recipes_are_their_emulations(release, recipe):
    """ModelOptions.attention reaches every layer when the model is built; the 0.20-era form (e4m3 K and V read back
    exactly) and plain bf16 attention compute their emulations' numbers, and neither is the FP8 recipe."""
    root, _ = release
    model, cfg = load_model(root / "fp8", dtype=torch.bfloat16, progress=False,
                            options=ModelOptions(attention=recipe))
    assert model.attention == recipe and {b.self_attn.recipe for b in model.layers.values()} == {recipe}
    weights, final = file_weights(root / "fp8")
    g = torch.Generator().manual_seed(10)
    q, k, v = ((3 * torch.randn(2, h, 260, 128, generator=g)).bfloat16() for h in (4, 2, 2))
    ours = attention.attend(q, k, v, recipe, 128 ** -0.5).float()
    spec = Emulation(cfg, weights, final, Recipe(attention=recipe)).attention(q.float(), k.float(), v.float())
    fp8 = Emulation(cfg, weights, final, Recipe()).attention(q.float(), k.float(), v.float())
    assert _rel(ours, spec) < 5e-3 and _rel(ours, fp8) > 4 * _rel(ours, spec), (_rel(ours, spec), _rel(ours, fp8))


@torch.no_grad()
def test_fp8_attention_is_the_spec_step(release_model):
    _, cfg, weights, final = release_model
    g = torch.Generator().manual_seed(9)
    q = (3 * torch.randn(2, 4, 300, 128, generator=g)).bfloat16()
    k, v = (3 * torch.randn(2, 2, 300, 128, generator=g)).bfloat16(), torch.randn(2, 2, 300, 128, generator=g).bfloat16()
    ours = attention.attend(q, k, v, "fp8", 128 ** -0.5)
    emu = Emulation(cfg, weights, final)
    k2, v2 = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    spec = emu.rnd(emu.fp8_attention(e4(q), e4(k2), e4(v2)))
    # the float32 sums' order (attention.py sums the dots exactly and evaluates exp2 in float64): a P near a rounding
    # boundary of e4m3 may round the other way
    same = (ours.float() == spec).float().mean().item()
    assert same > 0.99 and _rel(ours, spec) < 1e-3, (same, _rel(ours, spec))
    last = attention.attend(q[:, :, -1:], k, v, "fp8", 128 ** -0.5)
    assert torch.equal(last, ours[:, :, -1:])  # the last position alone: the same tiles, in the same order


@torch.no_grad()
def test_the_router_is_the_spec_step_ties_to_the_lower_expert(release_model):
    model, cfg, weights, final = release_model
    moe = model.layers["1"].mlp
    emu = Emulation(cfg, weights, final)
    a = torch.randn(64, cfg.dim, generator=torch.Generator().manual_seed(4)).bfloat16().float()
    w, idx = moe.route(a)
    we, ie = emu.route(a, weights(1))
    assert torch.equal(idx, ie) and w.dtype == torch.float32
    torch.testing.assert_close(w, we, rtol=2e-7, atol=0)
    # ties: experts 2 and 5 (and 6) with the same score: the lower one is chosen first
    tie = moe.__class__.__new__(moe.__class__)
    tie.__dict__.update(moe.__dict__)
    with torch.no_grad():
        gw = torch.zeros_like(moe.gate.weight)
        gw[[2, 5, 6], 0] = 1.0
        gw[7, 0] = 0.5
        bias = torch.zeros_like(moe.e_score_correction_bias)
    tie._parameters = dict(moe._parameters, e_score_correction_bias=torch.nn.Parameter(bias, requires_grad=False))
    tie._modules = dict(moe._modules, gate=torch.nn.Linear(cfg.dim, 8, bias=False, dtype=torch.float32))
    tie.gate.weight.data.copy_(gw)
    a1 = torch.zeros(1, cfg.dim)
    a1[0, 0] = 2.0
    assert tie.route(a1)[1].tolist() == [[2, 5]]
    W = dict(weights(1), **{"block_sparse_moe.gate.weight": gw, "block_sparse_moe.e_score_correction_bias": bias})
    assert emu.route(a1, W)[1].tolist() == [[2, 5]]


@torch.no_grad()
def test_the_split_router_is_the_spec_step_and_its_forward_the_spec_recipe(release, release_model):
    """router_gemm=split (CUDA's default, here on the CPU): the router of a bf16 model from the release's files
    chooses the emulation's experts with its weights to float32's accuracy, and the whole forward is as close to the
    emulation as the float32 router's (the variants, test_the_forward_is_the_spec_recipe, are 5x farther)."""
    root, _ = release
    plain, cfg, weights, final = release_model
    model, _ = load_model(root / "fp8", dtype=torch.bfloat16, progress=False,
                          options=ModelOptions(router_gemm="split"))
    model.fuse()
    assert model.computes()["router"] == "split" and plain.computes()["router"] == "float32"
    emu = Emulation(cfg, weights, final)
    a = torch.randn(256, cfg.dim, generator=torch.Generator().manual_seed(11)).bfloat16()
    for layer in ("0", "1"):
        w, idx = model.layers[layer].mlp.route(a)
        we, ie = emu.route(a.float(), weights(int(layer)))
        assert torch.equal(idx, ie)
        torch.testing.assert_close(w, we, rtol=1e-6, atol=0)
    x, vs = _inputs(cfg)
    spec = Emulation(cfg, weights, final).forward(x, vs)
    d_split, d_plain = _rel(model(x, reflections=vs), spec), _rel(plain(x, reflections=vs), spec)
    assert d_split < 2e-3 and d_split < 1.5 * d_plain + 1e-5, (d_split, d_plain)


@torch.no_grad()
def test_the_experts_are_the_spec_step(release_model):
    """The W8A8 experts with the float32 weight applied before the down projection's rounding and the k terms
    summed in float32, against the emulation; transformers' weighing is measurably another arithmetic."""
    model, cfg, weights, final = release_model
    moe = model.layers["0"].mlp
    a = torch.randn(2, 40, cfg.dim, generator=torch.Generator().manual_seed(8)).bfloat16()
    ours = moe(a).reshape(80, cfg.dim).float()
    emu = Emulation(cfg, weights, final)
    spec = emu.experts(a.reshape(80, cfg.dim).float(), weights(0))
    assert _rel(ours, spec) < 1e-3 and (ours == spec).float().mean().item() > 0.95
    other = Emulation(cfg, weights, final, Recipe(weight_in_down=False)).experts(a.reshape(80, cfg.dim).float(),
                                                                               weights(0))
    assert (other != spec).float().mean().item() > 0.01


@torch.no_grad()
def test_the_qk_norm_and_rope_are_the_spec_steps(release_model):
    model, cfg, weights, final = release_model
    attn = model.layers["0"].self_attn
    emu = Emulation(cfg, weights, final)
    q = (4 * torch.randn(3, 7, 512, generator=torch.Generator().manual_seed(2))).bfloat16()
    got = attn.q_norm(q).float()
    want = emu.qk_norm(q.float(), weights(0)["self_attn.q_norm.weight"])
    assert (got == want).float().mean().item() > 0.99 and _rel(got, want) < 1e-3
    x = torch.randn(3, 4, 7, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    cos, sin = rope_table(64, 7, cfg.rope_theta)
    from .minimax_spec import rope_tables
    c, s = rope_tables(7, 64, cfg.rope_theta)
    assert torch.equal(apply_partial_rope(x, cos, sin).float(), emu.rope(x.float(), c, s))


# --- layouts: tp=2 (attention by heads, the q/k norm's sums of squares all-reduced, the experts split 2 ways by
# expert) on gloo, and pp=2, against one process --------------------------------------------------------------------

_RANK = r"""
import sys
import torch, torch.distributed as dist
from poc.parallel.build import Part, build

rank, world, io, ckpt = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method="file://" + io + "/store", rank=rank, world_size=world)
x, vs, q = torch.load(io + "/in.pt")
model, cfg = build(ckpt, torch.bfloat16, "cpu", Part(tp_rank=rank, tp_size=world, group=dist.group.WORLD))
held = {k: (tuple(t.shape), str(t.dtype)) for k, t in model.state_dict().items()}
with torch.no_grad():
    norm = model.layers["0"].self_attn.q_norm
    w = q.shape[-1] // world
    normed = norm(q[..., rank * w:(rank + 1) * w])
    model.fuse()
    held["w13"] = (tuple(model.layers["0"].mlp.w13.shape), str(model.layers["0"].mlp.w13.dtype))
    out = model(x, reflections=vs)
torch.save({"held": held, "out": out, "normed": normed, "attention": model.attention}, f"{io}/rank{rank}.pt")
dist.barrier()
dist.destroy_process_group()
"""


@torch.no_grad()
def test_tensor_and_expert_parallel_on_gloo_is_the_one_process_model(release, release_model, tmp_path):
    """tp=2 of the release-layout checkpoint (W8A8, UE8M0, FP8 attention, bf16): each rank holds its heads' q/k/v
    rows and their q/k norm weights, 4 of 8 experts; the q/k norm over all heads gives the one-process norm's slice
    (the ranks' float32 sums of squares all-reduced); the output equals one process's closely (the row-parallel
    partial sums add in another order, so a value on an FP8 rounding boundary may round the other way, as between
    any two validators' layouts) and the spec's emulation as closely."""
    from .gloo import run_ranks

    root, _ = release
    model, cfg, weights, final = release_model
    x, vs = _inputs(cfg, S=140)
    q = (4 * torch.randn(2, 5, 512, generator=torch.Generator().manual_seed(12))).bfloat16()
    torch.save((x, vs, q), tmp_path / "in.pt")
    res = run_ranks(_RANK, tmp_path, [str(root / "fp8")], timeout=240)
    one = model(x, reflections=vs).float()
    spec = Emulation(cfg, weights, final).forward(x, vs)
    whole_norm = model.layers["0"].self_attn.q_norm(q).float()
    for r, got in enumerate(res):
        assert got["attention"] == "fp8"
        held = got["held"]
        assert held["layers.0.self_attn.q_proj.weight"] == ((256, 256), "torch.float8_e4m3fn")
        assert held["layers.0.self_attn.q_norm.weight"][0] == (256,)
        assert held["layers.0.self_attn.k_norm.weight"][0] == (128,)
        assert held["layers.0.mlp.gate.weight"] == ((8, 256), "torch.float32")  # the router whole, float32
        assert held["w13"] == ((4, 256, 256), "torch.float8_e4m3fn")
        part = whole_norm[..., r * 256:(r + 1) * 256]
        assert (got["normed"].float() == part).float().mean().item() > 0.99 and _rel(got["normed"], part) < 1e-3
        assert _rel(got["out"], one) < 0.05 and _rel(got["out"], spec) < 0.05, (_rel(got["out"], one), r)
    assert torch.equal(res[0]["out"], res[1]["out"])  # every rank ends with the whole output


@torch.no_grad()
def test_two_pipeline_stages_are_the_one_process_model(release, release_model):
    from poc.parallel.build import Part, build

    root, _ = release
    model, cfg, _, _ = release_model
    x, vs = _inputs(cfg, S=140)
    first, _ = build(root / "fp8", torch.bfloat16, "cpu", Part(stage=0, n_stages=2))
    second, _ = build(root / "fp8", torch.bfloat16, "cpu", Part(stage=1, n_stages=2))
    assert sorted(first.layers) == ["0"] and sorted(second.layers) == ["1"]
    h = first.fuse()(x, reflections=vs)
    assert h.shape == x.shape
    assert torch.equal(second.fuse()(h, reflections=vs), model(x, reflections=vs))


@torch.no_grad()
def test_random_weights_are_a_checkpoint_the_emulation_reads(tmp_path):
    """random:tiny-minimax:fp8 (the benchmarks' model, W8A8 and FP8 attention) computes the emulation of the
    checkpoint its draws make (random_weights.checkpoint_layer, under the release's names): what the GPU accuracy
    benchmark compares, at the real shape."""
    from poc.model.random_weights import random_model
    from poc.model.source import parse

    src = parse("random:tiny-minimax:fp8")
    cfg, fp8 = src.config(), src.fp8
    model = random_model(cfg, torch.bfloat16, "cpu", fp8_ckpt=fp8)
    assert model.attention == "fp8" and cfg.fp8_block == (128, 128)
    weights = random_layers(cfg, torch.bfloat16, "cpu")
    final = dict(model.named_parameters())["norm.weight"]
    x, vs = _inputs(cfg, S=140)
    ours = model(x, reflections=vs).float()
    spec = Emulation(cfg, weights, final).forward(x, vs)
    assert _rel(ours, spec) < 2e-3 and (ours == spec).float().mean().item() > 0.9, _rel(ours, spec)


# --- on the GPU ------------------------------------------------------------------------------------------------------

def _cuda_w2_case(dtype, seed: int):
    """The second expert GEMM's input on the padded layout: uneven groups, an empty expert, FP8 weights."""
    from poc.model import experts, fp8

    g = torch.Generator(device="cuda").manual_seed(seed)
    E, F, D, k, T = 6, 256, 512, 2, 701
    w2 = (torch.randn(E, D, F, device="cuda", generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    s2 = torch.rand(E, D // 128, F // 128, device="cuda", generator=g) * 2e-5 + 1e-5
    choice = torch.randint(0, E - 1, (T * k,), device="cuda", generator=g)
    choice[: T // 2] = 0
    rows = choice.argsort(stable=True)
    ends = torch.searchsorted(choice[rows], torch.arange(1, E + 1, device="cuda"))
    dest, tile_e, a_rows = experts.padded_layout(rows, k, ends)
    h = torch.randn(a_rows.numel(), F, device="cuda", generator=g).to(dtype)
    aq, as_ = fp8.quantize_act(h, ue8m0=True)
    rw = torch.rand(a_rows.numel(), device="cuda", generator=g)
    return aq, as_, w2, s2, tile_e, a_rows >= 0, rw


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton expert kernels)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_w2_epilogue_applies_the_routing_weight_before_the_one_rounding(dtype):
    """The w2 kernels' row weight (MiniMax's routing weight): each row's float32 product times its weight, rounded
    once, bit for bit what the float32 GEMM output multiplied and rounded gives; Triton's and (on Hopper) Gluon's."""
    from poc.model import experts
    from poc.model.kernels import fp8_gluon, fp8_triton

    aq, as_, w2, s2, tile_e, live, rw = _cuda_w2_case(dtype, seed=3)
    kw = dict(group_rows=experts.GROUP_ROWS)
    y32 = fp8_triton.grouped_gemm(aq, as_, w2, s2, tile_e, torch.float32, **kw)
    want = (y32 * rw[:, None]).to(dtype)
    got = fp8_triton.grouped_gemm(aq, as_, w2, s2, tile_e, dtype, row_weight=rw, **kw)
    assert torch.equal(got[live], want[live]) and got[live].abs().amax() > 0
    assert not torch.equal(got[live], y32[live].to(dtype))  # the weight acts
    if torch.cuda.get_device_capability()[0] == 9:
        gy = fp8_gluon.grouped_gemm(aq, as_.t().contiguous(), w2, s2, tile_e, dtype, row_weight=rw)
        g32 = fp8_gluon.grouped_gemm(aq, as_.t().contiguous(), w2, s2, tile_e, torch.float32)
        assert torch.equal(g32[live], y32[live])
        assert torch.equal(gy[live], want[live])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.no_grad()
def test_cuda_minimax_is_the_spec_emulation_eager_and_compiled():
    """random:tiny-minimax:fp8 on the GPU (the FP8 attention kernel, the W8A8 kernels with the weighted w2, the
    route kernel): compiled as the server runs gives eager's bits, and both are the float32 emulation's numbers on
    the GPU as closely as the float32 accumulation order allows (the recipe variants are much farther)."""
    from poc.engine.compute import V2Compute
    from poc.model.random_weights import random_model
    from poc.model.source import parse

    torch.backends.cuda.matmul.allow_tf32 = False
    src = parse("random:tiny-minimax:fp8")
    cfg, fp8 = src.config(), src.fp8
    model = random_model(cfg, torch.bfloat16, "cuda", fp8_ckpt=fp8)
    weights = random_layers(cfg, torch.bfloat16, "cuda")
    final = dict(model.named_parameters())["norm.weight"]
    x, vs = _inputs(cfg, S=300)
    x, vs = x.cuda(), vs.cuda()
    eager = model(x, reflections=vs).float()
    # the same weights, built for compiled layers as the engine builds them (ModelOptions.compiled: its MoE dispatch
    # compiles its elementwise steps too)
    served = random_model(cfg, torch.bfloat16, "cuda", fp8_ckpt=fp8, options=ModelOptions(compiled=True))
    comp = V2Compute(served, cfg, torch.bfloat16, torch.device("cuda"), "tiny-minimax", compile=True)
    compiled = comp.model(x, reflections=vs, step=comp._step).float()
    assert torch.equal(compiled, eager)
    spec = Emulation(cfg, weights, final).forward(x, vs)
    other = Emulation(cfg, weights, final, Recipe(scales="float32")).forward(x, vs)
    # measured on an H200: 0.0028 (the FP8 tensor cores' accumulation, the attention kernel's among it); the 0.20-era
    # attention's emulation was only 0.0036 from the spec's at this tiny shape, float32 scales are farther
    d = _rel(eager, spec)
    assert d < 2e-2 and d < _rel(eager, other), (d, _rel(eager, other))
