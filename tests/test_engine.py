"""The engine's job loop: limits, stop, busy, every launched batch emitted exactly once."""

import threading

import numpy as np
import pytest

from poc.engine.base import Busy
from poc.engine.engine import Engine
from poc.engine.jobs import Limits, V1Job, V2Job
from poc.protocol import v1

from .golden import V1_GOLDEN as G1, V2_GOLDEN as G2, v2_checkpoint

PARAMS = v1.V1Params.from_json(G1["sets"]["A_gqa_plain_rope"]["params"])
BH, PK = G1["block_hash"], G1["public_key"]


@pytest.fixture(scope="module")
def engine():
    e = Engine("cpu", model_dir=str(v2_checkpoint("qwen3")), dtype="float32")
    e.load()
    yield e
    e.close()


def v1_job(n_max=None, batch=4, duration=None, start=0):
    return V1Job(BH, PK, 1, PARAMS, v1.DEFAULT_R_TARGET, v1.worker_nonces(start, 0, 1), batch, "float32",
                 Limits(max_nonces=n_max, max_duration=duration))


def test_max_nonces_exact_and_in_order(engine):
    out = []
    s = engine.run(v1_job(n_max=10, batch=4), out.append, threading.Event())
    assert s.reason == "max_nonces" and s.computed == 10 and s.batches == 3
    assert [b.nonces for b in out] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert [b.index for b in out] == [1, 2, 3]
    want = np.array(G1["sets"]["A_gqa_plain_rope"]["runs"]["float32"]["dist"][:10])
    assert np.abs(np.concatenate([b.dist for b in out]) - want).max() < 1e-6


def test_stop_finishes_inflight_batch(engine):
    stop = threading.Event()
    out = []

    def emit(b):
        out.append(b)
        if b.index == 2:
            stop.set()

    s = engine.run(v1_job(batch=3), emit, stop)
    assert s.reason == "stopped"
    nonces = [n for b in out for n in b.nonces]
    assert nonces == list(range(len(nonces)))  # contiguous, nothing skipped, nothing twice
    assert 2 <= s.batches <= 3 and s.computed == len(nonces)


def test_one_dealing_rule_for_every_engine(engine, monkeypatch):
    """jobs.Dealer: batches_ahead a replica dealt in turn first, then consecutive batch_size pieces of the job's one
    iterator, the last cut at max_nonces. The one-device Engine takes its nonces through it (as DistEngine does,
    tests/test_parallel_ranks.py), holding batches_ahead(1) = 3: one prepared, one computed, one collected."""
    from poc.engine import dist, engine as engine_mod
    from poc.engine.jobs import Dealer, batches_ahead

    d = Dealer(v1_job(n_max=10, batch=4), replicas=2, pp=2)
    assert (d.ahead, batches_ahead(), batches_ahead(4)) == (4, 3, 6)
    assert d.first() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert [d.next() for _ in range(4)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9], []] and d.taken == 10
    assert dist.Dealer is Dealer  # the distributed engine deals by the same rule
    dealers = []

    class Recording(Dealer):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            dealers.append(self)

    monkeypatch.setattr(engine_mod, "Dealer", Recording)
    out = []
    engine.run(v1_job(n_max=6, batch=4), out.append, threading.Event())
    assert len(dealers) == 1 and dealers[0].taken == 6 and [b.nonces for b in out] == [[0, 1, 2, 3], [4, 5]]


def test_exhausted_iterator_and_duration(engine):
    job = v1_job(batch=4)
    job.nonces = v1.range_nonces(5, 14)
    out = []
    s = engine.run(job, out.append, threading.Event())
    assert s.reason == "exhausted" and [n for b in out for n in b.nonces] == list(range(5, 15))
    s = engine.run(v1_job(batch=2, duration=0.0), out.append, threading.Event())
    assert s.reason == "max_duration" and s.computed == 0


def test_busy(engine):
    started, release = threading.Event(), threading.Event()

    def emit(_b):
        started.set()
        release.wait(10)

    t = threading.Thread(target=engine.run, args=(v1_job(n_max=8, batch=2), emit, threading.Event()))
    t.start()
    assert started.wait(30)
    assert engine.state == "busy"
    with pytest.raises(Busy):
        engine.run(v1_job(n_max=2), lambda b: None, threading.Event())
    release.set()
    t.join(30)
    assert engine.state == "ready"


def test_v2_job_matches_golden(engine):
    prm = G2["parameters"]
    job = V2Job(prm["block_hash"], prm["public_key"], 1, prm["seq_len"], prm["k_dim"], iter(prm["nonces"]), 3)
    out = []
    s = engine.run(job, out.append, threading.Event())
    assert s.computed == 8 and s.reason == "exhausted"
    got = {a["nonce"]: a["vector_b64"] for b in out for a in b.artifacts}
    want = {a["nonce"]: a["vector_b64"] for a in G2["models"]["qwen3"]["artifacts"]}
    from poc.protocol import v2
    for n in want:
        assert np.linalg.norm(v2.decode(got[n]) - v2.decode(want[n])) < 1e-3


