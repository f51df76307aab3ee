"""Sharding in one process: sliced checkpoint reads, tp partial outputs summing to the whole, stages chaining to the full
model, a tp rank's peak memory."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from poc.model.config import ModelConfig
from poc.model.transformer import Transformer
from poc.model.weights import index_checkpoint, iter_state_dict
from poc.parallel.pp import keep_stage
from poc.parallel.tp import apply_tp
from poc.protocol import v2

from .golden import ROOT, V1_GOLDEN as G1, v2_checkpoint

BH, PK = G1["block_hash"], G1["public_key"]
SEQ, K = 16, 12


# --- sharding in one process --------------------------------------------------------------------------------------

def test_sliced_loader_reads_rows_and_columns(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    import poc.model.weights as W

    torch.manual_seed(0)
    full = {"a": torch.randn(37, 24), "b": torch.randn(9, 50), "c": torch.randn(11)}
    save_file({k: v.to(torch.bfloat16) for k, v in full.items()} | {"f": full["a"]}, str(tmp_path / "m.safetensors"))
    refs = index_checkpoint(tmp_path)
    shard = {"a": (1, 5, 17), "b": (0, 3, 8), "c": (0, 2, 9), "f": (1, 0, 12)}
    for col_bytes in (1 << 20, 200, 16):  # one block; several row blocks; rows longer than the block
        monkeypatch.setattr(W, "COLUMN_BYTES", col_bytes)
        got = dict(iter_state_dict(refs, ["a", "b", "c", "f"], torch.float32, "cpu", shard=shard))
        bf = {k: v.to(torch.bfloat16).float() for k, v in full.items()}
        assert torch.equal(got["a"], bf["a"][:, 5:17])
        assert torch.equal(got["b"], bf["b"][3:8])
        assert torch.equal(got["c"], bf["c"][2:9])
        assert torch.equal(got["f"], full["a"][:, :12])
    with pytest.raises(ValueError, match="slice"):
        list(iter_state_dict(refs, ["c"], shard={"c": (1, 0, 1)}))


def _tiny(family: str, **over) -> ModelConfig:
    """The golden tiny config of `family`, with config.json fields overridden."""
    return ModelConfig.from_hf(json.loads((v2_checkpoint(family) / "config.json").read_text()) | over)


@pytest.mark.parametrize("family,over", [("qwen3", {}), ("llama", {"attention_bias": True}),
                                         ("llama", {"num_key_value_heads": 4})])
def test_tp_partial_outputs_sum_to_the_whole(family, over):
    """apply_tp without a group: each rank's attention/MLP output is a partial sum; the sum is the full output."""
    cfg = _tiny(family, **over)
    torch.manual_seed(1)
    full = Transformer(cfg).eval()
    with torch.no_grad():
        for p in full.parameters():
            p.normal_(0, 0.2)
    shards = []
    for r in range(2):
        m = Transformer(cfg).eval()
        m.load_state_dict(full.state_dict())
        plan = apply_tp(m, r, 2, None)
        shards.append(m.fuse())
        assert m.layers["0"].self_attn.n_heads == cfg.n_heads // 2 and m.cfg.n_heads == cfg.n_heads
        assert (m.layers["0"].self_attn.o_proj.bias is not None) == (cfg.o_bias and r == 0)
        assert plan["layers.1.mlp.down_proj.weight"] == (1, r * cfg.ffn_dim // 2, (r + 1) * cfg.ffn_dim // 2)
    x = torch.randn(3, 7, cfg.dim)
    cos, sin = full.rope_cos[:7], full.rope_sin[:7]
    with torch.no_grad():
        for last in (False, True):
            want = full.layers["0"].self_attn(x, cos, sin, last)
            got = sum(s.layers["0"].self_attn(x, cos, sin, last) for s in shards)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(sum(s.layers["1"].mlp(x) for s in shards), full.layers["1"].mlp(x),
                                   atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="n_kv_heads=.* tp=3"):
        apply_tp(Transformer(_tiny("llama", num_attention_heads=6, num_key_value_heads=2)), 0, 3, None)


def test_tp_on_meta_leaves_shapes_only():
    cfg = _tiny("qwen3")
    with torch.device("meta"):
        m = Transformer(cfg)
    apply_tp(m, 1, 2, None)
    a = m.layers["1"].self_attn
    assert a.q_proj.weight.shape == (32, 64) and a.k_proj.weight.shape == (16, 64) and a.o_proj.weight.is_meta
    assert a.o_proj.weight.shape == (64, 32) and m.layers["1"].mlp.down_proj.weight.shape == (64, 64)
    assert a.q_norm.weight.shape == (16,)  # Qwen3's q/k norms stay whole


def test_stages_chain_to_the_full_model():
    """Stage 0 then stage 1 (reflections by global index) equals the whole model."""
    from poc.model.weights import load_model

    full, cfg = load_model(v2_checkpoint("qwen3"), dtype=torch.float32, progress=False)
    stages = []
    for s in range(2):
        m, _ = load_model(v2_checkpoint("qwen3"), dtype=torch.float32, progress=False)
        stages.append(keep_stage(m, s, 2))
    assert list(stages[0].layers) == ["0"] and stages[0].norm is None
    assert list(stages[1].layers) == ["1"] and stages[1].norm is not None
    x = v2.inputs(BH, PK, [0, 1, 2], SEQ, cfg.dim)
    refl = v2.layer_vectors(BH, cfg.n_layers, cfg.dim)
    with torch.no_grad():
        h = stages[0](x, reflections=refl, last_only=True)
        assert h.shape == (3, SEQ, cfg.dim)
        torch.testing.assert_close(stages[1](h, reflections=refl), full(x, reflections=refl), atol=0, rtol=0)


def test_a_short_last_batch_goes_down_the_pipeline_padded():
    """A rank that runs compiled pads a short last batch to the job's batch size, as the one-device engine does (no
    new compiled shape): stage 0 hands the next stage the padded batch whole (the shape its receive expects), and the
    last stage reports the batch's own rows, those of the unpadded pipeline. (On the CPU the compiled flag is set
    by hand and the layers stay eager.)"""
    import queue

    from poc.engine.compute import Stage, V2Compute
    from poc.parallel.build import Part, build

    q, sent = queue.Queue(), []

    def send(t: torch.Tensor) -> None:
        sent.append(tuple(t.shape))
        q.put(t.clone())

    parts = []
    for s in range(2):
        model, cfg = build(v2_checkpoint("qwen3"), torch.float32, "cpu", Part(stage=s, n_stages=2))
        io = Stage(first=s == 0, last=s == 1, recv=lambda shape, dtype: q.get(), send=send)
        parts.append(V2Compute(model, cfg, torch.float32, torch.device("cpu"), "qwen3", stage=io))

    def run(pad_to: int | None) -> torch.Tensor:
        handle = None
        for c in parts:
            c.compiled = pad_to is not None  # what compile=True sets (the pad applies to a compiled shape only)
            handle = c.launch(c.prepare(BH, PK, [0, 1, 2], SEQ, K), pad_to=pad_to) or handle
        return handle.wait()

    plain, padded = run(None), run(4)
    assert sent == [(3, SEQ, cfg.dim), (4, SEQ, cfg.dim)] and padded.shape == plain.shape == (3, K)
    torch.testing.assert_close(padded, plain, atol=1e-6, rtol=1e-5)  # another batch size: another GEMM blocking


def cut(whole: dict, name: str, plan: dict, cfg) -> torch.Tensor:
    """Tensor `name` of a part, cut from the whole model's state dict by the plan (a fused qkv / gate_up: the cut of
    each of its pieces, concatenated)."""
    hd = cfg.head_dim
    kv = cfg.n_kv_heads * hd
    pieces = {"qkv_proj": [("q_proj", cfg.n_heads * hd), ("k_proj", kv), ("v_proj", kv)],
              "gate_up_proj": [("gate_proj", cfg.ffn_dim), ("up_proj", cfg.ffn_dim)]}
    for fused, parts in pieces.items():
        if f".{fused}." in name:
            split = whole[name].split([n for _, n in parts])
            return torch.cat([_narrow(t, plan.get(name.replace(fused, p))) for t, (p, _) in zip(split, parts)])
    return _narrow(whole[name], plan.get(name))


def _narrow(t: torch.Tensor, part) -> torch.Tensor:
    return t if part is None else t.narrow(part[0], part[1], part[2] - part[1])


@pytest.mark.parametrize("source", ["checkpoint", "preset", "v1"])
def test_a_rank_part_is_the_whole_model_cut(source):
    """build() of a rank's part (stage s of 2, tp rank r of 2), from each source, holds exactly the whole model's
    tensors at its place: its layers, and its rows / columns of the sliced ones (the v1 q/k rows permuted inside each
    head before the cut), bit for bit."""
    from poc.model.random_init import v1_config
    from poc.model.source import V1Weights
    from poc.parallel.build import Part, build
    from poc.protocol.v1 import V1Params

    p = V1Params(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=96, ffn_dim_multiplier=None, multiple_of=32,
                 norm_eps=1e-5, rope_theta=1e4, use_scaled_rope=False, seq_len=8)
    src, dtype = {"checkpoint": (v2_checkpoint("qwen3"), torch.float32), "preset": ("random:tiny", torch.float32),
                  "v1": (V1Weights(p, BH), torch.float16)}[source]
    whole, cfg = build(src, dtype, "cpu")
    if source == "v1":
        assert cfg == v1_config(p)
    everything = whole.state_dict()
    for stage in range(2):
        for r in range(2):
            part, _ = build(src, dtype, "cpu", Part(stage, 2, r, 2))
            with torch.device("meta"):
                plan = apply_tp(keep_stage(Transformer(cfg, with_head=source == "v1"), stage, 2), r, 2, None)
            held = part.state_dict()
            assert {k.split(".")[1] for k in held if k.startswith("layers.")} == {str(stage)}
            for name, t in held.items():
                want = cut(everything, name, plan, cfg)
                assert t.dtype == want.dtype and torch.equal(t, want), name
            assert len(plan) >= 7  # q/k/v/o, gate/up/down of its layer (and q/k/v biases): something was cut


def test_tp_rank_peak_memory_is_about_its_shard(tmp_path):
    """A tp=2 rank loading a ~60 MB float32 checkpoint: peak RSS above baseline < 0.65x of the whole weights."""
    spec = importlib.util.spec_from_file_location("measure_load_rss", ROOT / "scripts" / "measure_load_rss.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.write_checkpoint(tmp_path / "ck", "qwen3-0.6b", 50, "float32")
    child = r"""
import json, sys
from pathlib import Path
import torch
from poc.model.config import PRESETS
from poc.model.transformer import Transformer
from poc.model.weights import index_checkpoint
from poc.parallel.build import Part, build

def kb(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))

Transformer(PRESETS["tiny"])  # page in the code a load runs
base = kb("VmRSS:") * 1024
Path("/proc/self/clear_refs").write_text("5")
model, cfg = build(sys.argv[1], torch.float32, "cpu", Part(tp_rank=0, tp_size=2))
peak = kb("VmHWM:") * 1024 - base
mine = sum(t.numel() * t.element_size() for t in model.state_dict().values())
whole = sum(r.nbytes for n, r in index_checkpoint(sys.argv[1]).items() if n.startswith("layers."))
print(json.dumps({"peak": peak, "mine": mine, "whole": whole}))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "ck")], capture_output=True, text=True,
                         env=env, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert 40e6 < res["whole"] < 80e6 and 0.45 < res["mine"] / res["whole"] < 0.55, res
    assert res["peak"] / res["whole"] < 0.65, res
