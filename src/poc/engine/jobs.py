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


def steady_rate(times: list[float], sizes: list[int], skip: int = 1) -> float:
    """Nonces a second from result arrivals (time, nonces) after the first `skip` results: from the arrival of the
    skip-th to the last. `skip` is at least the number of replicas: each replica's first result carries its compile
    or its pipeline's fill, and it was computed before the window opens (timed from the first arrival, the other
    replicas' first results would count as work inside it, one batch a replica too many). NaN when fewer than
    skip + 1 results arrived."""
    if skip < 1 or len(times) <= skip or times[-1] <= times[skip - 1]:
        return float("nan")
    return sum(sizes[skip:]) / (times[-1] - times[skip - 1])


def batches_ahead(pp: int = 1) -> int:
    """How many batches an engine keeps dealt and not yet reported, per replica: its pp stages compute one each, one
    more is the result on its way back through the consumer (emit) and one waits ready (prepared on one device,
    queued at the leader of rank processes), so the first stage's next batch is always there when it asks (the
    consumer's round trip is off the devices' path). One device: one computed, one collected, one prepared."""
    return pp + 2


class Dealer:
    """The dealing rule of every engine: a job's nonces go out a batch at a time, consecutive pieces of its one
    iterator, batch_size each and the last cut at max_nonces, so whoever computes them (one device, or replicas in
    any order) computes together exactly the job's stream (the pow lattice, /pooled ranges, explicit lists alike),
    each nonce once, and max_nonces stays exact. A job starts with `ahead` (batches_ahead(pp)) batches a replica,
    dealt in turn (`first`); after that each result's replacement goes to the replica that reported it, so a faster
    replica takes more."""

    def __init__(self, job: V1Job | V2Job, replicas: int = 1, pp: int = 1):
        self.job, self.replicas, self.ahead = job, replicas, batches_ahead(pp)
        self.taken = 0  # nonces dealt

    def first(self) -> list[int]:
        """The replicas the first batches go to, in order: `ahead` rounds of one each."""
        return [r for _ in range(self.ahead) for r in range(self.replicas)]

    def next(self) -> list[int]:
        """The next batch's nonces; [] once the iterator or max_nonces is done. The iterator's errors propagate."""
        lim = self.job.limits
        n = self.job.batch_size if lim.max_nonces is None else min(self.job.batch_size, lim.max_nonces - self.taken)
        nonces = take(self.job.nonces, n) if n > 0 else []
        self.taken += len(nonces)
        return nonces
