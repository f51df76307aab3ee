"""The soak's stability summary (benchmarks/diagnostics/soak.py), which says whether a long run slowed down: the rate
is taken only over samples that lie inside one segment (a sample across a stop and the next init measures the switch),
summed over whole minutes, per CPU second of the server and at the probe's constant core speed."""

import pytest

from .fakes import diagnostic


@pytest.fixture(scope="module")
def soak():
    return diagnostic("soak")


def run(slow_at: float = 180.0, probe_at_slow: float = 0.30) -> list[dict]:
    """Samples every 20 s to t=240 over segments [0, 125] and [125, 250]: 2000 nonces, 1 CPU second, a probe of
    0.25 s each, except the sample at `slow_at` (1000 nonces in 1 CPU second, the probe `probe_at_slow`)."""
    out, cpu, busy = [], 0.0, 0.0
    for t in range(20, 260, 20):
        slow = t == slow_at
        cpu += 1.0
        busy += 30.0
        out.append({"t_s": float(t), "nonces_computed": None if t == 20 else (1000 if slow else 2000),
                    "server": {"rss_mb": 400.0, "fds": 10, "cpu_s": cpu}, "children": [], "spool_bytes": 1000,
                    "probe_s": probe_at_slow if slow else 0.25,
                    "machine": {"busy_s": busy, "idle_s": t * 2 - busy, "steal_s": 0.0}})
    return out


SEGMENTS = [{"init_at_s": 0.0, "stop_at_s": 125.0, "computed": 12_000},
            {"init_at_s": 125.0, "stop_at_s": 250.0, "computed": 11_000}]


def test_the_rate_leaves_out_the_sample_across_a_switch_and_sums_whole_minutes(soak):
    st = soak.stability(SEGMENTS, run())
    # in-segment samples: (20,40] ... (100,120] and (140,160] ... (220,240]; (120,140] holds the switch
    assert st["sample_rate_vs_first_steady"] == {"min": 0.5, "max": 1.0, "first": 100.0, "n": 10}
    # one whole minute a segment (the other 40 s of each are no whole minute): (2000 + 1000 + 2000) / 60 s
    assert st["minute_rate_vs_first_steady"] == {"min": 0.8333, "max": 0.8333, "first": 100.0, "n": 2}
    assert st["minute_nonces_per_cpu_s_vs_first_steady"]["min"] == 0.8333
    # the slow minute's probe was slower too (mean 0.2667 s against 0.25): on a constant core 0.8889 of the first
    assert st["minute_rate_at_constant_core_speed_vs_first_steady"]["min"] == 0.8889
    assert st["segment_nonces_per_s"] == [96.0, 88.0]
    assert st["machine_cpu_share"] == {"busy_s": 0.75, "idle_s": 0.25, "steal_s": 0.0}


def test_a_steady_run_is_steady_and_a_slower_core_explains_a_slower_minute(soak):
    st = soak.stability(SEGMENTS, run(slow_at=-1))
    assert st["minute_rate_vs_first_steady"]["min"] == st["minute_rate_vs_first_steady"]["max"] == 1.0
    # half the nonces in a minute whose core ran at half speed (probe 0.5 s a sample instead of 0.25, mean 1/3 s
    # over the minute's three samples) is a slower machine, not a slower server: 0.8333 x 0.3333 / 0.25 = 1.1111
    st = soak.stability(SEGMENTS, run(probe_at_slow=0.5))
    assert st["minute_rate_vs_first_steady"]["min"] == 0.8333
    assert st["minute_rate_at_constant_core_speed_vs_first_steady"]["max"] == 1.1111


