"""PoC v1 inputs and permutations made by a pool of processes, written straight into shared memory.

numpy's PCG64 streams cannot be split or moved to the GPU bit-exactly, and numpy holds the GIL while it draws,
so the per-nonce normals (S x D of them: 2.1M for seq 1024 x dim 2048) are drawn by worker processes, one
nonce per task. A batch lands in one of a few shared-memory slots; the engine wraps the slot as tensors.
The workers round the float64 normals to float16 through float32, as the reference's torch conversion does
(`v1.input_normals32`, then float32 -> float16): the same bytes and about the same CPU time as numpy's direct cast.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
from concurrent.futures import ProcessPoolExecutor, wait
from multiprocessing import shared_memory

import numpy as np

from poc.protocol import v1


SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux (a container's default is only 64 MB)


class PoolUnavailable(RuntimeError):
    """The slots do not fit in shared memory: the caller draws the inputs in its own process instead."""


def _fill(shm_name: str, shape_x: tuple, shape_p: tuple, off_p: int, rows: list[tuple[int, int]],
          block_hash: str, public_key: str) -> None:
    """Worker: for each (row, nonce), draw the inputs (fp16) and the permutation into the slot."""
    shm = shared_memory.SharedMemory(name=shm_name)
    try:
        x = np.ndarray(shape_x, dtype=np.float16, buffer=shm.buf)
        p = np.ndarray(shape_p, dtype=np.int64, buffer=shm.buf, offset=off_p)
        buf = np.empty(shape_x[1:], dtype=np.float64)
        tmp = np.empty(shape_x[1:], dtype=np.float32)
        for row, nonce in rows:
            v1.input_normals32(block_hash, public_key, nonce, tmp, buf)
            x[row] = tmp  # the second rounding
            p[row] = v1.get_rng(v1.permutation_seed(block_hash, public_key, nonce), 1).permutation(shape_p[1])
        del x, p
    finally:
        shm.close()


def check_shm(need: int) -> None:
    """Refuse slots that /dev/shm cannot hold: the pages are only allocated when a worker writes them, so a too
    small /dev/shm (Docker's default 64 MB) would kill the workers with SIGBUS in the middle of a batch."""
    try:
        free = shutil.disk_usage(SHM_DIR).free
    except OSError:
        return  # no /dev/shm to ask (not Linux): nothing known to check against
    if need > free * 0.9:
        raise PoolUnavailable(f"the v1 input slots need {need / 2**30:.2f} GiB of shared memory, {SHM_DIR} has "
                              f"{free / 2**30:.2f} GiB free (docker run --shm-size, e.g. 16g)")


def make_executor(workers: int) -> ProcessPoolExecutor:
    """Worker processes, started now (spawn: the parent may hold CUDA and threads, which fork would copy into a
    broken state), so the first job does not wait for interpreters to boot."""
    ex = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"))
    wait([ex.submit(_ping) for _ in range(workers)])
    return ex


def _ping() -> int:
    return os.getpid()


class V1InputPool:
    """`workers` processes and `slots` shared buffers of (batch, S, D) fp16 + (batch, V) int64."""

    def __init__(self, batch: int, seq_len: int, dim: int, vocab: int, workers: int | None = None, slots: int = 3,
                 executor: ProcessPoolExecutor | None = None):
        self.batch, self.shape_x, self.shape_p = batch, (batch, seq_len, dim), (batch, vocab)
        nx = batch * seq_len * dim * 2
        self.off_p = (nx + 63) // 64 * 64
        size = self.off_p + batch * vocab * 8
        check_shm(size * slots)
        self.slots = [shared_memory.SharedMemory(create=True, size=size) for _ in range(slots)]
        self.next_slot = 0
        self.workers = workers or max(1, min(32, (os.cpu_count() or 2) - 2))
        self._own = executor is None
        self.pool = executor or make_executor(self.workers)

    def fill(self, block_hash: str, public_key: str, nonces: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """Views (len(nonces), S, D) fp16 and (len(nonces), V) int64 of the next slot, filled."""
        if len(nonces) > self.batch:
            raise ValueError(f"{len(nonces)} nonces do not fit a slot of {self.batch}")
        shm = self.slots[self.next_slot]
        self.next_slot = (self.next_slot + 1) % len(self.slots)
        rows = list(enumerate(nonces))
        chunk = max(1, len(rows) // (self.workers * 2))  # a few tasks per worker balance the load
        futs = [self.pool.submit(_fill, shm.name, self.shape_x, self.shape_p, self.off_p, rows[i:i + chunk],
                                 block_hash, public_key) for i in range(0, len(rows), chunk)]
        wait(futs)
        for f in futs:
            f.result()  # re-raise a worker's error here
        x = np.ndarray(self.shape_x, dtype=np.float16, buffer=shm.buf)[:len(nonces)]
        p = np.ndarray(self.shape_p, dtype=np.int64, buffer=shm.buf, offset=self.off_p)[:len(nonces)]
        return x, p

    def close(self) -> None:
        if self._own:
            self.pool.shutdown(wait=True, cancel_futures=True)
        for s in self.slots:
            s.close()
            s.unlink()
        self.slots = []
