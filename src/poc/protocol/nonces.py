"""Nonce lattices: every nonce layout the protocols use is first, first + step, first + 2·step, ... (up to an end).

- v1 /generate: worker_nonces(start, w, W) = Lattice(start + w, W);
- pow (v1 and v2): node_nonces(node_id, node_count, group_id, n_groups) = Lattice(node_id + group_id·node_count,
  n_groups·node_count), and stride_nonces(start, ...) the same from the first of its nonces >= start;
- /pooled: range_nonces(a, b, g, G) = Lattice(a + g, G, end=b).
Nonces are int64 on the device: MAX_NONCE ends every job. A Gonka node stores PoC v2 nonces as int32, so its
generation ends at MAX_INT32.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator

from poc.errors import InputError

MAX_NONCE = (1 << 63) - 1  # int64
MAX_INT32 = (1 << 31) - 1  # the node's artifact store keys nonces by int32


@dataclass(frozen=True)
class Lattice:
    """first, first + step, first + 2·step, ... up to `end` inclusive (None: endless), as picklable data."""

    first: int
    step: int = 1
    end: int | None = None

    def __post_init__(self):
        if self.step < 1:
            raise InputError(f"a nonce stream needs step >= 1, got {self.step}", "nonces")

    def __iter__(self) -> Iterator[int]:
        n = self.first
        while self.end is None or n <= self.end:
            yield n
            n += self.step

    def split(self, n_parts: int) -> list["Lattice"]:
        """Part r of R takes every R-th element from the r-th on: disjoint, and together the whole lattice.

        In pow's terms part r is group group_id + r·n_groups of n_groups·R (not group_id·R + r, which leaves the
        node's lattice when n_groups > 1)."""
        return [Lattice(self.first + r * self.step, self.step * n_parts, self.end) for r in range(n_parts)]


def worker_nonces(start_nonce: int, worker_id: int, n_workers: int) -> Iterator[int]:
    """The seed's /generate layout: the k-th nonce of a worker is start + worker_id + k·n_workers."""
    return iter(Lattice(start_nonce + worker_id, n_workers))


def node_nonces(node_id: int, n_nodes: int, group_id: int = 0, n_groups: int = 1) -> Iterator[int]:
    """pow's layout: node_id + group_id·n_nodes + k·(n_groups·n_nodes)."""
    return iter(Lattice(node_id + group_id * n_nodes, n_groups * n_nodes))


def range_nonces(range_start: int, range_end: int, gpu_id: int = 0, n_gpus: int = 1) -> Iterator[int]:
    """/pooled: range_start + gpu_id + k·n_gpus while ≤ range_end (both ends inclusive)."""
    return iter(Lattice(range_start + gpu_id, n_gpus, range_end))


def stride_nonces(start: int, node_id: int, node_count: int, group_id: int, n_groups: int,
                  end: int = MAX_NONCE) -> Iterator[int]:
    """The node's nonces (pow's layout) from `start` on, up to `end` (inclusive).

    start_nonce does not shift the lattice: it skips the node's nonces below it, so nodes stay disjoint
    whatever start each one is given, and a job resumes exactly at the `next_nonce` a previous one reported.
    """
    base = node_id + group_id * node_count
    stride = node_count * n_groups
    k = max(0, -(-(start - base) // stride))  # ceil((start - base) / stride)
    return iter(Lattice(base + k * stride, stride, end))


def upto_max_nonce(nonces: Iterator[int]) -> Iterator[int]:
    """`nonces` while they fit in int64: a job ends there."""
    return itertools.takewhile(lambda n: n <= MAX_NONCE, nonces)
