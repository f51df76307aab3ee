"""PoC v2: murmur-hash inputs, layer reflection vectors, the k-dim pick, the rotation, fp16 encoding, validation.

Follows ../shared/spec/poc-v2.md (§a, §b vectors, §c, §d). The generators are torch code that runs on any
device, so inputs are made where the model runs (no host round trip). Integer hashing is int64 with
masking to 32 bits: products wrap mod 2^64, which keeps the low 32 bits exact.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from poc.protocol.stats import fraud_test

DEFAULT_K_DIM = 12
DEFAULT_BATCH_SIZE = 32
# Validation defaults of the reference (spec-v2 §d). The chain is expected to pass its own stat_test.
DEFAULT_DIST_THRESHOLD = 0.02
DEFAULT_P_MISMATCH = 0.001
DEFAULT_FRAUD_THRESHOLD = 0.01
ENCODING_DTYPE = "f16"

_M32 = 0xFFFFFFFF
_TWO_PI_F32 = 6.2831855  # 2π as float32
_U32_SCALE = 4294967296.0  # 2^32


def encoding(k_dim: int) -> dict:
    return {"dtype": ENCODING_DTYPE, "k_dim": k_dim, "endian": "le"}


# --------------------------------------------------------------------------------------------------
# seeds and the hash (§a.1, §a.2)


def seed32(s: str) -> int:
    """First 4 bytes of sha256(utf8(s)) as a big-endian u32."""
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:4], "big")


def seeds256(s: str) -> list[int]:
    """The 8 big-endian u32 words of sha256(s) (the "stronger RNG" sub-seeds; word 0 is seed32)."""
    d = hashlib.sha256(s.encode()).digest()
    return [int.from_bytes(d[4 * j:4 * j + 4], "big") for j in range(8)]


def _rotl(x: torch.Tensor, r: int) -> torch.Tensor:
    return ((x << r) | (x >> (32 - r))) & _M32


def murmur(keys: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The protocol's MurmurHash3_x86_32 variant (no `h ^= 4` step), broadcast over keys and seeds.

    keys, seeds: int64 tensors holding u32 values. Returns int64 in [0, 2^32)."""
    k = (keys * 0xCC9E2D51) & _M32
    k = _rotl(k, 15)
    k = (k * 0x1B873593) & _M32
    h = seeds ^ k
    h = _rotl(h, 13)
    h = (h * 5 + 0xE6546B64) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _seed_tensor(seeds: Sequence[int] | int, device) -> torch.Tensor:
    if isinstance(seeds, int):
        seeds = [seeds]
    return torch.tensor(list(seeds), dtype=torch.int64, device=device).view(-1, 1)


def uniforms(seeds: Sequence[int] | int, n: int, device="cpu") -> torch.Tensor:
    """(len(seeds), n) float32 uniforms u_i = f32(murmur(i, seed)) / 2^32 for i < n."""
    keys = torch.arange(n, dtype=torch.int64, device=device).view(1, -1)
    return murmur(keys, _seed_tensor(seeds, device)).to(torch.float32) / _U32_SCALE


def normals(seeds: Sequence[int] | int, n: int, device="cpu") -> torch.Tensor:
    """(len(seeds), n) float32 normals by Box-Muller on the half-split uniforms (§a.4)."""
    return _normals_t(_seed_tensor(seeds, device), n)


# --------------------------------------------------------------------------------------------------
# inputs (§a.5, §a.6) and layer vectors (§b)


def input_seed_string(block_hash: str, public_key: str, nonce: int) -> str:
    return f"{block_hash}_{public_key}_nonce{nonce}"  # no underscore before the number


def input_seeds(block_hash: str, public_key: str, nonces: Sequence[int], stronger_rng: bool = False) -> torch.Tensor:
    """Host-side seeds of the inputs: (B,) for the legacy RNG, (B, 8) sub-seeds for the stronger one."""
    strings = [input_seed_string(block_hash, public_key, x) for x in nonces]
    if stronger_rng:
        return torch.tensor([seeds256(s) for s in strings], dtype=torch.int64).view(len(strings), 8)
    return torch.tensor([seed32(s) for s in strings], dtype=torch.int64)


