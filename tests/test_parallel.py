"""Multi-device execution on CPU/gloo: tp=2, pp=2 and 2 replicas against the single-process float32 engine.

The rank processes start once per layout (module fixtures); every parallel check uses batches of >= 2.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from poc.engine.base import Busy
from poc.engine.engine import Engine
from poc.engine.jobs import Limits, V1Job, V2Job
from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.model.transformer import Transformer
from poc.model.weights import index_checkpoint, iter_state_dict
from poc.parallel.engine import DistEngine, RankFailure, make_engine, world_for
from poc.parallel.layout import Layout, NonceStream, stage_layers
from poc.parallel.pp import keep_stage
from poc.parallel.tp import apply_tp
from poc.protocol import v1, v2

from .golden import ROOT, V1_GOLDEN as G1, v2_checkpoint

BH, PK = G1["block_hash"], G1["public_key"]
NONCES = list(range(10))  # batches of 4, 4, 2
SEQ, K = 16, 12
V1_SETS = ["A_gqa_plain_rope", "B_mha_scaled_rope"]
LAYOUTS = {"tp2": dict(tp=2, pp=1, world=2), "pp2": dict(tp=1, pp=2, world=2), "rep2": dict(tp=1, pp=1, world=2)}


def v1_params(name: str) -> v1.V1Params:
    return v1.V1Params.from_json(G1["sets"][name]["params"])


# --- the single-process reference ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference():
    """float32 vectors of the single-process Engine, per checkpoint."""
    out = {}
    for name in ("qwen3", "llama"):
        e = Engine("cpu", model_dir=str(v2_checkpoint(name)), dtype="float32")
        e.load()
        out[name] = np.concatenate([e.v2.vectors(e.v2.prepare(BH, PK, NONCES[i:i + 4], SEQ, K)).numpy()
                                    for i in range(0, len(NONCES), 4)])
        e.close()
    return out


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
    """Tiny Qwen3-MoE checkpoints (tests/test_moe.py) and their single-process float32 vectors: name -> (dir, vectors).
    One has a dense layer among sparse ones (mlp_only_layers), one dense layers by decoder_sparse_step, one FP8."""
    pytest.importorskip("transformers")
    from tests.test_fp8 import write_fp8_and_twin
    from tests.test_moe import CASES, make_hf_moe

    out = {}
    for name, case in (("moe-mlp-only", "mlp-only-layer-norm-topk"), ("moe-sparse-step", "sparse-step-2-no-norm"),
                       ("moe-fp8", "mlp-only-layer-norm-topk")):
        d = tmp_path_factory.mktemp("moe") / name
        if name == "moe-fp8":
            make_hf_moe(d.parent / "src", **dict(CASES[case], intermediate_size=320))
            write_fp8_and_twin(d.parent / "src", d, d.parent / "twin")
        else:
            make_hf_moe(d, **CASES[case])
        e = Engine("cpu", model_dir=str(d), dtype="float32")
        e.load()
        out[name] = (d, np.concatenate([e.v2.vectors(e.v2.prepare(BH, PK, NONCES[i:i + 4], SEQ, K)).numpy()
                                        for i in range(0, len(NONCES), 4)]))
        e.close()
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def dist_engine(request):
    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", timeout=60, **LAYOUTS[request.param])
    e.load()
    e.label = request.param
    yield e
    e.close()


def use_model(e: DistEngine, name: str) -> None:
    """Load another checkpoint into the running ranks (load() again)."""
    if e.v2 is None or e.v2.name != name:
        e.model_dir = str(v2_checkpoint(name))
        e.load()


# --- layout, stages, nonce streams --------------------------------------------------------------------------------

def test_layout_ranks_and_groups():
    L = Layout(8, tp=2, pp=2)
    assert L.replicas == 2 and L.group_size == 4
    assert [L.coords(r) for r in range(8)] == [(r // 4, (r // 2) % 2, r % 2) for r in range(8)]
    assert all(L.rank(*L.coords(r)) == r for r in range(8))
    assert (L.leader(1), L.reporter(1)) == (4, 6)
    assert L.replica_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert L.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert L.pp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_uneven_splits_are_refused_naming_the_numbers():
    with pytest.raises(InputError, match=r"6 devices .* tp=4 x pp=1 = 4"):
        Layout(6, tp=4)
    with pytest.raises(InputError) as e:
        Layout(6, tp=3, pp=2).check_model(n_heads=4, n_kv_heads=2, ffn_dim=128, n_layers=1)
    msg = e.value.message
    for part in ("n_heads=4", "n_kv_heads=2", "ffn_dim=128", "tp=3", "n_layers=1", "pp=2"):
        assert part in msg, (part, msg)
    Layout(4, tp=2, pp=2).check_config(ModelConfig.from_hf(v2_checkpoint("qwen3")))  # 4 heads, 2 kv, 2 layers


def test_stage_layers_are_balanced_and_cover():
    assert stage_layers(28, 3) == [range(0, 10), range(10, 19), range(19, 28)]
    assert stage_layers(2, 2) == [range(0, 1), range(1, 2)]
    for n, s in [(1, 1), (7, 7), (36, 4), (61, 8)]:
        st = stage_layers(n, s)
        assert [i for r in st for i in r] == list(range(n))
        assert max(map(len, st)) - min(map(len, st)) <= 1
    with pytest.raises(InputError, match="n_layers=2 .* 3"):
        stage_layers(2, 3)


def test_nonce_streams_split_disjoint_and_complete():
    s = NonceStream(5, 3)
    parts = s.split(4)
    head = [n for _, n in zip(range(400), s)]
    got = sorted(n for p in parts for _, n in zip(range(100), p))
    assert got == head
    # pow's lattice: part r is group group_id + r*n_groups of n_groups*R
    node_id, node_count, group_id, n_groups, R = 2, 5, 1, 3, 2
    pow_stream = NonceStream(node_id + group_id * node_count, n_groups * node_count)
    for r, p in enumerate(pow_stream.split(R)):
        want = v1.node_nonces(node_id, node_count, group_id + r * n_groups, n_groups * R)
        assert [n for _, n in zip(range(20), p)] == [n for _, n in zip(range(20), want)]
    # a finite /pooled range
    rng = NonceStream(10, 2, end=40)
    assert list(rng) == list(v1.range_nonces(10, 40, 0, 2))
    assert sorted(n for p in rng.split(3) for n in p) == list(rng)


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
from poc.parallel.shard import load_shard

def kb(field):
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith(field))

Transformer(PRESETS["tiny"])  # page in the code a load runs
base = kb("VmRSS:") * 1024
Path("/proc/self/clear_refs").write_text("5")
model, cfg = load_shard(sys.argv[1], torch.float32, "cpu", tp_rank=0, tp_size=2)
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


# --- the rank processes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["qwen3", "llama"])
def test_v2_matches_the_single_process_engine(dist_engine, reference, model):
    use_model(dist_engine, model)
    vec = dist_engine.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4)
    l2 = np.linalg.norm(vec - reference[model], axis=1)
    assert l2.max() < 1e-5, (dist_engine.label, model, l2.max())
    arts, dropped = dist_engine.v2_artifacts(BH, PK, NONCES, SEQ, K, batch_size=4)
    assert [a["nonce"] for a in arts] == NONCES and not dropped
    dec = np.stack([v2.decode(a["vector_b64"]) for a in arts])
    assert np.abs(dec - reference[model]).max() < 1e-3  # fp16 encoding of the same vectors


@pytest.mark.parametrize("spec", ["random:tiny", "random:tiny-moe:fp8"])
def test_random_weight_models_on_the_ranks(dist_engine, spec):
    """--model random:<preset>[:fp8] (benchmarks): each rank makes only its own shard of random weights."""
    dist_engine.model_dir = spec
    try:
        dist_engine.load()
        arts, dropped = dist_engine.v2_artifacts(BH, PK, NONCES, SEQ, K, batch_size=4)
        assert [a["nonce"] for a in arts] == NONCES and not dropped
        dec = np.stack([v2.decode(a["vector_b64"]) for a in arts])
        assert np.isfinite(dec).all() and np.allclose(np.linalg.norm(dec, axis=1), 1, atol=2e-3)
        assert len({a["vector_b64"] for a in arts}) == len(NONCES)
    finally:
        dist_engine.model_dir = None
        dist_engine.v2 = None


def test_random_spec_errors():
    from poc.errors import InputError
    from poc.model.random_weights import random_spec

    assert random_spec("/models/qwen") is None and random_spec(None) is None
    assert random_spec("random:tiny-moe:fp8")[1] is True
    for bad in ("random:nope", "random:tiny:int4"):
        with pytest.raises(InputError, match="random:<preset>"):
            random_spec(bad)


@pytest.mark.parametrize("name", ["moe-mlp-only", "moe-sparse-step", "moe-fp8"])
def test_v2_moe_matches_the_single_process_engine(dist_engine, moe_reference, name):
    """Qwen3-MoE (and its FP8 form) through the rank processes: tp=2 is attention by heads + the experts split 2
    ways by expert, pp=2 two stages of whole layers, rep2 two replicas; v2 vectors within L2 1e-5 of one process."""
    d, ref = moe_reference[name]
    dist_engine.model_dir = str(d)
    dist_engine.load()
    assert dist_engine.v2.name == name and dist_engine.v2.cfg.n_experts in (4, 8)
    vec = dist_engine.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4)
    l2 = np.linalg.norm(vec - ref, axis=1)
    assert l2.max() < 1e-5, (dist_engine.label, name, l2.max())
    arts, dropped = dist_engine.v2_artifacts(BH, PK, NONCES, SEQ, K, batch_size=4)
    assert [a["nonce"] for a in arts] == NONCES and not dropped
    assert np.abs(np.stack([v2.decode(a["vector_b64"]) for a in arts]) - ref).max() < 1e-3


@pytest.mark.parametrize("name", V1_SETS)
def test_v1_matches_golden_and_single_process(dist_engine, name):
    run = G1["sets"][name]["runs"]["float32"]
    nonces = run["nonces"][:10]
    got = dist_engine.v1_distances(v1_params(name), BH, PK, nonces, "float32", batch_size=4)
    single = Engine("cpu").v1_distances(v1_params(name), BH, PK, nonces, "float32", batch_size=4)
    assert np.abs(got - single).max() < 1e-6, (dist_engine.label, name)
    assert np.abs(got - np.array(run["dist"][:10])).max() < 1e-5


def test_v1_params_that_do_not_split_are_refused(dist_engine):
    base = G1["sets"]["A_gqa_plain_rope"]["params"]
    if dist_engine.layout.tp == 2:
        bad, msg = dict(base, n_kv_heads=1), "n_kv_heads=1 is not divisible by tp=2"
    elif dist_engine.layout.pp == 2:
        bad, msg = dict(base, n_layers=1), "n_layers=1 is fewer than pp=2"
    else:  # replicas split nothing: the same params run
        got = dist_engine.v1_distances(v1.V1Params.from_json(dict(base, n_kv_heads=1)), BH, PK, [0, 1], "float32")
        assert got.shape == (2,) and np.isfinite(got).all()
        return
    with pytest.raises(InputError, match=msg):
        dist_engine.v1_distances(v1.V1Params.from_json(bad), BH, PK, [0, 1], "float32")
    assert dist_engine.state == "ready"


def test_job_stream_limits_and_replicas(dist_engine):
    """run(): max_nonces exact; two replicas never repeat a nonce and together cover the stream's prefix."""
    use_model(dist_engine, "qwen3")
    out = []
    job = V2Job(BH, PK, 1, SEQ, K, v1.node_nonces(1, 3, 0, 1), 3, limits=Limits(max_nonces=20, max_duration=None))
    s = dist_engine.run(job, out.append, threading.Event())
    got = [n for b in out for n in b.nonces]
    assert s.reason == "max_nonces" and s.computed == 20 and len(got) == 20 == len(set(got))
    assert sorted(got) == [1 + 3 * k for k in range(20)]
    assert [b.index for b in out] == list(range(1, len(out) + 1)) and all(len(b.artifacts) == len(b.nonces)
                                                                            for b in out)
    if dist_engine.layout.replicas == 2:
        seen = []
        job = V1Job(BH, PK, 1, v1_params("A_gqa_plain_rope"), 1.5, v1.worker_nonces(0, 0, 1), 2, "float32",
                    Limits(max_nonces=24, max_duration=None))
        dist_engine._run(job, lambda seq, b, p: seen.append((p["replica"], b.nonces)), threading.Event())
        assert {r for r, _ in seen} == {0, 1}  # both replicas worked
        flat = [n for _, ns in seen for n in ns]
        assert sorted(flat) == list(range(24))
        by_replica = [{n for r, ns in seen if r == k for n in ns} for k in (0, 1)]
        assert not by_replica[0] & by_replica[1]


