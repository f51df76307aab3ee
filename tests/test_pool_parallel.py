"""The weight pool drawn by several threads (poc.protocol.pool) against v1.weight_pool's single stream."""

import os

import numpy as np
import pytest
import torch

from poc.model.random_init import pool_tensor
from poc.protocol import pool, v1

HASHES = ["abc", "0x5e1f", "golden-block"]


def _xsl_rr(state: int) -> int:
    """PCG64's output function (xor the halves, rotate right by the top 6 bits), to see which state it reads."""
    hi, lo = state >> 64, state & (2**64 - 1)
    x, r = hi ^ lo, hi >> 58
    return ((x >> r) | (x << (64 - r))) & (2**64 - 1)


def _stepped(state: dict, steps: int) -> dict:
    bg = np.random.PCG64()
    bg.state = state
    bg.advance(steps)
    return bg.state


def test_lcg_distance_matches_advance():
    rng = np.random.default_rng(7)
    for h in HASHES:
        s0 = v1.get_rng(h, 4).bit_generator.state
        deltas = [0, 1, 2, 3, 255, 2**64 - 1, 2**64, 2**127, 2**128 - 1]
        deltas += [int(rng.integers(0, 2**63)) * 2**65 + int(rng.integers(0, 2**63)) for _ in range(20)]
        for d in deltas:
            assert pool.lcg_distance(s0, _stepped(s0, d)) == d
            assert pool.lcg_distance(_stepped(s0, d), s0) == (-d) % 2**128


def test_lcg_distance_refuses_other_streams():
    with pytest.raises(ValueError):
        pool.lcg_distance(v1.get_rng("a", 4).bit_generator.state, v1.get_rng("b", 4).bit_generator.state)


def test_pcg64_steps_then_outputs():
    """numpy's PCG64 steps the LCG first and outputs from the new state; d raw outputs = d steps = advance(d).
    So a raw position counted by lcg_distance is the number of outputs drawn, as draw_pool assumes."""
    g = v1.get_rng("abc", 4)
    s0 = g.bit_generator.state
    raw = g.bit_generator.random_raw(3)
    assert g.bit_generator.state["state"] == _stepped(s0, 3)["state"]
    assert pool.lcg_distance(s0, g.bit_generator.state) == 3
    states = [_stepped(s0, i)["state"]["state"] for i in range(4)]
    assert [int(x) for x in raw] == [_xsl_rr(s) for s in states[1:]]
    assert int(raw[0]) != _xsl_rr(states[0])


def test_normals_take_one_raw_output_or_more():
    """The premise of the stitching: a normal never takes 0 raw outputs, usually 1, sometimes more."""
    g = v1.get_rng("abc", 4)
    prev = g.bit_generator.state
    takes = []
    for _ in range(2000):
        g.standard_normal()
        cur = g.bit_generator.state
        takes.append(pool.lcg_distance(prev, cur))
        prev = cur
    assert min(takes) == 1 and max(takes) > 1
    assert 1.0 < np.mean(takes) < 1.05


def _check(h: str, size: int, workers: int, **kw) -> None:
    ref64 = v1.get_rng(h, 4).standard_normal(size) * v1.WEIGHT_STD
    ref32 = v1.weight_pool(h, size)
    assert np.array_equal(ref64.astype(np.float32), ref32)
    got32 = pool.weight_pool_parallel(h, size, workers, **kw)
    assert got32.dtype == np.float32 and np.array_equal(got32, ref32), (h, size, workers, kw)
    sink = pool.HostSink(size, np.float64)
    pool.draw_pool(h, size, sink, workers, **kw)
    assert np.array_equal(sink.out, ref64), (h, size, workers, kw)


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
@pytest.mark.parametrize("size", [0, 1, 5, 300, 2_000, 30_011])
def test_parallel_pool_is_the_single_stream_tiny_ranges(workers, size):
    """min_raw=1: every worker range is used however small (~300 raw outputs each at size 2000)."""
    for h in HASHES:
        _check(h, size, workers, min_raw=1)


@pytest.mark.parametrize("workers", [1, 2, 3, 7])
def test_parallel_pool_is_the_single_stream_default_ranges(workers):
    """The defaults (blocks, sub-chunks of `chunk`, a tail); an odd chunk makes blocks span several calls."""
    for h in HASHES[:2]:
        _check(h, 700_001, workers, min_raw=50_000, chunk=9973)
    _check("abc", 600_000, workers)


