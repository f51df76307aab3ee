"""Jobs and results: the plain data the server and the engine share (nothing else crosses)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from poc.protocol.v1 import V1Params


@dataclass
class Limits:
    max_nonces: int | None = None  # stop after this many nonces were computed
    max_duration: float | None = 420.0  # seconds, as the reference's MAX_JOB_DURATION


@dataclass
class V1Job:
    block_hash: str
    public_key: str
    block_height: int
    params: V1Params
    r_target: float
    nonces: Iterator[int]
    batch_size: int
    dtype: str = "float16"  # what validators run (spec-v1 §1.8)
    limits: Limits = field(default_factory=Limits)

    protocol = "v1"


@dataclass
class V2Job:
    block_hash: str
    public_key: str
    block_height: int
    seq_len: int
    k_dim: int
    nonces: Iterator[int]
    batch_size: int
    stronger_rng: bool = False
    limits: Limits = field(default_factory=Limits)

    protocol = "v2"


@dataclass
class BatchResult:
    """One computed batch. v1 fills `dist` (every nonce, unfiltered); v2 fills `artifacts`."""

    index: int  # 1-based batch number within the job
    nonces: list[int]  # every nonce computed in this batch, in order
    elapsed: float  # seconds since the job started
    batch_seconds: float  # wall time of this batch's device work
    dist: np.ndarray | None = None
    artifacts: list[dict] | None = None
    dropped: list[int] = field(default_factory=list)  # v2 nonces whose vector was NaN/Inf


@dataclass
class JobSummary:
    reason: str  # "stopped", "max_nonces", "max_duration", "exhausted", "error"
    batches: int
    computed: int
    elapsed: float
    error: str | None = None
    error_type: str | None = None


def take(it: Iterator[int], n: int) -> list[int]:
    return list(itertools.islice(it, n))