def test_stop_and_busy(dist_engine):
    stop, out = threading.Event(), []
    started = threading.Event()

    def emit(b):
        out.append(b)
        started.set()
        if b.index == 2:
            stop.set()

    job = V2Job(BH, PK, 1, SEQ, K, v1.worker_nonces(0, 0, 1), 2, limits=Limits(max_nonces=None, max_duration=None))
    res = {}
    t = threading.Thread(target=lambda: res.update(s=dist_engine.run(job, emit, stop)))
    t.start()
    assert started.wait(30)
    with pytest.raises(Busy):
        dist_engine.v2_artifacts(BH, PK, [0, 1], SEQ, K)
    t.join(30)
    s = res["s"]
    got = [n for b in out for n in b.nonces]
    assert s.reason == "stopped" and s.computed == len(got) == len(set(got)) and s.batches >= 2
    assert dist_engine.state == "ready"


def test_a_job_the_ranks_cannot_run_is_refused_before_it_reaches_them(dist_engine):
    """A v2 job with k_dim past the hidden size (run() called directly, no server schema in front): one clear
    InputError, as the single-device engine raises, and the ranks stay ready for the next job."""
    use_model(dist_engine, "qwen3")
    for bad in (dict(k_dim=10_000), dict(k_dim=0), dict(seq_len=0)):
        job = V2Job(BH, PK, 1, bad.get("seq_len", SEQ), bad.get("k_dim", K), iter(range(4)), 2,
                    limits=Limits(max_nonces=None, max_duration=None))
        with pytest.raises(InputError, match="k_dim|seq_len"):
            dist_engine.run(job, lambda b: None, threading.Event())
        assert dist_engine.state == "ready" and dist_engine.broken_reason is None
    arts, _ = dist_engine.v2_artifacts(BH, PK, [3, 4, 5], SEQ, K, batch_size=2)
    assert [a["nonce"] for a in arts] == [3, 4, 5]