def test_padded_short_batch_gives_the_same_results(engine):
    """A compiled path pads a short last batch to the compiled shape; the padding rows are dropped."""
    comp = engine.v2
    prm = G2["parameters"]
    prep = comp.prepare(prm["block_hash"], prm["public_key"], [0, 1, 2], prm["seq_len"], 12)
    plain = comp.collect(comp.launch(prep))
    comp.compiled = True  # take the padding branch with the eager function
    try:
        padded = comp.collect(comp.launch(prep, pad_to=8))
    finally:
        comp.compiled = False
    assert [a["nonce"] for a in padded["artifacts"]] == [0, 1, 2]
    assert padded == plain


def test_compile_modes_and_server_flags():
    from poc.errors import InputError
    from poc.server.config import parse_args

    e = Engine("cpu", compile="on")
    assert not e.compile_v1 and not e.compile_v2  # never on the CPU
    with pytest.raises(InputError):
        Engine("cpu", compile="sometimes")
    cfg = parse_args(["--tp", "2", "--pp", "1", "--replicas", "3", "--compile", "off"], env={})
    assert (cfg.tp, cfg.pp, cfg.replicas, cfg.compile) == (2, 1, 3, "off")
    cfg = parse_args([], env={"POC_TP": "4", "POC_COMPILE": "on"})
    assert cfg.tp == 4 and cfg.compile == "on" and cfg.pp == 1
    assert parse_args([], env={}).options.fp8_experts == "keep"
    assert parse_args(["--fp8-experts", "dequant"], env={}).options.fp8_experts == "dequant"
    assert parse_args([], env={"POC_FP8_EXPERTS": "dequant"}).options.fp8_experts == "dequant"
    for bad in (["--tp", "0"], ["--tp", "two"], ["--compile", "maybe"], ["--replicas", "-1"], ["--fp8-experts", "x"]):
        with pytest.raises(InputError):
            parse_args(bad, env={})


@pytest.mark.parametrize("spec", ["random:tiny", "random:tiny-moe", "random:tiny-moe:fp8"])
def test_random_weight_model(spec):
    """--model random:<preset>[:fp8]: a model of a preset shape with random weights, made on the device."""
    e = Engine("cpu", model_dir=spec)
    e.load()
    assert e.state == "ready" and e.v2.cfg.n_layers == 2
    arts, dropped = e.v2_artifacts(BH, PK, list(range(6)), 16, 12, batch_size=4)
    assert [a["nonce"] for a in arts] == list(range(6)) and not dropped
    if spec.endswith("fp8"):
        assert e.v2.model.layers["0"].mlp.w13.dtype.is_floating_point and e.v2.model.layers["0"].mlp.w13_scale is not None
    again, _ = e.v2_artifacts(BH, PK, list(range(6)), 16, 12, batch_size=3)
    assert [a["vector_b64"] for a in again] == [a["vector_b64"] for a in arts]  # batch size does not matter
    e.close()


def test_a_new_compiled_shape_is_logged_once(caplog):
    """Operators see why a first batch is slow: one line per new (batch, seq_len) of a compiled path."""
    import logging

    from poc.model.compile import note_new_shape

    with caplog.at_level(logging.INFO, logger="poc.compute"):
        assert note_new_shape("PoC v2 (test)", 7, 33) is True
        assert note_new_shape("PoC v2 (test)", 7, 33) is False
        assert note_new_shape("PoC v2 (test)", 8, 33) is True
    lines = [m for m in caplog.messages if m.startswith("PoC v2 (test): compiling")]
    assert lines == ["PoC v2 (test): compiling for batch 7 x seq_len 33 (once per shape in this process: this batch "
                     "takes longer)", "PoC v2 (test): compiling for batch 8 x seq_len 33 (once per shape in this "
                     "process: this batch takes longer)"]


def test_a_failing_launch_still_emits_the_batch_in_flight(engine, monkeypatch):
    """An exception launching batch 3 ends the job, but batch 2, already launched (computed), is emitted first: the
    error drops no computed work (it was lost, and the client's next_nonce pointed back at it)."""
    from poc.engine.compute import V1Compute

    real, calls = V1Compute.launch, []

    def flaky(self, prep, pad_to=None):
        calls.append(prep.nonces)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real(self, prep, pad_to)

    monkeypatch.setattr(V1Compute, "launch", flaky)
    out = []
    with pytest.raises(RuntimeError, match="boom"):
        engine.run(v1_job(n_max=10, batch=2), out.append, threading.Event())
    assert [b.nonces for b in out] == [[0, 1], [2, 3]]
    monkeypatch.setattr(V1Compute, "launch", real)
    s = engine.run(v1_job(n_max=4, batch=2), out.append, threading.Event())  # the engine is usable again
    assert s.reason == "max_nonces" and s.computed == 4
