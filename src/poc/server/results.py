"""Result bodies, built in one place: what a computed batch becomes in a stream line, a callback or a reply.

PoC v1 keeps the nonces with `dist < r_target` (spec-v1 §4.1); PoC v2 reports every finite artifact, and the
nonces whose vector was NaN/Inf as `dropped_nonces` (spec-v2 §f 7).
"""

from __future__ import annotations

import numpy as np

from poc.engine.jobs import BatchResult, V1Job, V2Job
from poc.protocol import v1, v2
from poc.server.stream import JobRunner


def v1_hits(b: BatchResult, r_target: float) -> tuple[list[int], list[float]]:
    """The batch's nonces under r_target and their distances, in the batch's order."""
    keep = np.flatnonzero(v1.valid(b.dist, r_target))
    return [b.nonces[i] for i in keep], [float(b.dist[i]) for i in keep]


def v2_body(b: BatchResult, k_dim: int) -> dict:
    """{"artifacts", "encoding"[, "dropped_nonces"]} of one batch."""
    d = {"artifacts": list(b.artifacts or []), "encoding": v2.encoding(k_dim)}
    if b.dropped:
        d["dropped_nonces"] = list(b.dropped)
    return d


class V1Lines:
    """spec-v1 §4.1 batch lines: only batches with a nonce under r_target, keys in the reference's order."""

    def __init__(self, job: V1Job):
        self.job, self.emitted = job, 0

    def line(self, b: BatchResult, runner: JobRunner) -> dict | None:
        nonces, dist = v1_hits(b, self.job.r_target)
        if not nonces:
            return None
        self.emitted += 1
        s, j = runner.stats, self.job
        return {"worker_id": 0, "public_key": j.public_key, "block_hash": j.block_hash, "block_height": j.block_height,
                "nonces": nonces, "dist": dist, "node_id": 0,
                "batch_number": self.emitted, "batch_computed": len(b.nonces), "batch_valid": len(nonces),
                "total_computed": s.computed, "total_valid": s.valid, "elapsed_seconds": int(b.elapsed),
                "next_nonce": s.next_nonce, "aggregated_batch_number": self.emitted,
                "aggregated_total_computed": s.computed, "aggregated_total_valid": s.valid, "n_workers": 1}


class V2Lines:
    def __init__(self, job: V2Job, node_id: int):
        self.job, self.node_id = job, node_id

    def line(self, b: BatchResult, runner: JobRunner) -> dict:
        j = self.job
        return {"public_key": j.public_key, "block_hash": j.block_hash, "block_height": j.block_height,
                "node_id": self.node_id, "batch_number": b.index, **v2_body(b, j.k_dim)}