def test_max_duration_ends_without_waiting_for_a_result(dist_engine):
    """max_duration shorter than one batch: the deadline is noticed while the first batches run, so the batches
    dealt ahead and not yet launched are dropped; each replica computes at most the one it had launched (before,
    the end went out only when a result arrived, after DEPTH (+ pp - 1) batches per replica had been launched)."""
    use_model(dist_engine, "qwen3")
    bs, L = 8, dist_engine.layout
    job = V2Job(BH, PK, 1, 4096, K, v1.node_nonces(0, 1), bs, limits=Limits(max_nonces=None, max_duration=0.2))
    out = []
    s = dist_engine.run(job, out.append, threading.Event())  # a batch of 8 x 4096 positions: ~0.5 s per rank
    assert s.reason == "max_duration" and s.computed <= bs * L.replicas, (dist_engine.label, s)
    assert s.computed == sum(len(b.nonces) for b in out) and dist_engine.state == "ready"


# --- a failing rank -----------------------------------------------------------------------------------------------

def test_killed_rank_breaks_the_engine_and_restart_recovers(reference):
    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", tp=2, world=2, timeout=30)
    try:
        e.load()
        pids = e.pids
        first = threading.Event()
        job = V2Job(BH, PK, 1, 64, K, v1.worker_nonces(0, 0, 1), 2, limits=Limits(max_nonces=None, max_duration=None))
        res = {}

        def run():
            try:
                e.run(job, lambda b: first.set(), threading.Event())
            except BaseException as err:  # noqa: BLE001
                res["err"] = err
            res["t"] = time.monotonic()

        t = threading.Thread(target=run)
        t.start()
        assert first.wait(90)
        t_kill = time.monotonic()
        os.kill(pids[1], signal.SIGKILL)
        t.join(60)  # bounds here leave room for a loaded 2-core CI machine; a hang would be the 300 s gloo timeout
        assert not t.is_alive(), "run() hung after a rank was killed"
        assert isinstance(res.get("err"), RankFailure) and res["t"] - t_kill < 45, res
        assert e.state == "broken" and "rank 1" in e.broken_reason
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert all(not _alive(p) for p in pids)  # the surviving rank was stopped too
        with pytest.raises(RankFailure):
            e.v2_artifacts(BH, PK, [0, 1], SEQ, K)

        e.restart()
        assert e.state == "ready" and e.broken_reason is None and set(e.pids).isdisjoint(pids)
        vec = e.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4)
        assert np.linalg.norm(vec - reference["qwen3"], axis=1).max() < 1e-5

        os.kill(e.pids[0], signal.SIGKILL)  # idle: /health must still see it
        deadline = time.monotonic() + 45
        while e.state != "broken" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert e.state == "broken" and "rank 0" in e.broken_reason
    finally:
        e.close()


