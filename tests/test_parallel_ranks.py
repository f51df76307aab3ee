"""Multi-device execution on CPU/gloo: tp=2, pp=2 and 2 replicas against the single-process float32 engine.

The rank processes start once per layout (module fixtures); every parallel check uses batches of >= 2.
"""

import json
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from poc.engine.base import Busy
from poc.engine.engine import Engine
from poc.engine.jobs import Limits, V1Job, V2Job
from poc.errors import InputError
from poc.engine.dist import DistEngine, RankFailure
from poc.engine.factory import make_engine, world_for
from poc.model.options import ModelOptions
from poc.engine.rankgroup import RankDiagnostics
from poc.parallel.layout import Layout
from poc.protocol import v1, v2

from .golden import V1_GOLDEN as G1, v2_checkpoint

BH, PK = G1["block_hash"], G1["public_key"]
NONCES = list(range(10))  # batches of 4, 4, 2
SEQ, K = 16, 12
V1_SETS = ["A_gqa_plain_rope", "B_mha_scaled_rope"]
LAYOUTS = {"tp2": dict(tp=2, pp=1, world=2), "pp2": dict(tp=1, pp=2, world=2), "rep2": dict(tp=1, pp=1, world=2)}

# the FP8 cases check the dequantise forward (their tiny shapes do not split on 128-blocks under tensor parallel),
# every engine here built so; the default W8A8 forward is tests/test_w8a8.py's
OPTIONS = ModelOptions(fp8="dequant")


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
    """Tiny Qwen3-MoE and MiniMax-M2 checkpoints (tests/test_moe.py, tests/test_minimax.py) and their single-process
    float32 vectors: name -> (dir, vectors). One Qwen3-MoE has a dense layer among sparse ones (mlp_only_layers), one
    dense layers by decoder_sparse_step, one FP8; the MiniMax-M2 ones (its q/k norm over all heads, partial RoPE, the
    sigmoid router with a bias) as transformers saves it and as MiniMax ships it (FP8, MTP layers)."""
    pytest.importorskip("transformers")
    from .checkpoints import MOE_CASES, make_hf_minimax, make_hf_moe, write_fp8_and_twin, write_minimax_fp8

    out = {}
    for name, case in (("moe-mlp-only", "mlp-only-layer-norm-topk"), ("moe-sparse-step", "sparse-step-2-no-norm"),
                       ("moe-fp8", "mlp-only-layer-norm-topk"), ("minimax", None), ("minimax-fp8", None)):
        d = tmp_path_factory.mktemp("moe") / name
        if name == "moe-fp8":
            make_hf_moe(d.parent / "src", **dict(MOE_CASES[case], intermediate_size=320))
            write_fp8_and_twin(d.parent / "src", d, d.parent / "twin")
        elif name == "minimax":
            make_hf_minimax(d)
        elif name == "minimax-fp8":
            make_hf_minimax(d.parent / "src")
            write_minimax_fp8(d.parent / "src", d, mtp_layers=2)
        else:
            make_hf_moe(d, **MOE_CASES[case])
        e = Engine("cpu", model_dir=str(d), dtype="float32", options=OPTIONS)
        e.load()
        out[name] = (d, np.concatenate([e.v2.vectors(e.v2.prepare(BH, PK, NONCES[i:i + 4], SEQ, K)).numpy()
                                        for i in range(0, len(NONCES), 4)]))
        e.close()
    return out


@pytest.fixture(scope="module", params=list(LAYOUTS))
def dist_engine(request):
    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", timeout=60, options=OPTIONS,
                   **LAYOUTS[request.param])
    e.load()
    e.label = request.param
    yield e
    e.close()


def use_model(e: DistEngine, name: str) -> None:
    """Load another checkpoint into the running ranks (load() again)."""
    if e.v2 is None or e.v2.name != name:
        e.model_dir = str(v2_checkpoint(name))
        e.load()


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