def hash_keys(n: int, device="cpu") -> torch.Tensor:
    """The element indices 0..2*ceil(n/2)-1 as int64, made outside compiled code (inductor would index them in
    int32 and overflow on the hash constants)."""
    return torch.arange(2 * ((n + 1) // 2), dtype=torch.int64, device=device)


def inputs_from_seeds(seeds: torch.Tensor, seq_len: int, hidden: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    """(B, S, H) float32 inputs from `input_seeds` (on any device; pure tensor code, so it compiles).

    keys: hash_keys(seq_len * hidden) on the same device (made here when not given)."""
    n = seq_len * hidden
    if keys is None:
        keys = hash_keys(n, seeds.device)
    if seeds.dim() == 1:
        x = _normals_t(seeds.view(-1, 1), n, keys)
    else:  # stronger RNG: 8 segments of ceil(n/8), each with its own sub-seed and Box-Muller split
        seg = (n + 7) // 8
        parts = []
        for j in range(8):
            lo, hi = j * seg, min((j + 1) * seg, n)
            if lo >= n:
                break
            parts.append(_normals_t(seeds[:, j:j + 1], hi - lo, keys))
        x = torch.cat(parts, dim=1)
    return x.view(seeds.shape[0], seq_len, hidden)


def _normals_t(seeds: torch.Tensor, n: int, keys: torch.Tensor | None = None) -> torch.Tensor:
    m = (n + 1) // 2
    if keys is None:
        keys = hash_keys(n, seeds.device)
    u = murmur(keys[:2 * m].view(1, -1), seeds).to(torch.float32) / _U32_SCALE
    u1 = u[:, :m].clamp_min(1e-10)
    theta = _TWO_PI_F32 * u[:, m:]
    r = torch.sqrt(-2.0 * torch.log(u1))
    return torch.cat([r * torch.cos(theta), r * torch.sin(theta)], dim=1)[:, :n]


def inputs(block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, hidden: int,
           dtype: torch.dtype = torch.float32, device="cpu", stronger_rng: bool = False) -> torch.Tensor:
    """(B, S, H) input embeddings, generated in float32 on `device`, then cast to `dtype`."""
    seeds = input_seeds(block_hash, public_key, nonces, stronger_rng).to(device)
    return inputs_from_seeds(seeds, seq_len, hidden).to(dtype)


def layer_vectors(block_hash: str, n_layers: int, hidden: int, device="cpu") -> torch.Tensor:
    """(L, H) float32 unit vectors v_i from seed f"{bh}_layer_{i}_householder"."""
    v = normals([seed32(f"{block_hash}_layer_{i}_householder") for i in range(n_layers)], hidden, device)
    return v / v.norm(dim=1, keepdim=True)


# --------------------------------------------------------------------------------------------------
# post-processing (§c): normalise, pick in the CUDA order, rotate, normalise, encode


def pick_indices(block_hash: str, public_key: str, nonces: Sequence[int], hidden: int, k: int,
                 device="cpu") -> torch.Tensor:
    """(B, k) int64: the k smallest murmur scores in the order CUDA's topk(sorted=False) returns them:
    indices strictly below the k-th smallest score ascending, then those equal to it ascending.
    Computed explicitly, so every device (CPU included) gives the network's order."""
    if not 1 <= k <= hidden:
        raise ValueError(f"k_dim must be in [1, {hidden}], got {k}")
    seeds = [seed32(f"{block_hash}_{public_key}_nonce_{n}_pick_{k}") for n in nonces]
    keys = torch.arange(hidden, dtype=torch.int64, device=device).view(1, -1)
    scores = murmur(keys, _seed_tensor(seeds, device))
    kth = scores.kthvalue(k, dim=1, keepdim=True).values
    cls = (scores > kth).to(torch.int64) * 2 + (scores == kth).to(torch.int64)  # 0 below, 1 boundary, 2 above
    order = torch.sort(cls, dim=1, stable=True).indices
    return order[:, :k]


def haar_vectors(block_hash: str, public_key: str, nonces: Sequence[int], k: int, device="cpu") -> torch.Tensor:
    """(B, k-1, k) float32 unit directions of the k-1 Householder steps."""
    if k < 2:
        return torch.zeros((len(nonces), 0, k), dtype=torch.float32, device=device)
    seeds = [seed32(f"{block_hash}_{public_key}_nonce_{n}_haar_hh_{k}_{j}") for n in nonces for j in range(k - 1)]
    v = normals(seeds, k, device).view(len(nonces), k - 1, k)
    return v / (v.norm(dim=2, keepdim=True) + 1e-30)


@dataclass
class PostProcessPlan:
    """Everything post-processing needs for a batch of nonces, derived from the seeds (host work only)."""

    pick: torch.Tensor  # (B, k) int64
    haar: torch.Tensor  # (B, k-1, k) float32


def plan(block_hash: str, public_key: str, nonces: Sequence[int], hidden: int, k: int, device="cpu") -> PostProcessPlan:
    return PostProcessPlan(pick_indices(block_hash, public_key, nonces, hidden, k, device),
                           haar_vectors(block_hash, public_key, nonces, k, device))


def project(h: torch.Tensor, p: PostProcessPlan) -> torch.Tensor:
    """(B, H) final-norm last-position states -> (B, k) float32 unit vectors (before fp16 rounding)."""
    return project_tensors(h, p.pick, p.haar)


def project_tensors(h: torch.Tensor, pick: torch.Tensor, haar: torch.Tensor) -> torch.Tensor:
    """`project` on plain tensors (what the compiled path calls)."""
    h = h.to(torch.float32)
    h = h / (h.norm(dim=1, keepdim=True) + 1e-8)
    y = torch.gather(h, 1, pick)
    for j in range(haar.shape[1]):
        v = haar[:, j]
        y = y - 2 * (y * v).sum(dim=1, keepdim=True) * v
    return y / (y.norm(dim=1, keepdim=True) + 1e-8)


def encode(vec: np.ndarray | torch.Tensor) -> str:
    """float vector -> IEEE fp16 little-endian bytes -> standard base64."""
    if isinstance(vec, torch.Tensor):
        vec = vec.detach().to("cpu", torch.float32).numpy()
    return base64.b64encode(np.asarray(vec, dtype="<f2").tobytes()).decode("ascii")


def decode(b64: str) -> np.ndarray:
    """base64 fp16 little-endian -> float32; ValueError on malformed input."""
    raw = base64.b64decode(b64, validate=True)
    if len(raw) % 2:
        raise ValueError(f"odd byte count {len(raw)}")
    return np.frombuffer(raw, dtype="<f2").astype(np.float32)


def artifacts(nonces: Sequence[int], vecs: torch.Tensor) -> tuple[list[dict], list[int]]:
    """Encode (B, k) vectors; rows with NaN/Inf are dropped (returned as the second list) rather than sent."""
    v16 = vecs.detach().to("cpu", torch.float32).numpy().astype("<f2")
    ok = np.isfinite(v16).all(axis=1)
    out, bad = [], []
    for n, row, good in zip(nonces, v16, ok):
        if good:
            out.append({"nonce": int(n), "vector_b64": base64.b64encode(row.tobytes()).decode("ascii")})
        else:
            bad.append(int(n))
    return out, bad


# --------------------------------------------------------------------------------------------------
# validation (§d), with the reference's leniencies fixed (§f 8)


MAX_UNSCORED_FRAC = 0.1  # past this share of a request left unscored the validator itself is suspect: no verdict


class NoVerdict(ValueError):
    """Too many requested nonces could not be scored by the validator: it gives no verdict at all."""


@dataclass
class StatTest:
    dist_threshold: float = DEFAULT_DIST_THRESHOLD
    p_mismatch: float = DEFAULT_P_MISMATCH
    fraud_threshold: float = DEFAULT_FRAUD_THRESHOLD


def validate(computed: dict[int, str], received: dict[int, str], nonces: Sequence[int], k_dim: int,
             stat: StatTest) -> dict:
    """Compare received artifacts with the validator's own, as the deployed validators score them (the vLLM plugin
    0.1.3): a nonce the validator could not compute (NaN/Inf, so no artifact) proves nothing either way and leaves
    the sample (`excluded_nonces`; `n_total` counts the scored nonces); more of them than 10% of the request (at
    least one is always tolerated, as there) raises NoVerdict, as does a request with no nonce scored at all (the
    node would read n_total 0 as a failed validation).

    Unlike the plugin (which skips them yet counts them in n_total), a missing, empty or undecodable received
    vector is a mismatch, as is one of the wrong length or with a non-finite component (spec-v2 §f 8).
    `per_nonce` gives each scored nonce's L2 distance (None when the received vector is unusable) and verdict.
    """
    excluded = [n for n in nonces if computed.get(n) is None]
    if len(excluded) > max(1, int(len(nonces) * MAX_UNSCORED_FRAC)):
        raise NoVerdict(f"{len(excluded)} of {len(nonces)} nonces could not be computed by this validator (more "
                        f"than {MAX_UNSCORED_FRAC:.0%}): no verdict")
    if len(excluded) == len(nonces):
        raise NoVerdict(f"none of the {len(nonces)} nonces could be computed by this validator: no verdict")
    mismatch, per_nonce = [], []
    for n in nonces:
        mine = computed.get(n)
        if mine is None:
            continue
        dist = None
        try:
            b = decode(received.get(n) or "")
            if len(b) == k_dim and np.isfinite(b).all():
                dist = float(np.linalg.norm(decode(mine) - b))
        except (ValueError, TypeError):
            pass
        bad = dist is None or dist > stat.dist_threshold
        if bad:
            mismatch.append(n)
        per_nonce.append({"nonce": n, "dist": dist, "mismatch": bad})
    n_total = len(per_nonce)
    p, fraud = fraud_test(len(mismatch), n_total, stat.p_mismatch, stat.fraud_threshold)
    return {"n_total": n_total, "n_mismatch": len(mismatch), "mismatch_nonces": mismatch, "per_nonce": per_nonce,
            "p_value": p, "fraud_detected": fraud, "n_excluded": len(excluded), "excluded_nonces": excluded}