def test_collective_timeout_breaks_the_engine():
    """A stopped (not dead) rank: its peer's all-reduce times out, the engine breaks and nothing hangs."""
    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", tp=2, world=2, timeout=3)
    try:
        e.load()
        first = threading.Event()
        job = V2Job(BH, PK, 1, SEQ, K, v1.worker_nonces(0, 0, 1), 2, limits=Limits(max_nonces=None, max_duration=None))

        def emit(b):
            if not first.is_set():
                first.set()
                os.kill(e.pids[1], signal.SIGSTOP)

        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="rank 0 failed"):
            e.run(job, emit, threading.Event())
        assert time.monotonic() - t0 < 20 and e.state == "broken"
        assert all(not _alive(p) for p in e.pids)
    finally:
        e.close()


def test_emit_error_leaves_the_ranks_in_step(dist_engine):
    """An exception in emit ends the job on the ranks too: the next job runs normally."""
    def emit(b):
        raise KeyError("consumer failed")

    job = V2Job(BH, PK, 1, SEQ, K, v1.worker_nonces(0, 0, 1), 2, limits=Limits(max_nonces=None, max_duration=None))
    with pytest.raises(KeyError):
        dist_engine.run(job, emit, threading.Event())
    assert dist_engine.state == "ready"
    arts, _ = dist_engine.v2_artifacts(BH, PK, [3, 4, 5], SEQ, K, batch_size=2)
    assert [a["nonce"] for a in arts] == [3, 4, 5]


