"""One batch of nonces through one model on one device: inputs -> forward -> post-process -> small results.

`V1Compute` holds a random model for (params, block_hash, dtype); `V2Compute` holds a loaded checkpoint.
Both split a batch into `prepare` (host work: seeds, numpy RNG; safe to run on another thread while the
device is busy with the previous batch) and `run` (device work), so the runner can overlap them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from poc.model.random_init import build_v1_model
from poc.protocol import v1, v2

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        from poc.errors import InputError
        raise InputError("--device cuda was asked for, but CUDA is not available here", "device")
    return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --------------------------------------------------------------------------------------------------
# v1


@dataclass
class V1Prepared:
    nonces: list[int]
    x: torch.Tensor  # (B, S, D) float16, host (pinned on CUDA)
    perms: torch.Tensor  # (B, V) int64, host


class V1Compute:
    """The v1 random model for one (params, block_hash, dtype), plus its target vector."""

    def __init__(self, params: v1.V1Params, block_hash: str, dtype: torch.dtype, device: torch.device):
        self.params, self.block_hash, self.dtype, self.device = params, block_hash, dtype, device
        t0 = time.perf_counter()
        self.model = build_v1_model(params, block_hash, dtype, device)
        self.target = torch.from_numpy(v1.target(block_hash, params.vocab_size)).to(device)  # float64
        _sync(device)
        self.build_seconds = time.perf_counter() - t0

    def key(self) -> tuple:
        return (self.params, self.block_hash, self.dtype)

    def prepare(self, public_key: str, nonces: Sequence[int]) -> V1Prepared:
        p = self.params
        x = torch.from_numpy(v1.input_embeddings(self.block_hash, public_key, nonces, p.seq_len, p.dim))
        perms = torch.from_numpy(v1.permutations(self.block_hash, public_key, nonces, p.vocab_size))
        if self.device.type == "cuda":
            x, perms = x.pin_memory(), perms.pin_memory()
        return V1Prepared(list(nonces), x, perms)

    @torch.inference_mode()
    def run(self, prep: V1Prepared) -> np.ndarray:
        """float64 distances, one per nonce."""
        x = prep.x.to(self.device, non_blocking=True).to(self.dtype)  # fp16 first, as the reference
        logits = self.model(x, last_only=True, logits=True)  # (B, V) float32
        return self.distances(logits, prep.perms.to(self.device, non_blocking=True))

    def distances(self, logits: torch.Tensor, perms: torch.Tensor) -> np.ndarray:
        p = torch.gather(logits.float(), 1, perms)
        u = p / torch.linalg.vector_norm(p, dim=1, keepdim=True)  # float32, as the reference
        d = torch.linalg.vector_norm(u.double() - self.target[None, :], dim=1)
        return d.cpu().numpy()


# --------------------------------------------------------------------------------------------------
# v2


@dataclass
class V2Prepared:
    nonces: list[int]
    plan: v2.PostProcessPlan
    seq_len: int
    k_dim: int
    stronger_rng: bool
    public_key: str
    block_hash: str


class V2Compute:
    """A loaded checkpoint; computes artifacts for any (block_hash, public_key, nonces, seq_len, k_dim)."""

    def __init__(self, model, cfg, dtype: torch.dtype, device: torch.device, name: str):
        self.model, self.cfg, self.dtype, self.device, self.name = model, cfg, dtype, device, name
        self._vectors: tuple[str, torch.Tensor] | None = None

    def reflections(self, block_hash: str) -> torch.Tensor:
        if self._vectors is None or self._vectors[0] != block_hash:
            v = v2.layer_vectors(block_hash, self.cfg.n_layers, self.cfg.dim, self.device)
            self._vectors = (block_hash, v.to(self.dtype))
        return self._vectors[1]

    def prepare(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                stronger_rng: bool = False) -> V2Prepared:
        pl = v2.plan(block_hash, public_key, nonces, self.cfg.dim, k_dim, "cpu")
        if self.device.type == "cuda":
            pl = v2.PostProcessPlan(pl.pick.pin_memory(), pl.haar.pin_memory())
        return V2Prepared(list(nonces), pl, seq_len, k_dim, stronger_rng, public_key, block_hash)

    @torch.inference_mode()
    def vectors(self, prep: V2Prepared) -> torch.Tensor:
        """(B, k) float32 unit vectors on the device."""
        x = v2.inputs(prep.block_hash, prep.public_key, prep.nonces, prep.seq_len, self.cfg.dim,
                      self.dtype, self.device, prep.stronger_rng)
        h = self.model(x, reflections=self.reflections(prep.block_hash), last_only=True)
        pl = v2.PostProcessPlan(prep.plan.pick.to(self.device, non_blocking=True),
                                prep.plan.haar.to(self.device, non_blocking=True))
        return v2.project(h, pl)

    def run(self, prep: V2Prepared) -> tuple[list[dict], list[int]]:
        """(artifacts, nonces dropped for NaN/Inf)."""
        return v2.artifacts(prep.nonces, self.vectors(prep))