def test_straddled_boundaries_are_joined():
    """Worker ranges of ~20 raw outputs, so some boundaries fall inside a normal (~2% of raw positions do):
    the true stream ends past the next worker's start and must join it at one of its marks."""
    pool.pool_stats.clear()
    for i in range(25):
        _check(f"straddle{i}", 400, 16, min_raw=1)
    assert pool.pool_stats["straddles"] >= 4
    assert pool.pool_stats["fallbacks"] == 0


def test_true_stream_draws_before_joining():
    """For "abc", raw position 7292 is inside a normal that ends at 7293, and the stream started at 7292 takes
    7292 -> 7295 with its first normal: it skips the true boundary 7293, so the true stream draws its own
    normals from 7293 until it stands on one of the worker's marks. Two workers of 7292 raw outputs each."""
    pool.pool_stats.clear()
    _check("abc", 2 * 7292 + 64, 2, min_raw=1, raw_per_normal=1.0)
    assert pool.pool_stats["straddles"] == 2 and pool.pool_stats["join_draws"] >= 2
    assert pool.pool_stats["fallbacks"] == 0


def test_fallback_when_the_streams_do_not_join():
    """Without marks the true stream cannot join a straddled worker: that range is drawn again, same values."""
    pool.pool_stats.clear()
    for i in range(25):
        _check(f"straddle{i}", 300, 7, min_raw=1, n_marks=0)
    assert pool.pool_stats["fallbacks"] >= 3


@pytest.mark.parametrize("workers", [2, 7])
def test_workers_that_draw_past_size(workers):
    """raw_per_normal=1.3: the workers' ranges hold more normals than the pool; the rest is cut off."""
    for h in HASHES:
        for size in (10, 1_000, 20_000):
            _check(h, size, workers, min_raw=1, raw_per_normal=1.3)


def test_pool_tensor_cpu_is_the_single_stream():
    for workers in (1, 3):
        t = pool_tensor("abc", 250_007, torch.device("cpu"), workers=workers, chunk=4099)
        assert t.dtype == torch.float32 and torch.equal(t, torch.from_numpy(v1.weight_pool("abc", 250_007)))


def test_worker_count_given_or_the_cpus(monkeypatch):
    """The configured count (ModelOptions.pool_workers, from POC_POOL_WORKERS in ServerConfig) wins; none: the
    CPUs this process may run on. The environment is not read here."""
    assert pool.pool_workers(5) == 5
    monkeypatch.setenv("POC_POOL_WORKERS", "5")
    assert pool.pool_workers() == len(os.sched_getaffinity(0))


class _BrokenSink(pool.HostSink):
    def open(self, k, capacity):
        w = super().open(k, capacity)
        if k == 2:
            def view(at, n):
                raise RuntimeError("disk on fire")
            w.view = view
        return w


def test_a_failing_worker_raises_instead_of_hanging():
    with pytest.raises(RuntimeError, match="disk on fire"):
        pool.draw_pool("abc", 5_000, _BrokenSink(5_000), 4, min_raw=1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pool_tensor_cuda_is_the_single_stream():
    """On CUDA each worker copies through its own pinned buffers and stream; pieces are stitched on the device."""
    for size, workers, chunk in ((250_007, 3, 4099), (3_000_011, 16, pool.CHUNK)):
        t = pool_tensor("abc", size, torch.device("cuda"), workers=workers, chunk=chunk)
        assert t.is_cuda and torch.equal(t.cpu(), torch.from_numpy(v1.weight_pool("abc", size)))
    with torch.inference_mode():  # a rank builds its v1 model inside inference mode; the workers are outside it
        t = pool_tensor("abc", 250_007, torch.device("cuda"), workers=3, chunk=4099)
    assert torch.equal(t.cpu(), torch.from_numpy(v1.weight_pool("abc", 250_007)))


def test_pool_tensor_cpu_inside_inference_mode():
    with torch.inference_mode():
        t = pool_tensor("abc", 100_003, torch.device("cpu"), workers=3, chunk=4099)
    assert torch.equal(t, torch.from_numpy(v1.weight_pool("abc", 100_003)))