async def test_server_with_a_killed_rank(aiohttp_client, monkeypatch):
    """Through the server: the open stream ends with an error line, /health says broken, restart() recovers."""
    import asyncio

    from poc.server import app as app_mod
    from poc.server.config import ServerConfig
    from poc.server.context import engine_key

    monkeypatch.setattr(app_mod, "Engine", lambda device, model_dir, dtype, **kw: DistEngine(
        device, model_dir, dtype, tp=2, world=2, timeout=30))
    cfg = ServerConfig(device="cpu", dtype="float32", model=str(v2_checkpoint("qwen3")), progress_interval=0.2,
                       rate_log_interval=0.5, shutdown_flush_seconds=1.0)
    client = await aiohttp_client(app_mod.create_app(cfg))
    engine = client.server.app[engine_key]

    async def health() -> tuple[int, dict]:
        r = await client.get("/health")
        return r.status, await r.json()

    async def until(state: str) -> dict:
        for _ in range(2400):  # up to ~2 min: two rank processes import torch on a loaded 2-core CI machine
            code, h = await health()
            if h["state"] == state:
                return h
            await asyncio.sleep(0.05)
        raise AssertionError(h)

    await until("ready")
    req = {"block_hash": BH, "block_height": 7, "public_key": PK, "node_id": 0, "node_count": 1, "batch_size": 2,
           "max_nonces": 100000, "params": {"model": "qwen3", "seq_len": 64, "k_dim": K}}

    async def stream(kill: bool) -> list[dict]:
        lines = []
        r = await client.post("/generate", json=req)
        assert r.status == 200
        async for raw in r.content:
            lines.append(json.loads(raw))
            if kill and len(lines) == 1:
                os.kill(engine.pids[1], signal.SIGKILL)
        return lines

    lines = await asyncio.wait_for(stream(kill=True), 90)  # bounded: no hang, with room for a loaded CI machine
    errors = [x for x in lines if "error_type" in x]  # a progress line may land between the error and done
    assert len(errors) == 1 and errors[0]["error_type"] == "RankFailure" and "rank 1" in errors[0]["error"], lines[-4:]
    assert lines[-1]["status"] == "done" and lines[-1]["reason"] == "error"
    code, h = await health()
    assert code == 503 and h["status"] == "broken" and "rank 1" in h["reason"]
    await asyncio.to_thread(engine.restart)
    await until("ready")
    req["max_nonces"] = 4
    lines = await asyncio.wait_for(stream(kill=False), 90)
    assert lines[-1]["status"] == "done" and lines[-1]["reason"] == "max_nonces", lines


def _alive(pid: int) -> bool:
    """Running (a killed process not yet reaped, a zombie, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_make_engine_picks_the_engine():
    assert isinstance(make_engine("cpu"), Engine)
    e = make_engine("cpu", tp=2)
    assert isinstance(e, DistEngine) and e.layout == Layout(2, 2, 1)
    assert world_for(torch.device("cpu"), 1, 2, replicas=3) == 6
    e.close()  # never started: nothing to stop


def test_tp_reduce_setting(monkeypatch):
    from poc.parallel.tp import reduce_in_model_dtype

    monkeypatch.delenv("POC_TP_REDUCE", raising=False)
    assert reduce_in_model_dtype() is False  # default: fp32 partial sums, rounded once
    monkeypatch.setenv("POC_TP_REDUCE", "model")
    assert reduce_in_model_dtype() is True
    monkeypatch.setenv("POC_TP_REDUCE", "bf16")
    with pytest.raises(ValueError, match="POC_TP_REDUCE must be fp32 or model"):
        reduce_in_model_dtype()


def test_rank_profile_writes_a_breakdown_per_rank(tmp_path, monkeypatch):
    """POC_RANK_PROFILE=DIR: every rank profiles batches 4-7 of its first job and writes DIR/rank<N>.json (on the
    CPU the profiler sees CPU ops, all of kind "other"; on CUDA the kernels by kind, NCCL included)."""
    from poc.profiling import KINDS

    monkeypatch.setenv("POC_RANK_PROFILE", str(tmp_path))
    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", tp=2, world=2, timeout=60)
    try:
        e.load()
        arts, dropped = e.v2_artifacts(BH, PK, list(range(20)), SEQ, K, batch_size=2)  # 10 batches
        assert len(arts) == 20 and not dropped
    finally:
        e.close()
    for r in (0, 1):
        out = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert out["batches"] == 4 and out["wall_s"] > 0
        assert set(out["by_kind_s"]) == set(KINDS) and out["gpu_kernel_s"] > 0
        assert out["top_kernels"] and all(t > 0 for t, _ in out["top_kernels"])


def test_stage_timing_logs_forward_idle_and_host_time(monkeypatch, caplog):
    """POC_STAGE_TIMING's bookkeeping (CUDA events on the GPU; here a stand-in event on the host clock): one line
    per batch with its forward time, the stream's idle time before it and the host time by step."""
    import collections
    import logging

    from poc.parallel import ranks

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self):
            self.t = time.perf_counter()

        def query(self):
            return True

        def elapsed_time(self, other):
            return 1e3 * (other.t - self.t)

    monkeypatch.setattr(torch.cuda, "Event", Event)
    r = ranks.Rank.__new__(ranks.Rank)
    r.stage, r._timing, r._prev_end, r._host_s = 1, collections.deque(), None, {}
    with caplog.at_level(logging.WARNING, logger="poc.ranks"):
        for _ in range(2):
            t0 = time.perf_counter()
            time.sleep(0.01)
            r._host("command", t0)
            r._mark(0)
            time.sleep(0.02)
            r._mark(1)
            time.sleep(0.005)
        r._log_timing()
    lines = [m for m in caplog.messages if m.startswith("stage 1: forward")]
    assert len(lines) == 2 and not r._timing
    fwd = [float(m.split("forward ")[1].split(" ms")[0]) for m in lines]
    assert all(15 < f < 500 for f in fwd)
    assert "idle before it nan ms" in lines[0] and "'command'" in lines[0]
    idle = float(lines[1].split("idle before it ")[1].split(" ms")[0])
    assert 10 < idle < 500  # the 5 ms after the first forward plus the 10 ms host step before the second


