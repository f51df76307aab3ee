"""PoC v1's weight pool drawn by several threads, bit-identical to v1.weight_pool's single stream.

v1.weight_pool is one PCG64 stream of numpy ziggurat normals (spec-v1 §2.2). A normal takes one raw 64-bit
output on the ziggurat's fast path (~98%) and more on its slow paths (1.0221 raw outputs per normal on
average, measured), so where normal i starts in the raw stream is not known in advance. But the raw
stream itself can be jumped (PCG64.advance), and every value is still drawn by numpy's own standard_normal:

1. The raw range [0, raw_total) is cut into K equal worker ranges. Worker k jumps to raw position k·R and
   draws normals until it stands on a normal boundary at or just past (k+1)·R: big blocks sized well below
   what is left, the raw position read back between blocks (lcg_distance), then single draws.
2. Worker k+1's first normals are drawn one by one and the raw position after each is recorded (its marks).
   A worker started at k·R may begin in the middle of a true normal; its stream re-joins the true one as
   soon as both stand on the same raw position (same position = same state: the ziggurat keeps no state
   between calls). At stitching time the true stream (worker k's end, the first true boundary at or past
   (k+1)·R) draws single normals until it stands on one of worker k+1's marks; worker k+1's values before
   that mark are dropped. Should it never meet them (not seen in practice), that range is drawn again
   sequentially from the true stream: slower, still exact. `pool_stats` counts both cases.
3. A short sequential tail from the last worker's end draws the values still missing up to `size`.

numpy's standard_normal and the float64 -> float32 cast release the GIL, so the workers are threads.
Where the values go is a PoolSink: host arrays here (weight_pool_parallel), device tensors in
poc.model.random_init.pool_tensor.
"""

from __future__ import annotations

import collections
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from poc.protocol import v1

PCG64_MULTIPLIER = 0x2360ED051FC65DA44385DF649FCCF645  # PCG64's default 128-bit LCG multiplier
_MASK128 = (1 << 128) - 1

# The ziggurat takes 1.0221 raw outputs per normal on average (measured over 10M normals); the workers cover
# a bit less (size·1.02 raw outputs ≈ 0.998·size normals) so they almost never draw past `size` and the
# sequential tail stays ~0.2% of the pool.
RAW_PER_NORMAL = 1.02
MARKS = 32  # how many of a worker's first normals record their raw end position (for the stitching)
MIN_RAW_PER_WORKER = 1 << 16  # below this a worker's fixed costs (~2 ms) outweigh its share
CHUNK = 1 << 18  # normals per standard_normal call: a 2 MiB float64 buffer per worker stays in cache

# straddles: a worker boundary fell inside a normal (the true stream joined the next worker past its start);
# join_draws: normals the true stream drew itself before it stood on one of the next worker's marks;
# fallbacks: it did not join within the next worker's marks, so that range was drawn again sequentially.
pool_stats: collections.Counter = collections.Counter()


def lcg_distance(state_a: dict, state_b: dict) -> int:
    """How many raw outputs take numpy's PCG64 from state_a to state_b (both `bit_generator.state` dicts).

    numpy's PCG64 steps its 128-bit LCG (state -> state·mult + inc mod 2^128) and then outputs from the new
    state, so after drawing d raw outputs the state is exactly d steps on, as after `advance(d)`.
    """
    a, b = state_a["state"], state_b["state"]
    if a["inc"] != b["inc"]:
        raise ValueError("the two states are on different PCG64 streams (their increments differ)")
    return _lcg_steps(a["state"], b["state"], a["inc"])


def _lcg_steps(cur: int, target: int, inc: int) -> int:
    """Steps of the full-period LCG from cur to target, O(128): bit j of the state only depends on bits
    <= j, and once the low j bits agree, the steps still needed are a multiple of 2^j. So walk the bits
    from low to high, keeping the LCG's 2^j-step map (mult, plus), and take that jump where bit j differs."""
    mult, plus, steps, bit = PCG64_MULTIPLIER, inc, 0, 1
    while cur != target:
        if bit >> 128:
            raise ValueError("target state is not on this LCG's cycle")
        if (cur ^ target) & bit:
            cur = (cur * mult + plus) & _MASK128
            steps |= bit
        plus = (mult + 1) * plus & _MASK128
        mult = mult * mult & _MASK128
        bit <<= 1
    return steps


def pool_workers(workers: int | None = None) -> int:
    """The worker count: `workers` when given (ModelOptions.pool_workers, POC_POOL_WORKERS), else the CPUs this
    process may run on."""
    if workers is not None:
        return max(1, workers)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------------------------------------