@pytest.mark.parametrize("spec", ["random:tiny", "random:tiny-moe", "random:tiny-moe:fp8"])
def test_random_weight_models_on_the_ranks(dist_engine, spec):
    """--model random:<preset>[:fp8] (benchmarks): each rank makes only its own shard of random weights, and they are
    the single process's weights: the same vectors (tp=2 with W8A8 adds its partial sums in another order, so a value
    on an FP8 rounding boundary may round the other way; another model would be L2 ~1.4 away)."""
    one = Engine("cpu", model_dir=spec, dtype="float32", options=OPTIONS)
    one.load()
    want = np.concatenate([one.v2.vectors(one.v2.prepare(BH, PK, NONCES[i:i + 4], SEQ, K)).numpy()
                           for i in range(0, len(NONCES), 4)])
    one.close()
    dist_engine.model_dir = spec
    try:
        dist_engine.load()
        arts, dropped = dist_engine.v2_artifacts(BH, PK, NONCES, SEQ, K, batch_size=4)
        assert [a["nonce"] for a in arts] == NONCES and not dropped
        dec = np.stack([v2.decode(a["vector_b64"]) for a in arts])
        assert np.isfinite(dec).all() and np.allclose(np.linalg.norm(dec, axis=1), 1, atol=2e-3)
        assert len({a["vector_b64"] for a in arts}) == len(NONCES)
        l2 = np.linalg.norm(dist_engine.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4) - want, axis=1)
        fp8_tp = spec.endswith(":fp8") and dist_engine.layout.tp > 1
        assert l2.max() < (0.05 if fp8_tp else 1e-5), (dist_engine.label, spec, l2.max())
    finally:
        dist_engine.model_dir = None
        dist_engine.v2 = None


def test_switch_model_replaces_the_checkpoint_on_the_ranks(dist_engine, reference, tmp_path):
    """POST /api/v1/inference/up's engine step: the live ranks take the next checkpoint; one that fails to load
    breaks the engine with no model (the ranks are gone), and the next switch starts fresh ranks."""
    dist_engine.preflight(str(v2_checkpoint("llama")))
    dist_engine.switch_model(str(v2_checkpoint("llama")))
    assert (dist_engine.state, dist_engine.v2.name) == ("ready", "llama")
    assert np.linalg.norm(dist_engine.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4) - reference["llama"],
                          axis=1).max() < 1e-5
    if dist_engine.label != "tp2":  # the failure path once: it restarts the ranks (seconds)
        return
    bad = tmp_path / "broken"
    bad.mkdir()
    (bad / "config.json").write_bytes((v2_checkpoint("llama") / "config.json").read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(RankFailure):
        dist_engine.switch_model(str(bad))
    assert dist_engine.state == "broken" and dist_engine.v2 is None
    assert "not a valid safetensors file" in dist_engine.broken_reason
    dist_engine.switch_model(str(v2_checkpoint("qwen3")))
    assert (dist_engine.state, dist_engine.v2.name) == ("ready", "qwen3")
    assert np.linalg.norm(dist_engine.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4) - reference["qwen3"],
                          axis=1).max() < 1e-5


def test_unload_model_leaves_fresh_ranks_that_hold_no_checkpoint(dist_engine, reference):
    """POST /api/v1/inference/down's engine step: the ranks exit (their memory goes with them) and fresh ones serve
    PoC v1 with no checkpoint; a switch then loads one into them."""
    if dist_engine.label != "pp2":  # once: it restarts the ranks (seconds)
        return
    old = dist_engine.pids
    dist_engine.unload_model()
    assert (dist_engine.state, dist_engine.v2, dist_engine.model_dir) == ("ready", None, None)
    assert len(dist_engine.pids) == 2 and not set(dist_engine.pids) & set(old)
    with pytest.raises(InputError, match="no PoC v2 model is loaded"):
        dist_engine.v2_artifacts(BH, PK, NONCES, SEQ, K, batch_size=4)
    run = G1["sets"]["A_gqa_plain_rope"]["runs"]["float32"]
    got = dist_engine.v1_distances(v1_params("A_gqa_plain_rope"), BH, PK, run["nonces"][:4], "float32", batch_size=2)
    assert np.abs(got - np.array(run["dist"][:4])).max() < 1e-5
    dist_engine.switch_model(str(v2_checkpoint("qwen3")))
    assert np.linalg.norm(dist_engine.v2_vectors(BH, PK, NONCES, SEQ, K, batch_size=4) - reference["qwen3"],
                          axis=1).max() < 1e-5


def test_model_sources_and_their_errors():
    """A --model parsed once (model/source.py): a checkpoint directory as given, a random preset (with :fp8 an FP8
    checkpoint's config), a preset that does not exist refused naming the presets."""
    from poc.errors import InputError
    from poc.model.source import Checkpoint, RandomPreset, parse

    assert parse("/models/qwen") == Checkpoint("/models/qwen") and parse("/models/qwen").name == "qwen"
    src = parse("random:tiny-moe:fp8")
    assert src == RandomPreset("tiny-moe", fp8=True) and str(src) == src.name == "random:tiny-moe:fp8"
    assert src.config().fp8_block == (128, 128) and parse("random:tiny-moe").config().fp8_block is None
    assert parse(src) is src
    for bad in ("random:nope", "random:tiny:int4"):
        with pytest.raises(InputError, match="random:<preset>"):
            parse(bad)