def test_rank_log_lines_are_one_line_and_defused(capsys):
    """A rank's log goes to the same file the PyWorker reads: no "Error:"/"Traceback" on a handled event."""
    import logging

    from poc.parallel import ranks

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        ranks._setup_logging(1, "INFO")
        try:
            raise RuntimeError("boom")
        except RuntimeError:
            logging.getLogger("poc.rank").warning("batch failed: RuntimeError: boom", exc_info=True,
                                                  extra={"every_rank": True})
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and " rank1 poc.rank: batch failed" in err[0], err
    assert "Error:" not in err[0] and "Traceback" not in err[0] and "boom" in err[0]


class _SimulatedRanks:
    """In-process stand-in for the rank processes of DistEngine: each replica builds its model for `build_s`
    after the job arrives, then computes its queued batches one by one (`batch_s` each); an "end" with drop
    cancels what is still queued. Speaks the engine's messages: started, result, done. `fail_at=(replica, n)`:
    that replica fails on its n-th batch (1-based) as a rank that raised does: the engine breaks (engine._fail:
    every rank killed, "failed" queued). `sent` lists the nonces of every result the replicas reported."""

    def __init__(self, layout: Layout, build_s: float, batch_s: float, engine: DistEngine | None = None,
                 fail_at: tuple[int, int] | None = None):
        import queue

        self.inbox: queue.Queue = queue.Queue()
        self.layout, self.build_s, self.batch_s = layout, build_s, batch_s
        self.engine, self.fail_at = engine, fail_at
        self.queues = {r: queue.Queue() for r in range(layout.replicas)}
        self.replica_of = {layout.leader(r): r for r in range(layout.replicas)}
        self.closing, self.lock, self.sent = False, threading.Lock(), []

    def send(self, rank: int, msg) -> None:
        r = self.replica_of[rank]
        if msg[0] == "job":
            threading.Thread(target=self._replica, args=(r, msg[1]), daemon=True).start()
        else:
            self.queues[r].put(msg)

    def kill(self) -> None:  # engine._fail: what a killed rank had not reported never arrives
        self.closing = True

    def _put(self, msg) -> bool:
        with self.lock:  # a message put before the kill is in the inbox ahead of "failed"
            if self.closing:
                return False
            self.inbox.put(msg)
            if msg[0] == "result":
                self.sent.append(msg[4]["nonces"])
            return True

    def _replica(self, r: int, jid: int) -> None:
        time.sleep(self.build_s)
        self._put(("started", jid, r))
        pending, n = [], 0
        while True:
            msgs = [self.queues[r].get()] if not pending else []
            while not self.queues[r].empty():
                msgs.append(self.queues[r].get())
            for m in msgs:
                if m[0] == "end" and m[2]:
                    pending = [p for p in pending if p[0] != "batch"]
                pending.append(m)
            m = pending.pop(0)
            if m[0] == "end":
                self._put(("done", jid, r))
                return
            time.sleep(self.batch_s)
            n += 1
            if self.fail_at == (r, n):
                with self.lock:
                    self.engine._fail(self, f"rank {self.layout.leader(r)} failed: RuntimeError: boom")
                return
            _, _, seq, nonces = m
            if not self._put(("result", jid, r, seq, {"nonces": nonces, "dist": np.zeros(len(nonces))},
                              self.batch_s)):
                return