# Where the values go


class PieceWriter(Protocol):
    """One worker's piece: the float32 values it draws, indexed from 0 in its own range."""

    def view(self, at: int, n: int) -> np.ndarray:
        """A float32 array of n where the values piece[at:at+n] are written next (called in the worker)."""

    def commit(self, at: int, n: int) -> None:
        """Those values are written: the view may be sent on (called in the worker)."""

    def close(self) -> None:
        """The worker is done: every committed value must have landed before this returns."""


class PoolSink(Protocol):
    """The pool's destination. Called on the assembling thread, except the writers' methods."""

    dtype: type  # of the values it takes: np.float32, or np.float64 to check the draws before the cast

    def open(self, k: int, capacity: int) -> PieceWriter:
        """A writer for piece k, which holds at most `capacity` values (opening k again replaces it)."""

    def place(self, k: int, src: int, n: int, dst: int) -> None:
        """pool[dst:dst+n] = piece k [src:src+n]; piece k is not used afterwards (n may be 0)."""

    def put(self, dst: int, values: np.ndarray) -> None:
        """pool[dst:dst+len(values)] = values (of self.dtype, drawn while stitching and in the tail)."""


class ArrayWriter:
    """A piece held in an array: the worker casts straight into it."""

    def __init__(self, arr: np.ndarray):
        self.arr = arr

    def view(self, at: int, n: int) -> np.ndarray:
        return self.arr[at:at + n]

    def commit(self, at: int, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class HostSink:
    """The pool as one numpy array: float32 is v1.weight_pool's result; float64 keeps the draws before the cast."""

    def __init__(self, size: int, dtype: type = np.float32):
        self.dtype = dtype
        self.out = np.empty(size, dtype=dtype)
        self.pieces: dict[int, np.ndarray] = {}

    def open(self, k: int, capacity: int) -> PieceWriter:
        self.pieces[k] = np.empty(capacity, dtype=self.dtype)
        return ArrayWriter(self.pieces[k])

    def place(self, k: int, src: int, n: int, dst: int) -> None:
        self.out[dst:dst + n] = self.pieces.pop(k)[src:src + n]

    def put(self, dst: int, values: np.ndarray) -> None:
        self.out[dst:dst + len(values)] = values


# --------------------------------------------------------------------------------------------------
# Drawing


class _Cursor:
    """A Generator whose raw position is known: it was put at `pos`, and reading its state tells how far on it is."""

    def __init__(self, state: dict, pos: int, skip: int = 0):
        bg = np.random.PCG64()
        bg.state = state
        if skip:
            bg.advance(skip)
        self.gen = np.random.Generator(bg)
        s = bg.state["state"]
        self._origin, self._inc, self._pos = s["state"], s["inc"], pos + skip

    def pos(self) -> int:
        return self._pos + _lcg_steps(self._origin, self.gen.bit_generator.state["state"]["state"], self._inc)

    def state(self) -> dict:
        return self.gen.bit_generator.state


@dataclass
class _Piece:
    marks: list[int]  # marks[j]: raw position after the piece's first j normals (marks[0]: where it starts)
    count: int  # normals drawn
    end: int  # raw position after the last one: the first boundary of its stream at or past its target
    end_state: dict


def _emit(cur: _Cursor, buf: np.ndarray, writer: PieceWriter, at: int, n: int) -> None:
    """Draw n normals into piece[at:at+n] exactly as v1.weight_pool does: float64, times σ, cast (to float32)."""
    for a in range(0, n, len(buf)):
        m = min(len(buf), n - a)
        b = buf[:m]
        cur.gen.standard_normal(out=b)
        b *= v1.WEIGHT_STD
        writer.view(at + a, m)[:] = b
        writer.commit(at + a, m)


def _draw_range(cur: _Cursor, target: int, writer: PieceWriter, chunk: int, n_marks: int,
                marks_out: Future | None = None) -> _Piece:
    """Normals from cur until its stream stands on a boundary at or past raw position `target`. The first
    n_marks are single draws whose end positions are published early (marks_out), for the stitching."""
    try:
        pos = cur.pos()
        marks, count = [pos], 0
        buf = np.empty(max(1, min(chunk, target - pos)), dtype=np.float64)
        while pos < target and len(marks) <= n_marks:
            _emit(cur, buf, writer, count, 1)
            count += 1
            pos = cur.pos()
            marks.append(pos)
        if marks_out is not None:
            marks_out.set_result(marks)
        while pos < target:
            # Each normal takes >= 1 raw output, ~1.02 on average: a block of 7/8 of what is left all but never
            # passes the target, and what is left shrinks ~8x per block down to the last few (< 64) single
            # draws, each of which reads the position back (~35 us holding the GIL).
            left = target - pos
            n = left - left // 8 if left >= 64 else 1
            _emit(cur, buf, writer, count, n)
            count += n
            pos = cur.pos()
        writer.close()
        return _Piece(marks, count, pos, cur.state())
    except BaseException as e:
        if marks_out is not None and not marks_out.done():
            marks_out.set_exception(e)  # the assembling thread may be waiting on it
        raise


def _join(cur: _Cursor, marks: list[int], dtype: type) -> tuple[int | None, np.ndarray]:
    """From cur (the true stream, on a boundary at or past the next piece's start), draw single normals until
    it stands on one of that piece's marks. Returns (the index of the piece's first true value, or None when
    the true stream passed its marks without meeting them; the values drawn meanwhile)."""
    where = {m: j for j, m in enumerate(marks)}
    vals: list[np.ndarray] = []
    buf = np.empty(1, dtype=np.float64)
    pos = cur.pos()
    while pos not in where and pos < marks[-1]:
        one = ArrayWriter(np.empty(1, dtype=dtype))
        _emit(cur, buf, one, 0, 1)
        vals.append(one.arr)
        pos = cur.pos()
    got = np.concatenate(vals) if vals else np.empty(0, dtype=dtype)
    return where.get(pos), got


def draw_pool(block_hash: str, size: int, sink: PoolSink, workers: int | None = None, *, chunk: int = CHUNK,
              min_raw: int = MIN_RAW_PER_WORKER, n_marks: int = MARKS, raw_per_normal: float = RAW_PER_NORMAL) -> int:
    """Draw v1's pool of `size` values into `sink` with `workers` threads; returns how many threads drew pieces.

    Pieces are placed in order as soon as each is done and its predecessors are stitched, so a sink can copy
    piece k while later ones are still being drawn. min_raw, n_marks and raw_per_normal are there for the
    tests: tiny worker ranges so that boundaries fall inside normals, no marks to force the fallback, and
    workers that draw past `size`.
    """
    workers = pool_workers(workers)
    raw_total = int(size * raw_per_normal) - 64
    k_n = min(workers, raw_total // max(1, min_raw)) if raw_total > 0 else 0
    r = raw_total // k_n if k_n else 0
    base = v1.get_rng(block_hash, 4).bit_generator.state
    cur = _Cursor(base, 0)
    dst = 0
    if k_n:
        writers = [sink.open(k, r) for k in range(k_n)]
        marks = [Future() for _ in range(k_n)]
        with ThreadPoolExecutor(k_n, thread_name_prefix="pool") as ex:
            futs = [ex.submit(_draw_range, _Cursor(base, 0, k * r), (k + 1) * r, writers[k], chunk, n_marks, marks[k])
                    for k in range(k_n)]
            first: int | None = 0  # index of piece k's first true value; None: it must be drawn again
            for k in range(k_n):
                piece = futs[k].result()
                if first is None:
                    pool_stats["fallbacks"] += 1
                    piece = _draw_range(cur, (k + 1) * r, sink.open(k, max(0, (k + 1) * r - cur.pos())), chunk, 0)
                    first = 0
                n = max(0, min(piece.count - first, size - dst))
                sink.place(k, first, n, dst)
                dst += n
                cur = _Cursor(piece.end_state, piece.end)
                if k + 1 < k_n:
                    nxt = marks[k + 1].result()
                    if piece.end != nxt[0]:
                        pool_stats["straddles"] += 1
                    first, vals = _join(cur, nxt, sink.dtype)
                    pool_stats["join_draws"] += len(vals)
                    vals = vals[:max(0, size - dst)]
                    sink.put(dst, vals)
                    dst += len(vals)
    buf = np.empty(max(1, min(chunk, size - dst)), dtype=np.float64)
    tail = ArrayWriter(np.empty(len(buf), dtype=sink.dtype))
    while dst < size:
        n = min(len(buf), size - dst)
        _emit(cur, buf, tail, 0, n)
        sink.put(dst, tail.arr[:n])
        dst += n
    return k_n


def weight_pool_parallel(block_hash: str, size: int, workers: int | None = None, **kw) -> np.ndarray:
    """v1.weight_pool(block_hash, size), drawn by `workers` threads (default: pool_workers())."""
    sink = HostSink(size)
    draw_pool(block_hash, size, sink, workers, **kw)
    return sink.out