def hour(loss_per_hour: float, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """An hour in 12 segments of 5 minutes, a sample every 30 s: a rate of 4,000 nonces/s that wanders +-15% with the
    machine (independent per sample), falling by `loss_per_hour` of itself over the hour."""
    import random

    rnd = random.Random(seed)
    segs = [{"init_at_s": 300.0 * i, "stop_at_s": 300.0 * (i + 1), "computed": 1_200_000} for i in range(12)]
    out = []
    for k in range(1, 121):
        t = 30.0 * k
        rate = 4000.0 * (1 - loss_per_hour * t / 3600.0) * (1 + rnd.uniform(-0.15, 0.15))
        out.append({"t_s": t, "nonces_computed": round(rate * 30), "server": {"rss_mb": 400.0, "fds": 10},
                    "children": [], "spool_bytes": 0})
    return segs, out


def test_the_trend_tells_a_leak_from_a_wandering_machine(soak):
    """The line through the sample rates: a steady server on a noisy machine gets an interval around 0 narrower than
    the noise (+-15%: about +-5% an hour); a server losing 10% an hour gets an interval that holds its slope and
    excludes 0, and its fastest samples of the last quarter fall short of the first quarter's."""
    for seed in range(3):
        steady = soak.stability(*hour(0.0, seed))["trend"]
        lo, hi = steady["slope_95"]
        assert lo < 0 < hi and hi - lo < 0.15, steady
        assert min(steady["quarter_p90_vs_first"]) > 0.93, steady
        leak = soak.stability(*hour(0.10, seed))["trend"]
        lo, hi = leak["slope_95"]
        assert lo < -0.1 / 0.95 < hi < 0, leak  # 10% of the start an hour, 10.5% of the hour's mean rate
        assert leak["quarter_p90_vs_first"][-1] < 0.95, leak


def with_control(samples: list[dict], loops_per_s: dict[float, float]) -> list[dict]:
    """The control's reading at each sample (--control-core): loops counted at 1,000 a second, or at
    loops_per_s[t] over the sample ending at t."""
    total, prev = 0.0, 0.0
    for x in samples:
        total += loops_per_s.get(x["t_s"], 1000.0) * (x["t_s"] - prev)
        prev = x["t_s"]
        x["control"] = {"t_s": x["t_s"] - 0.4, "loops": round(total)}  # a report up to a second before the sample
    return samples


def test_the_control_core_tells_a_slower_machine_from_a_slower_server(soak):
    """A minute with half the nonces: where the control core counted half its loops over that sample too (the machine
    slowed, both cores alike), the rate at the control's speed holds; where the control ran on at full speed (the server
    slowed), it falls with the rate. The nonces per server CPU second at the control's speed likewise."""
    machine = soak.stability(SEGMENTS, with_control(run(), {180.0: 500.0}))
    # the slow minute (140, 200]: 5000 nonces in 60 s; the control 1000 + 500 + 1000 loops a second over its samples
    assert machine["minute_rate_vs_first_steady"]["min"] == 0.8333
    assert machine["minute_rate_at_control_speed_vs_first_steady"]["min"] == pytest.approx(0.8333 * 1000 / 833.3,
                                                                                            abs=2e-3)
    server = soak.stability(SEGMENTS, with_control(run(), {}))
    assert server["minute_rate_at_control_speed_vs_first_steady"]["min"] == pytest.approx(0.8333, abs=1e-4)
    assert server["minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]["min"] == pytest.approx(0.8333,
                                                                                                      abs=1e-4)
    steady = soak.stability(SEGMENTS, with_control(run(slow_at=-1), {}))
    assert steady["minute_rate_at_control_speed_vs_first_steady"] == {"min": 1.0, "max": 1.0, "first": 0.1, "n": 2}
    # without control readings there is no such figure, and nothing breaks
    assert "minute_rate_at_control_speed_vs_first_steady" not in soak.stability(SEGMENTS, run())


def with_shared_control(samples: list[dict], per_cpu_s: dict[float, float]) -> list[dict]:
    """The control's readings where it shares the server's core (--control-core on one of --server-cores): 10 of its
    CPU seconds a 20-s sample, 1,000 loops per CPU second, or per_cpu_s[t] over the sample ending at t."""
    total, cpu = 0.0, 0.0
    for x in samples:
        total += per_cpu_s.get(x["t_s"], 1000.0) * 10.0
        cpu += 10.0
        x["control"] = {"t_s": x["t_s"] - 0.4, "loops": round(total), "cpu_s": cpu}
    return samples


def test_a_control_sharing_the_server_core_is_read_per_its_cpu_second(soak):
    """Sharing a core, the control's loops per wall second move with how the scheduler splits the core; per its own
    CPU second they are the core's speed. A slow sample where the control's loops per CPU second halved too is the
    core (the ratio holds at 1); where they did not, the server (it falls to the nonces' 0.8333), in the minute's
    figure and in each sample's (control_ratios, the plot's)."""
    core = soak.stability(SEGMENTS, with_shared_control(run(), {180.0: 500.0}))
    # the slow minute: 5000 nonces in 3 server CPU s against 25,000 loops in 30 control CPU s; the first 6000 in 3
    assert core["minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]["min"] == 1.0
    assert core["clear_minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]["max"] == 1.0
    assert [round(r, 4) for _, r in soak.control_ratios(with_shared_control(run(), {180.0: 500.0}))] == [1.0] * 11
    server = soak.stability(SEGMENTS, with_shared_control(run(), {}))
    assert server["minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]["min"] == 0.8333
    ratios = dict(soak.control_ratios(with_shared_control(run(), {})))
    assert ratios[3.0] == 0.5 and ratios[2.0] == ratios[4.0] == 1.0


def test_minutes_a_receiver_fault_touched_are_left_out_of_the_clear_figure(soak):
    """After a refusal the spool's backlog is re-sent and a paused generation resumes: the minutes that overlap a
    fault window or start within FAULT_AFTER_S of its end are not clear; the rest are."""
    samples = with_shared_control(run(), {})
    key = "clear_minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"
    far = soak.stability(SEGMENTS, samples, [{"from_s": 300.0, "to_s": 310.0, "kind": "refuse"}])
    assert far[key] == far["minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]
    assert far[key]["min"] == 0.8333
    # the slow minute (140, 200] starts 50 s after a fault that ended at 90: not clear, and one clear minute is no
    # comparison
    after = soak.stability(SEGMENTS, samples, [{"from_s": 85.0, "to_s": 90.0, "kind": "refuse"}])
    assert key not in after and after["minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]["min"] == 0.8333
    # a fault inside the first minute leaves only the slow one clear: no comparison either
    assert key not in soak.stability(SEGMENTS, samples, [{"from_s": 70.0, "to_s": 75.0, "kind": "slow"}])


def test_the_plot_ratios_leave_out_the_sample_across_a_switch(soak):
    ratios = soak.control_ratios(with_shared_control(run(), {}), SEGMENTS)
    assert 7.0 / 3 not in dict(ratios) and len(ratios) == 10  # (120, 140] holds the stop and the next init


def test_the_clear_minutes_have_a_trend_that_shows_a_server_losing_speed(soak):
    """An hour of 30-s samples with the control sharing the core: the core's speed wanders +-15% (the server's
    nonces per CPU second and the control's loops per CPU second alike); a server that loses 10% an hour shows it in
    the clear minutes' trend, a steady one does not."""
    import random

    def hour_shared(loss: float, seed: int):
        rnd = random.Random(seed)
        segs = [{"init_at_s": 300.0 * i, "stop_at_s": 300.0 * (i + 1), "computed": 1} for i in range(12)]
        out, cpu, loops, ccpu = [], 0.0, 0.0, 0.0
        for k in range(1, 121):
            t, core = 30.0 * k, 1 + rnd.uniform(-0.15, 0.15)
            cpu += 18.0
            ccpu += 12.0
            loops += 1000.0 * core * 12.0
            n = 2000.0 * core * (1 - loss * t / 3600.0) * 18.0
            out.append({"t_s": t, "nonces_computed": round(n), "server": {"rss_mb": 400.0, "fds": 10, "cpu_s": cpu},
                        "children": [], "spool_bytes": 0,
                        "control": {"t_s": t - 0.4, "loops": round(loops), "cpu_s": ccpu}})
        return segs, out

    for seed in range(3):
        steady = soak.stability(*hour_shared(0.0, seed))
        m = steady["clear_minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]
        assert 0.999 < m["min"] <= m["max"] < 1.001, m  # the core's wander cancels
        lo, hi = steady["clear_minute_trend_at_control_speed"]["slope_95"]
        assert lo <= 0 <= hi and hi - lo < 0.01
        lo, hi = soak.stability(*hour_shared(0.10, seed))["clear_minute_trend_at_control_speed"]["slope_95"]
        assert lo <= hi < 0 and (lo + hi) / 2 == pytest.approx(-0.1 / 0.95, abs=2e-3)  # 10% of the start an hour


def with_threads(samples: list[dict], serving: dict[float, float]) -> list[dict]:
    """The server's threads in each sample: its job thread ("poc-job") computes 0.8 CPU s a sample, its event loop
    ("python") serves 0.2, or serving[t] over the sample ending at t; the server's CPU is their sum."""
    job, loop = 0.0, 0.0
    for x in samples:
        job += 0.8
        loop += serving.get(x["t_s"], 0.2)
        x["server"] = {**x["server"], "cpu_s": job + loop, "threads": {"7": ["python", loop], "9": ["poc-job", job]}}
    return samples


def test_the_server_cpu_splits_into_computing_and_serving_threads(soak):
    """A minute whose serving costs twice the CPU per nonce (0.4 s instead of 0.2 in its middle sample) lowers the
    nonces per server CPU second, but not the nonces per computing CPU second: the two figures tell a slower serving
    path from a slower computation, and the serving CPU per nonce shows the former by itself."""
    st = soak.stability(SEGMENTS, with_threads(with_shared_control(run(slow_at=-1), {}), {180.0: 0.4}))
    # the minute (140, 200]: 6000 nonces in 3.2 server CPU s against 6000 in 3.0
    assert st["clear_minute_nonces_per_cpu_s_at_control_speed_vs_first_steady"]["min"] == 0.9375
    assert st["clear_minute_nonces_per_computing_cpu_s_at_control_speed_vs_first_steady"] == {
        "min": 1.0, "max": 1.0, "first": 2.5, "n": 2}  # 6000 nonces / 2.4 computing CPU s / 1000 loops per CPU s
    assert st["clear_minute_serving_cpu_per_nonce_at_control_speed_vs_first_steady"]["max"] == 1.3333  # 0.8 / 0.6
    # per sample (the plot's): the sample ending at 180 is 2000 nonces in 1.2 CPU s, in 0.8 computing CPU s
    samples = with_threads(with_shared_control(run(slow_at=-1), {}), {180.0: 0.4})
    assert round(dict(soak.control_ratios(samples))[3.0], 4) == 0.8333
    assert {round(r, 9) for _, r in soak.control_ratios(samples, computing=True)} == {1.0}
    assert soak.control_ratios(with_shared_control(run(), {}), computing=True) == []
    # without thread names in the samples there are no such figures
    assert "clear_minute_serving_cpu_per_nonce_at_control_speed_vs_first_steady" not in soak.stability(
        SEGMENTS, with_shared_control(run(slow_at=-1), {}))


def test_cpu_split_counts_a_thread_by_its_name_at_the_later_sample(soak):
    """The job thread is named while a job runs: renamed since the earlier sample, its CPU since then computes; a
    thread born since counts all its CPU; the server's processes (the ranks) compute."""
    a = {"server": {"cpu_s": 10.0, "threads": {"1": ["python", 4.0], "2": ["python", 6.0]}}, "children": []}
    b = {"server": {"cpu_s": 14.0, "threads": {"1": ["python", 5.0], "2": ["poc-job", 8.0],
                                               "3": ["poc-prepare", 1.0]}},
         "children": [{"cpu_s": 2.5}]}
    assert soak.cpu_split(a, {**b, "children": []}) == (3.0, 1.0)
    a["children"] = [{"cpu_s": 1.0}]
    assert soak.cpu_split(a, b) == (4.5, 1.0)
    assert soak.cpu_split({"server": {"cpu_s": 1.0}, "children": []}, b) is None
    from poc.engine.engine import PREPARE_THREAD
    from poc.server.stream import JOB_THREAD

    assert set(soak.COMPUTING_THREADS) == {JOB_THREAD, PREPARE_THREAD}  # the names the server gives them