def _simulated(build_s: float = 0.0, batch_s: float = 0.02, **kw) -> DistEngine:
    e = DistEngine("cpu", world=2, tp=1, timeout=5)  # two replicas, simulated in this process
    e._ranks = _SimulatedRanks(e.layout, build_s, batch_s, engine=e, **kw)
    return e


def _v1_job(nonces, batch_size: int = 4, max_nonces: int | None = None) -> V1Job:
    return V1Job(BH, PK, 1, v1_params("A_gqa_plain_rope"), 1.5, nonces, batch_size, "float32",
                 Limits(max_nonces=max_nonces, max_duration=None))


def test_max_duration_counts_from_the_built_model_not_the_job_start():
    """A v1 model that takes longer to build than max_duration (the ranks build it when the job arrives, 0.6 s
    here) still computes for max_duration: the clock starts at the replicas' "started", as one device starts it
    after its build; before, the deadline passed during the build and every dealt batch was dropped."""
    e = DistEngine("cpu", world=2, tp=1, timeout=30)  # two replicas, simulated in this process
    e._ranks = _SimulatedRanks(e.layout, build_s=0.6, batch_s=0.05)
    job = V1Job(BH, PK, 1, v1_params("A_gqa_plain_rope"), 1.5, v1.worker_nonces(0, 0, 1), 4, "float32",
                Limits(max_nonces=None, max_duration=0.3))
    out = []
    t0 = time.monotonic()
    s = e.run(job, out.append, threading.Event())
    took = time.monotonic() - t0
    got = [n for b in out for n in b.nonces]
    assert s.reason == "max_duration" and s.computed == len(got) == len(set(got)), s
    assert s.computed >= 2 * 4 * 3, s  # >= 3 batches a replica in 0.3 s of 0.05 s batches
    assert 0.6 + 0.3 <= took < 0.6 + 0.3 + 2.0, took
    assert all(b.elapsed < 0.6 for b in out), [b.elapsed for b in out]  # timed from the start of compute


def test_a_failing_replica_does_not_drop_the_results_the_other_one_sent():
    """Replica 1 fails on its 3rd batch while the consumer is slower than the replicas: every result a replica
    reported before the engine broke is emitted, then RankFailure (before, the failure overtook the results still
    queued: computed and reported nonces were never emitted)."""
    e = _simulated(fail_at=(1, 3))
    out = []

    def emit(b):
        time.sleep(0.05)
        out.append(b)

    with pytest.raises(RankFailure, match="boom"):
        e.run(_v1_job(v1.worker_nonces(0, 0, 1)), emit, threading.Event())
    got = [n for b in out for n in b.nonces]
    assert len(got) == len(set(got)) and sorted(got) == sorted(n for ns in e._ranks.sent for n in ns)
    assert e.state == "broken" and "boom" in e.broken_reason


def test_a_failing_nonce_iterator_still_emits_the_batches_launched():
    """The job's nonce iterator raises (a /pooled range that could not be fetched, say) while batches are
    computing: the batches the replicas launched are still emitted, as the single-device Engine emits the one in
    flight; the batches dealt but not launched are dropped; the error is raised and the engine stays ready."""
    e = _simulated(batch_s=0.05)

    def nonces():
        yield from range(16)  # the 4 batches dealt ahead (DEPTH 2 x 2 replicas), then the iterator fails
        raise ValueError("nonce source failed")

    out = []
    with pytest.raises(ValueError, match="nonce source failed"):
        e.run(_v1_job(nonces()), out.append, threading.Event())
    got = [n for b in out for n in b.nonces]
    sent = sorted(n for ns in e._ranks.sent for n in ns)
    assert len(sent) >= 8 and len(got) == len(set(got)) and sorted(got) == sent
    assert e.state == "ready" and e.broken_reason is None
    out = []
    s = e.run(_v1_job(iter(range(10))), out.append, threading.Event())  # the next job runs normally
    assert s.reason == "exhausted" and sorted(n for b in out for n in b.nonces) == list(range(10))


def test_stop_and_end_emit_every_launched_batch_exactly_once():
    """Two replicas finishing around a stop, the end of the nonces or max_nonces: every batch a replica reported
    is emitted exactly once, and the summary counts exactly those."""
    for job, stop_at in ((_v1_job(iter(range(37)), 3), None), (_v1_job(v1.worker_nonces(0, 0, 1), 3, 31), None),
                         (_v1_job(v1.worker_nonces(0, 0, 1), 3), 4)):
        e, stop, out = _simulated(batch_s=0.01), threading.Event(), []

        def emit(b):
            out.append(b)
            if b.index == stop_at:
                stop.set()

        s = e.run(job, emit, stop)
        time.sleep(0.05)  # a late result would be in the inbox by now
        got = [n for b in out for n in b.nonces]
        assert len(got) == len(set(got)) == s.computed and sorted(got) == sorted(n for ns in e._ranks.sent for n in ns)
        assert e._ranks.inbox.empty() and s.reason == ("stopped" if stop_at else "exhausted" if job.limits.max_nonces
                                                       is None else "max_nonces"), s
        if stop_at is None:
            assert sorted(got) == list(range(37 if job.limits.max_nonces is None else 31))