@pytest.mark.parametrize("name", ["moe-mlp-only", "moe-sparse-step", "moe-fp8", "minimax", "minimax-fp8"])
def test_v2_moe_matches_the_single_process_engine(dist_engine, moe_reference, name):
    """Qwen3-MoE and MiniMax-M2 (and their FP8 forms) through the rank processes: tp=2 is attention by heads (with
    MiniMax's q/k norm summing its squares over the ranks) + the experts split 2 ways by expert, pp=2 two stages of
    whole layers, rep2 two replicas; v2 vectors within L2 1e-5 of one process."""
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


def test_release_v1_drops_the_ranks_model_and_the_next_job_builds_it_again(dist_engine):
    """The server's idle release (server/v1cache.py) under its claim: every rank drops its v1 shard between jobs; a
    later job of the same params builds it again and computes the same distances."""
    p, nonces = v1_params("A_gqa_plain_rope"), list(range(4))
    first = dist_engine.v1_distances(p, BH, PK, nonces, "float32", batch_size=4)
    assert dist_engine.v1_held_bytes() > 0
    claim = dist_engine.try_claim("v1 cache release")
    try:
        assert dist_engine.release_v1() > 0
    finally:
        claim.release()
    assert dist_engine.v1_held_bytes() == 0 and dist_engine.release_v1() == 0
    again = dist_engine.v1_distances(p, BH, PK, nonces, "float32", batch_size=4)
    assert np.array_equal(first, again) and dist_engine.state == "ready"


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
    the end went out only when a result arrived, after every batch dealt ahead had been launched)."""
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

    from poc.engine import factory
    from poc.server import app as app_mod
    from poc.server.config import ServerConfig
    from poc.server.context import engine_key

    monkeypatch.setattr(factory, "Engine", lambda device, model_dir, dtype, **kw: DistEngine(
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


def test_tp_reduce_setting():
    """POC_TP_REDUCE is read by ServerConfig (a bad value refused at start) and reaches apply_tp as an argument, from
    a rank's Part: a sparse MoE block's partial sum leaves it in float32 for the fp32 all-reduce, or rounded to the
    model dtype with "model" (the all-reduce _expert_parallel installs)."""
    from poc.model.config import ModelConfig
    from poc.model.transformer import MoE, Transformer
    from poc.parallel.build import Part
    from poc.parallel.tp import reduce_in_model_dtype
    from poc.server.config import parse_args

    cfg = ModelConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, ffn_dim=96, vocab_size=128,
                      family="qwen3_moe", n_experts=4, n_experts_per_tok=2, moe_ffn_dim=32, decoder_sparse_step=1)
    for reduce, sum_dtype in (("fp32", torch.float32), ("model", None)):
        with torch.device("meta"):
            model = Transformer(cfg)
        Part(tp_rank=1, tp_size=2, group=object(), tp_reduce=reduce).shard(model)  # a stand-in group: never used
        moes = [b.mlp for b in model.layers.values() if isinstance(b.mlp, MoE)]
        assert moes and all(m.sum_dtype is sum_dtype and "forward" in vars(m) for m in moes), reduce

    assert reduce_in_model_dtype() is False  # default: fp32 partial sums, rounded once
    assert reduce_in_model_dtype("model") is True
    with pytest.raises(InputError, match="POC_TP_REDUCE must be fp32 or model, got 'bf16'"):
        ModelOptions(tp_reduce="bf16")  # the one check of the value, where the options are made
    assert parse_args([], env={}).options.tp_reduce == "fp32"
    assert parse_args([], env={"POC_TP_REDUCE": "model"}).options.tp_reduce == "model"
    with pytest.raises(InputError, match="POC_TP_REDUCE must be fp32 or model, got 'bf16'"):
        parse_args([], env={"POC_TP_REDUCE": "bf16"})


def test_rank_profile_writes_a_breakdown_per_rank(tmp_path):
    """POC_RANK_PROFILE=DIR (RankDiagnostics.profile_dir): every rank profiles batches 4-7 of its first job and writes
    DIR/rank<N>.json (on the CPU the profiler sees CPU ops, all of kind "other"; on CUDA the kernels by kind, NCCL
    included)."""
    from poc.profiling import KINDS

    e = DistEngine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32", tp=2, world=2, timeout=60,
                   diagnostics=RankDiagnostics(profile_dir=str(tmp_path)))
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

    from poc.engine import ranks

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
    r.cfg, r.clock = ranks.RankConfig(layout=Layout(1), backend="gloo", device_type="cpu", store_port=0), None
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

    from poc.engine import ranks

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
