"""DistEngine's failure paths: simulated ranks in-process (replicas that stall, fail or end late) and one injected
failure in real rank processes. Every result a rank reported reaches the job; the engine breaks, restart() recovers."""

import os
import threading
import time

import numpy as np
import pytest

from poc.engine.dist import DistEngine, RankFailure
from poc.engine.jobs import Limits, V1Job, V2Job
from poc.engine.rankgroup import RankGroup
from poc.protocol import v1

from .golden import V1_GOLDEN as G1, v2_checkpoint

BH, PK = G1["block_hash"], G1["public_key"]
SEQ, K = 16, 12


def v1_params(name: str) -> v1.V1Params:
    return v1.V1Params.from_json(G1["sets"][name]["params"])


class _SimulatedRanks(RankGroup):
    """In-process stand-in for the rank processes of a DistEngine's RankGroup: each replica builds its model for
    `build_s` after the job arrives, then computes its queued batches one by one (`batch_s` each); an "end" with drop
    cancels what is still queued. Speaks the engine's messages: started, result, done. `fail_at=(replica, n)`:
    that replica fails on its n-th batch (1-based) as a rank that raised does: the group fails (RankGroup.fail:
    every rank killed, the engine broken, "failed" queued). `sent` lists the nonces of every result the replicas
    reported."""

    def __init__(self, engine: DistEngine, build_s: float, batch_s: float, fail_at: tuple[int, int] | None = None):
        import queue

        super().__init__(engine.rank_config(), on_fail=engine.mark_broken)
        self.layout, self.build_s, self.batch_s, self.fail_at = engine.layout, build_s, batch_s, fail_at
        self.queues = {r: queue.Queue() for r in range(self.layout.replicas)}
        self.replica_of = {self.layout.leader(r): r for r in range(self.layout.replicas)}
        self.lock, self.sent = threading.Lock(), []

    def send(self, rank: int, msg) -> None:
        r = self.replica_of[rank]
        if msg[0] == "job":
            threading.Thread(target=self._replica, args=(r, msg[1]), daemon=True).start()
        else:
            self.queues[r].put(msg)

    def kill(self) -> None:  # RankGroup.fail: what a killed rank had not reported never arrives
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
                    self.fail(f"rank {self.layout.leader(r)} failed: RuntimeError: boom")
                return
            _, _, seq, nonces = m
            if not self._put(("result", jid, r, seq, {"nonces": nonces, "dist": np.zeros(len(nonces))},
                              self.batch_s)):
                return


def _simulated(build_s: float = 0.0, batch_s: float = 0.02, **kw) -> DistEngine:
    e = DistEngine("cpu", world=2, tp=1, timeout=5)  # two replicas, simulated in this process
    e._ranks = _SimulatedRanks(e, build_s, batch_s, **kw)
    return e


def _v1_job(nonces, batch_size: int = 4, max_nonces: int | None = None) -> V1Job:
    return V1Job(BH, PK, 1, v1_params("A_gqa_plain_rope"), 1.5, nonces, batch_size, "float32",
                 Limits(max_nonces=max_nonces, max_duration=None))


def test_max_duration_counts_from_the_built_model_not_the_job_start():
    """A v1 model that takes longer to build than max_duration (the ranks build it when the job arrives, 0.6 s
    here) still computes for max_duration: the clock starts at the replicas' "started", as one device starts it
    after its build; before, the deadline passed during the build and every dealt batch was dropped."""
    e = DistEngine("cpu", world=2, tp=1, timeout=30)  # two replicas, simulated in this process
    e._ranks = _SimulatedRanks(e, build_s=0.6, batch_s=0.05)
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
        yield from range(24)  # the 6 batches dealt ahead (batches_ahead 3 x 2 replicas), then the iterator fails
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
    g = e.new_group()
    ends = [Pipe() for _ in range(2)]
    g.conns = {r: ends[r][0] for r in range(2)}
    g.procs = [Proc(ends[r][1], 1000 + r) for r in range(2)]
    e._ranks = g
    for seq in (1, 3, 5):
        ends[0][1].send(("result", 1, 0, seq, {"nonces": [seq]}, 0.1))
    ends[1][1].send(("error", 1, "RuntimeError: boom"))
    g.read()  # the reader thread's loop, here in the test's thread
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
            yield from range(8)  # seqs 1, 3 to replica 0 and 2, 4 to replica 1, then the bad batches (5 and 6)
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