def test_an_emit_error_with_a_replica_that_does_not_end_breaks_the_engine():
    """emit raises and a replica does not end the job within the timeout: the engine is broken (/health says so)
    rather than "ready" with a replica still inside the old job (before, the next job was sent to it and failed
    with a confusing "command 'job' of job 2 inside job 1")."""
    e = _simulated(batch_s=0.02)
    e.timeout = 1.0
    rr = e._ranks
    slow = threading.Event()
    orig = rr._put

    def put(msg):  # replica 1 hangs in its batch after the first result
        if msg[0] == "result" and msg[2] == 1:
            if slow.is_set():
                time.sleep(30)
            slow.set()
        return orig(msg)

    rr._put = put

    def emit(b):
        if slow.is_set():
            raise KeyError("consumer failed")

    t0 = time.monotonic()
    with pytest.raises(KeyError):
        e.run(_v1_job(v1.worker_nonces(0, 0, 1)), emit, threading.Event())
    assert time.monotonic() - t0 < 5 and e.state == "broken" and "did not end job" in e.broken_reason


def test_results_still_in_the_sockets_reach_the_job_before_a_failure():
    """The reader reads one message per connection per round: when one rank's error arrives, results another
    replica had already sent are still in its socket. They go to the inbox ahead of the failure (before, the reader
    stopped at the failure and they were lost)."""
    from multiprocessing import Pipe

    from poc.parallel.engine import _Ranks

    class Proc:  # a rank process: killing it closes its end of the connection
        def __init__(self, end, pid):
            self.end, self.pid, self.returncode = end, pid, None

        def poll(self):
            return self.returncode

        def kill(self):
            self.end.close()
            self.returncode = -9

        def wait(self, timeout=None):
            return self.returncode

    e = DistEngine("cpu", world=2, tp=1, timeout=5)
    g = _Ranks(2)
    ends = [Pipe() for _ in range(2)]
    g.conns = {r: ends[r][0] for r in range(2)}
    g.procs = [Proc(ends[r][1], 1000 + r) for r in range(2)]
    e._ranks = g
    for seq in (1, 3, 5):
        ends[0][1].send(("result", 1, 0, seq, {"nonces": [seq]}, 0.1))
    ends[1][1].send(("error", 1, "RuntimeError: boom"))
    e._read(g)
    msgs = []
    while not g.inbox.empty():
        msgs.append(g.inbox.get())
    assert [m[3] for m in msgs if m[0] == "result"] == [1, 3, 5] and msgs[-1][0] == "failed", msgs
    assert e.state == "broken" and "boom" in e.broken_reason


def test_a_rank_failing_a_batch_reports_the_batch_it_had_in_flight(tmp_path, monkeypatch):
    """A replica's launch raises on a batch (injected in the rank processes: nonce 10**9 fails v2.input_seeds):
    the batch it had launched before is computed, so the rank reports it before its error, as the single-device
    Engine emits the batch in flight; the engine breaks with the rank's error and restart() recovers."""
    (tmp_path / "sitecustomize.py").write_text(
        "from poc.protocol import v2\n"
        "_seeds = v2.input_seeds\n"
        "def input_seeds(bh, pk, nonces, *a, **kw):\n"
        "    if 10**9 in nonces:\n"
        "        raise RuntimeError('injected failure')\n"
        "    return _seeds(bh, pk, nonces, *a, **kw)\n"
        "v2.input_seeds = input_seeds\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", tp=1, world=2, timeout=30)
    try:
        e.load()
        seen = []

        def nonces():
            yield from range(8)  # seqs 1, 3 to replica 0 and 2, 4 to replica 1 (DEPTH 2), then the bad batch
            while True:
                yield 10**9

        job = V2Job(BH, PK, 1, SEQ, K, nonces(), 2, limits=Limits(max_nonces=None, max_duration=None))
        with pytest.raises(RankFailure, match="injected failure"):
            with e.exclusive():
                e._run(job, lambda seq, b, p: seen.append((seq, p["replica"])), threading.Event())
        failed = int(e.broken_reason.split("rank ")[1].split()[0])
        assert {s for s, r in seen if r == failed} == ({1, 3} if failed == 0 else {2, 4}), (e.broken_reason, seen)
        e.restart()
        arts, _ = e.v2_artifacts(BH, PK, [3, 4, 5], SEQ, K, batch_size=2)
        assert [a["nonce"] for a in arts] == [3, 4, 5]
    finally:
        e.close()
