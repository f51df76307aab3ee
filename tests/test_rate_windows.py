"""Steady rates from result arrivals: timed from the last replica's first result (poc.engine.jobs.steady_rate, used by
poc.bench, the compile-at-start log line and benchmarks/diagnostics/serve_layouts.py), so that with several replicas
no batch computed before the window opens is counted inside it."""

import math

import pytest

from poc.engine.jobs import steady_rate

from .fakes import diagnostic


def two_replicas(batches: int = 9, every: float = 1.0) -> tuple[list[float], list[int]]:
    """Two replicas, a batch of 64 each `every` seconds, both first results at t=every (each carries its compile)."""
    times, sizes = [], []
    for k in range(1, batches + 1):
        for r in range(2):
            times.append(k * every + 0.001 * r)
            sizes.append(64)
    return times, sizes


def test_steady_rate_counts_only_the_work_inside_its_window():
    times, sizes = two_replicas()
    assert steady_rate(times, sizes, 2) == pytest.approx(128.0, rel=2e-3)
    # timed from the first arrival, replica 2's first batch would count as work of the window: 17 batches over 8 s
    assert steady_rate(times, sizes, 1) == pytest.approx(17 * 64 / 8.001, rel=1e-6)
    assert steady_rate([1.0, 2.0, 3.0], [64, 64, 32], 1) == pytest.approx(48.0)
    assert math.isnan(steady_rate(times[:2], sizes[:2], 2)) and math.isnan(steady_rate([], [], 1))
    assert math.isnan(steady_rate([1.0, 1.0], [4, 4], 1))


@pytest.fixture(scope="module")
def serve_layouts():
    return diagnostic("serve_layouts")


def test_serve_layouts_times_polls_from_every_replicas_first_batch(serve_layouts):
    """/api/v1/pow/status polls every 0.25 s of two replicas finishing a batch of 64 each second from t=1: the rate
    from the poll that first sees both first batches is 128/s, not the 136/s of a window opened at one batch."""
    seen, done = [], 0
    for i in range(1, 37):
        t = 0.25 * i
        n = 128 * int(t)  # both replicas' k-th batches land at t = k
        if not seen or n != seen[-1][1]:
            seen.append((t, n))
        done = n
    assert done == 9 * 128
    assert serve_layouts.polled_rate(seen, 64, 2) == pytest.approx(128.0)
    assert serve_layouts.polled_rate(seen, 64, 1) == pytest.approx(128.0)  # polls see both batches at once here
    # a poll between the replicas' first batches: replica 1 at t=1.0, replica 2 at t=1.1, then 128 each second
    seen = [(1.0, 64), (1.1, 128)] + [(1.0 + k, 128 * (k + 1)) for k in range(1, 9)]
    assert serve_layouts.polled_rate(seen, 64, 2) == pytest.approx(8 * 128 / 7.9)
    assert serve_layouts.polled_rate(seen, 64, 1) == pytest.approx((9 * 128 - 64) / 8.0)
    assert math.isnan(serve_layouts.polled_rate(seen[:1], 64, 2))


def test_serve_layouts_reads_the_engines_rate_from_the_log_line(serve_layouts):
    line = ("compile at start: v2 batch 64 seq_len 1024, 1152 nonces in 18 batch(es), 17.1 s; the engine alone after "
            "each replica's first batch: 141.500 nonces/s")
    m = serve_layouts.ENGINE_ALONE.search(line)
    assert m and float(m.group(1)) == 17.1 and float(m.group(2)) == 141.5


def test_compile_at_start_logs_two_replicas_rate_without_their_first_batches(caplog):
    """The engine's own rate in the compile-at-start line (what serve_layouts.py sets the routes against): two
    replicas whose results arrive in pairs every 0.05 s, 4 nonces each: 160/s, not the 5 in 4 of a window opened at
    the first result."""
    import logging
    import time

    from poc.engine.jobs import BatchResult, JobSummary
    from poc.server import warm_start

    (shape,) = warm_start.parse('[{"batch_size": 4, "params": {"seq_len": 16}, "batches": 5}]', "m")

    class TwoReplicas:
        compile_v1 = compile_v2 = False
        replicas, last_job_stats = 2, None

        def require_v2(self):
            return type("Info", (), {"cfg": type("Cfg", (), {"max_seq_len": 64, "dim": 64})})()

        def run(self, job, emit, stop, claim=None):
            n = 0
            while n < job.limits.max_nonces:
                time.sleep(0.05)
                for _ in range(2):
                    emit(BatchResult(index=n // 4 + 1, nonces=list(range(n, n + 4)), elapsed=0.0, batch_seconds=0.05))
                    n += 4
            return JobSummary("max_nonces", n // 4, n, 0.25)

    with caplog.at_level(logging.INFO, logger="poc.server"):
        warm_start.run(TwoReplicas(), (shape,))
    line = next(m for m in caplog.messages if "compile at start:" in m)
    assert "40 nonces in 10 batch(es)" in line, line
    rate = float(line.split("the engine alone after each replica's first batch: ")[1].split()[0])
    # 32 nonces over 4 steps of >= 0.05 s: at most 160/s; the old window (36 nonces over the same span) said 180
    assert 40 < rate <= 161, line
