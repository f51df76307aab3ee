"""Will a job fit in memory? A coarse, conservative estimate checked before any work, so that a request
whose model or batch cannot fit gets a 422 with the numbers instead of an out-of-memory crash mid-job.

v1: weights = (total_params - vocab*dim) * dtype bytes (the token embedding is never materialised: inputs
are embeddings), plus the float32 weight pool the builder draws from, plus activations. Activations for a
forward of B sequences of S tokens: B*S*(6*dim + 3*ffn_dim + n_heads*S) float32 values (q/k/v/o and
residuals, the SwiGLU branches, one layer's attention scores), plus the host inputs and permutations.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from poc.errors import InputError
from poc.protocol import v1

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
GiB = 1 << 30


@dataclass(frozen=True)
class Estimate:
    weights: int = 0
    pool: int = 0
    activations: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.pool + self.activations + self.host

    def describe(self) -> str:
        return (f"weights {self.weights / GiB:.2f} GiB + pool {self.pool / GiB:.2f} GiB + "
                f"activations {self.activations / GiB:.2f} GiB + host buffers {self.host / GiB:.2f} GiB")


def activation_bytes(batch: int, seq_len: int, dim: int, ffn_dim: int, n_heads: int) -> int:
    return batch * seq_len * (dim * 6 + ffn_dim * 3 + n_heads * seq_len) * 4


def v1_total_params(p: v1.V1Params) -> int:
    """V1Params.total_params in closed form (that one walks every layer: slow for absurd n_layers)."""
    D, hd, F = p.dim, p.head_dim, p.ffn_dim
    per_layer = 2 * p.n_heads * hd * D + 2 * p.n_kv_heads * hd * D + 3 * F * D + 2 * D
    return 2 * p.vocab_size * D + p.n_layers * per_layer + D


def v1_weight_bytes(p: v1.V1Params, dtype: str) -> tuple[int, int]:
    """(model weights, float32 pool) in bytes."""
    total = v1_total_params(p)
    return (total - p.vocab_size * p.dim) * DTYPE_BYTES[dtype], 4 * v1.pool_size(total)


def v1_estimate(p: v1.V1Params, batch_size: int, dtype: str) -> Estimate:
    w, pool = v1_weight_bytes(p, dtype)
    act = activation_bytes(batch_size, p.seq_len, p.dim, p.ffn_dim, p.n_heads)
    # float64 normals + their fp16 copy; int64 permutations; float32 logits and their normalised copy
    host = batch_size * (p.seq_len * p.dim * 10 + p.vocab_size * 16)
    return Estimate(weights=w, pool=pool, activations=act, host=host)


def v2_estimate(cfg, batch_size: int, seq_len: int) -> Estimate:
    """The checkpoint is already loaded: only activations count (cfg is a poc.model ModelConfig)."""
    return Estimate(activations=activation_bytes(batch_size, seq_len, cfg.dim, cfg.ffn_dim, cfg.n_heads))


def available_bytes(device: torch.device) -> int:
    """Free memory where the job runs: the GPU's free memory, or MemAvailable on the host."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse


def check_fits(est: Estimate, device: torch.device, *, reclaimable: int = 0, headroom: float = 0.9,
               field: str = "params") -> None:
    """InputError(422) when `est` exceeds `headroom` of the free memory (+ what the job would free first)."""
    free = available_bytes(device) + reclaimable
    if est.total > headroom * free:
        raise InputError(
            f"this job needs about {est.total / GiB:.2f} GiB on {device} ({est.describe()}), but only "
            f"{free / GiB:.2f} GiB is free: use smaller params, seq_len or batch_size", field, status=422)
