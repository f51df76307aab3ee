"""FP8 checkpoints as Qwen ships them: float8_e4m3fn weights with per-128x128-block weight_scale_inv, dequantised
into the model dtype while loading (the dequantise forward, fp8="dequant"; the default W8A8 forward is
tests/test_w8a8.py's)."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

pytest.importorskip("transformers")  # the checkpoints are made by transformers

from poc.errors import InputError  # noqa: E402
from poc.model.options import ModelOptions  # noqa: E402
from poc.model.weights import dequantize_fp8, load_model  # noqa: E402
from .checkpoints import (MOE_CASES, QUANT, make_hf, make_hf_moe, quantize, unit_rows,  # noqa: E402
                               write_fp8_and_twin)

FP8_FORWARD = "dequant"  # every loader here is passed it: the dequantise forward (W8A8, the default, is test_w8a8.py's)


@pytest.fixture(params=["qwen3", "qwen3_moe"])
def ckpts(request, tmp_path):
    src = tmp_path / "src"
    if request.param == "qwen3":
        make_hf(src, "qwen3", intermediate_size=320)  # 3 row blocks of gate/up, 3 column blocks of down: cropped
    else:
        make_hf_moe(src, **dict(MOE_CASES["mlp-only-layer-norm-topk"], intermediate_size=320))
    n = write_fp8_and_twin(src, tmp_path / "fp8", tmp_path / "twin")
    assert n > 0
    return src, tmp_path / "fp8", tmp_path / "twin"


def test_dequantize_crops_edge_blocks():
    w = torch.randn(300, 200)
    q, s = quantize(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2)
    want = torch.stack([torch.stack([q[r, c].float() * s[r // 128, c // 128] for c in range(200)])
                        for r in range(0, 300, 37)])
    torch.testing.assert_close(dequantize_fp8(q, s)[::37], want, rtol=0, atol=0)
    # e4m3 keeps 3 mantissa bits: each element within half an ulp (2^-4 relative) of the original, or of 2^-9 * scale
    err = (dequantize_fp8(q, s) - w).abs()
    bound = torch.maximum(w.abs() * 2 ** -4, 2 ** -10 * s.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200])
    assert (err <= bound * 1.0001).all()


@torch.no_grad()
def test_fp8_matches_dequantised_twin(ckpts):
    """Tolerance 0: dequantising (fp8 x scale in fp32, rounded to bf16) is the same arithmetic the twin's weights
    were made with, so the two models hold bit-identical parameters and one forward code path runs on both."""
    _, fp8_dir, twin_dir = ckpts
    fp8, cfg = load_model(fp8_dir, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    twin, _ = load_model(twin_dir, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    assert cfg.fp8_block == (128, 128) and next(fp8.parameters()).dtype == torch.bfloat16
    a, b = fp8.state_dict(), twin.state_dict()
    assert a.keys() == b.keys() and not any("scale_inv" in k for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    vs = unit_rows(cfg.n_layers, cfg.dim)
    assert torch.equal(fp8(x, reflections=vs, last_only=False), twin(x, reflections=vs, last_only=False))
    # float32: the dequantised weights unrounded; the twin's bf16 weights differ by at most half a bf16 ulp
    f32, _ = load_model(fp8_dir, dtype=torch.float32, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    t32, _ = load_model(twin_dir, dtype=torch.float32, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    w8, wt = f32.state_dict(), t32.state_dict()
    assert all(((w8[k] - wt[k]).abs() <= w8[k].abs() * 2 ** -8).all() for k in w8)


@torch.no_grad()
def test_fp8_close_to_unquantised(ckpts):
    """Against the original float32 model, in float32. To first order the output error is linear in the weight
    error, and e4m3 rounds to 3 mantissa bits where bf16 keeps 8: a 2^5 = 32 times coarser relative step. So the
    bound is 32 x the error of the same model with its weights rounded to bf16 (measured here: it calibrates how
    much these deliberately sharp random weights amplify a perturbation, ~1% relative L2 over 3 layers). Measured:
    fp8 10-16% against bf16 0.9-1.0% (x11-18; the MoE case includes router top-k flips). It must also exceed 0.1%,
    so the weights really went through fp8."""
    src, fp8_dir, _ = ckpts
    ref, cfg = load_model(src, dtype=torch.float32, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    q, _ = load_model(fp8_dir, dtype=torch.float32, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    rounded, _ = load_model(src, dtype=torch.float32, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
    rounded.load_state_dict({k: v.bfloat16().float() for k, v in ref.state_dict().items()})
    x = torch.randn(2, 9, 64, generator=torch.Generator().manual_seed(4))
    vs = unit_rows(cfg.n_layers, cfg.dim)
    want = ref(x, reflections=vs, last_only=False)

    def rel(model):
        return ((model(x, reflections=vs, last_only=False) - want).norm() / want.norm()).item()

    rel_fp8, rel_bf16 = rel(q), rel(rounded)
    print(f"relative L2 vs unquantised: fp8 {rel_fp8:.4f}, bf16-rounded {rel_bf16:.4f}")
    assert 1e-3 < rel_fp8 < 32 * rel_bf16 and rel_bf16 < 0.02


def test_fp8_errors(ckpts, tmp_path):
    _, fp8_dir, _ = ckpts
    cfg = json.loads((fp8_dir / "config.json").read_text())
    sd = load_file(fp8_dir / "model.safetensors")
    scale = next(k for k in sd if k.endswith("scale_inv"))

    def write(name, tensors, config):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps(config))
        with pytest.raises(InputError) as e:
            load_model(d, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
        return e.value.message

    assert "no quantization_config" in write("noq", sd, {k: v for k, v in cfg.items() if k != "quantization_config"})
    assert "lacks its weight_scale_inv" in write("noscale", {k: v for k, v in sd.items() if k != scale}, cfg)
    assert "scales of shape" in write("badscale", {**sd, scale: torch.ones(5, 5)}, cfg)
    for bad in ({**QUANT, "weight_block_size": [64, 64]}, {**QUANT, "activation_scheme": "static"}):
        name = f"bad{len(list(tmp_path.iterdir()))}"
        msg = write(name, sd, {**cfg, "quantization_config": bad})
        assert "[64, 64]" in msg or "static" in msg


@torch.no_grad()
def test_fp8_tensor_parallel_slices(tmp_path):
    """A tp rank's slices of an FP8 checkpoint (dequantised whole, then cut) equal the twin's slices bit for bit."""
    from poc.parallel.build import Part, build

    make_hf(tmp_path / "src", "qwen3", intermediate_size=320)
    write_fp8_and_twin(tmp_path / "src", tmp_path / "fp8", tmp_path / "twin")
    for rank in (0, 1):
        a, _ = build(tmp_path / "fp8", "auto", "cpu", Part(tp_rank=rank, tp_size=2), options=ModelOptions(fp8=FP8_FORWARD))
        b, _ = build(tmp_path / "twin", "auto", "cpu", Part(tp_rank=rank, tp_size=2), options=ModelOptions(fp8=FP8_FORWARD))
        sa, sb = a.state_dict(), b.state_dict()
        assert sa["layers.0.mlp.down_proj.weight"].shape == (64, 160)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@torch.no_grad()
def test_fp8_experts_kept_in_memory(tmp_path, device):
    """fp8_experts="keep" (the default): a sparse layer's experts stay float8 with their block scales, stacked,
    and are dequantised per forward: the same numbers as dequantising at load, for the whole model and for a
    tensor-parallel rank (its experts only). Width 128 and hidden 192: gate|up on whole block rows, a cropped
    column block."""
    from poc.model.transformer import MoE
    from poc.parallel.build import Part, build

    src = tmp_path / "src"
    make_hf_moe(src, **dict(MOE_CASES["mlp-only-layer-norm-topk"], moe_intermediate_size=128, hidden_size=192))
    write_fp8_and_twin(src, tmp_path / "fp8", tmp_path / "twin")
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = torch.randn(2, 7, 192, generator=torch.Generator().manual_seed(5)).bfloat16().to(device)
    vs = unit_rows(3, 192).to(device)
    for dtype in (torch.bfloat16, torch.float32):
        kept, cfg = load_model(tmp_path / "fp8", dtype=dtype, device=device, progress=False, options=ModelOptions(fp8=FP8_FORWARD))
        moes = [b.mlp for b in kept.layers.values() if isinstance(b.mlp, MoE)]
        assert moes and all(m.w13.dtype == torch.float8_e4m3fn and m.w13.shape == (8, 256, 192) for m in moes)
        assert all(m.w13_scale.shape == (8, 2, 2) and m.w2_scale.shape == (8, 2, 1) for m in moes)
        assert not any(".experts." in k for k in kept.state_dict())
        full, _ = load_model(tmp_path / "fp8", dtype=dtype, device=device, progress=False, options=ModelOptions(fp8=FP8_FORWARD, fp8_experts="dequant"))
        assert all(b.mlp.w13 is None for b in full.layers.values() if isinstance(b.mlp, MoE))
        xs = x.to(dtype)
        kept.fuse(), full.fuse()  # the same attention GEMMs, and stacked experts in both (grouped GEMM on CUDA)
        assert torch.equal(kept(xs, reflections=vs.to(dtype), last_only=False),
                           full(xs, reflections=vs.to(dtype), last_only=False))
    rank, _ = build(tmp_path / "fp8", torch.bfloat16, "cpu", Part(tp_rank=1, tp_size=2), options=ModelOptions(fp8=FP8_FORWARD))
    m = next(b.mlp for b in rank.layers.values() if isinstance(b.mlp, MoE))
    assert (m.first, m.stop) == (4, 8) and m.w13.shape == (4, 256, 192) and m.w13.dtype == torch.float8_e4m3fn
    with pytest.raises(InputError, match="--fp8-experts / POC_FP8_EXPERTS must be keep or dequant"):
        ModelOptions(fp8_experts="int4")
