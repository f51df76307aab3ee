"""PoC v1: the random-weight LLaMA's parameters, seeds, inputs, permutations, target, distance, batches.

Everything here follows ../shared/spec/poc-v1.md (§1.1-§3); the model itself lives in poc.model.
The RNG is numpy's PCG64 (seeded through SeedSequence from sha256 words), pinned by the golden file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from poc.errors import InputError
from poc.protocol.nonces import node_nonces, range_nonces, worker_nonces  # the spec's layouts (§3), as lattices

# gonka chain defaults (spec-v1 §1.1)
DEFAULT_R_TARGET = 1.4013564660458173
DEFAULT_FRAUD_THRESHOLD = 1e-7
PROBABILITY_MISMATCH = 5e-4
POOL_FRACTION = 0.05  # both reference builders pass 0.05 (the function's own default 0.01 is never used)
POOL_MIN = 50_000
WEIGHT_STD = 0.02


# --------------------------------------------------------------------------------------------------
# Params


@dataclass(frozen=True)
class V1Params:
    """The request-facing model parameters. Every key is required: the reference silently defaults
    a missing seq_len to 16, which changes every distance (spec-v1 §6 F10); we refuse instead."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    ffn_dim_multiplier: float | None
    multiple_of: int
    norm_eps: float
    rope_theta: float
    use_scaled_rope: bool
    seq_len: int

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def ffn_dim(self) -> int:
        return ffn_hidden_dim(self.dim, self.multiple_of, self.ffn_dim_multiplier)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, obj, field_prefix: str = "params") -> "V1Params":
        """Parse and check a params dict; InputError names the first bad key."""
        if not isinstance(obj, dict):
            raise InputError(f"{field_prefix} must be a JSON object", field_prefix)
        names = [f.name for f in dataclasses.fields(cls)]
        extra = sorted(set(obj) - set(names) - _IGNORED_KEYS)
        if extra:
            raise InputError(f"unknown {field_prefix} key(s): {', '.join(extra)} (expected {', '.join(names)})",
                             f"{field_prefix}.{extra[0]}")
        missing = [n for n in names if n not in obj]
        if missing:
            raise InputError(f"missing {field_prefix} key(s): {', '.join(missing)}", f"{field_prefix}.{missing[0]}")
        vals = {}
        for n in names:
            v = obj[n]
            f = f"{field_prefix}.{n}"
            if n == "use_scaled_rope":
                if not isinstance(v, bool):
                    raise InputError(f"{f} must be true or false, got {v!r}", f)
            elif n in ("norm_eps", "rope_theta"):
                v = _number(v, f)
            elif n == "ffn_dim_multiplier":
                v = None if v is None else _number(v, f)
            elif n == "n_kv_heads" and v is None:
                v = obj["n_heads"]  # as the reference's ModelArgs does
                v = _int(v, f)
            else:
                v = _int(v, f)
            vals[n] = v
        p = cls(**vals)
        p.check()
        return p

    def check(self) -> None:
        for n in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "multiple_of", "seq_len"):
            if getattr(self, n) <= 0:
                raise InputError(f"params.{n} must be positive, got {getattr(self, n)}", f"params.{n}")
        if self.dim % self.n_heads:
            raise InputError(f"params.dim {self.dim} is not divisible by n_heads {self.n_heads}", "params.dim")
        if self.n_heads % self.n_kv_heads or self.n_kv_heads > self.n_heads:
            raise InputError(f"params.n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}",
                             "params.n_kv_heads")
        if self.head_dim % 2:
            raise InputError(f"head_dim = dim/n_heads = {self.head_dim} must be even for RoPE", "params.dim")
        if not (self.norm_eps > 0 and math.isfinite(self.norm_eps)):
            raise InputError(f"params.norm_eps must be a positive number, got {self.norm_eps}", "params.norm_eps")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise InputError(f"params.rope_theta must be a positive number, got {self.rope_theta}", "params.rope_theta")
        if self.ffn_dim_multiplier is not None and not (self.ffn_dim_multiplier > 0 and math.isfinite(self.ffn_dim_multiplier)):
            raise InputError("params.ffn_dim_multiplier must be positive or null", "params.ffn_dim_multiplier")
        try:
            ffn = self.ffn_dim
        except OverflowError:  # ffn_dim_multiplier * hidden is past float range
            ffn = math.inf
        if not 0 < ffn <= _MAX_INT:
            raise InputError(f"the FFN hidden size works out to {ffn if ffn <= 0 else 'more than ' + str(_MAX_INT)}",
                             "params.ffn_dim_multiplier")

    @property
    def total_params(self) -> int:
        return sum(math.prod(s) for _, s in param_shapes(self))


# The seed's Params has use_fp8, which never touches the math (spec-v1 §1.8): accept and ignore it.
_IGNORED_KEYS = {"use_fp8"}


_MAX_INT = (1 << 63) - 1  # tensor sizes are int64; larger values would overflow float maths in the estimate


def _int(v, f: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        else:
            raise InputError(f"{f} must be an integer, got {v!r}", f)
    if v > _MAX_INT:
        raise InputError(f"{f} must be <= {_MAX_INT}, got a {len(str(v))}-digit number", f)
    return v


def _number(v, f: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{f} must be a number, got {v!r}", f)
    try:
        return float(v)
    except OverflowError:  # an int past float range (10**400 is valid JSON)
        raise InputError(f"{f} must be a finite number, got a {len(str(v))}-digit integer", f) from None


# Named presets (spec-v1 §1.1). PARAMS_V2 is gonka's MainNetParams.
PARAMS_V1 = V1Params(dim=1024, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=8196, ffn_dim_multiplier=10.0,
                     multiple_of=2048, norm_eps=1e-5, rope_theta=10000.0, use_scaled_rope=False, seq_len=128)
PARAMS_V2 = V1Params(dim=1792, n_layers=64, n_heads=64, n_kv_heads=64, vocab_size=8196, ffn_dim_multiplier=10.0,
                     multiple_of=8192, norm_eps=1e-5, rope_theta=10000.0, use_scaled_rope=False, seq_len=256)


def ffn_hidden_dim(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """LLaMA's FFN size rule with the reference's truncations (spec-v1 §1.2)."""
    h = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        h = int(ffn_dim_multiplier * h)
    return multiple_of * ((h + multiple_of - 1) // multiple_of)


def param_shapes(p: V1Params) -> list[tuple[str, tuple[int, ...]]]:
    """The reference's parameter names and shapes (spec-v1 §2.4): these names are the protocol."""
    D, hd, F = p.dim, p.head_dim, p.ffn_dim
    out = [("tok_embeddings.weight", (p.vocab_size, D))]
    for i in range(p.n_layers):
        pre = f"layers.{i}."
        out += [
            (pre + "attention.wq.weight", (p.n_heads * hd, D)),
            (pre + "attention.wk.weight", (p.n_kv_heads * hd, D)),
            (pre + "attention.wv.weight", (p.n_kv_heads * hd, D)),
            (pre + "attention.wo.weight", (D, p.n_heads * hd)),
            (pre + "feed_forward.w1.weight", (F, D)),
            (pre + "feed_forward.w2.weight", (D, F)),
            (pre + "feed_forward.w3.weight", (F, D)),
            (pre + "attention_norm.weight", (D,)),
            (pre + "ffn_norm.weight", (D,)),
        ]
    out += [("norm.weight", (D,)), ("output.weight", (p.vocab_size, D))]
    return out


# --------------------------------------------------------------------------------------------------
# RNG (spec-v1 §3.1)


def extended_entropy(seed: str, num_hashes: int) -> np.ndarray:
    """8·num_hashes little-endian uint32 words of sha256(f"{seed}_{k}")."""
    words = [np.frombuffer(hashlib.sha256(f"{seed}_{k}".encode()).digest(), dtype="<u4") for k in range(num_hashes)]
    return np.concatenate(words)


def get_rng(seed: str, num_hashes: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(extended_entropy(seed, num_hashes))))


# --------------------------------------------------------------------------------------------------
# Weights (spec-v1 §2)


def pool_size(total_params: int) -> int:
    return max(POOL_MIN, int(total_params * POOL_FRACTION))


def name_hash(block_hash: str, name: str) -> int:
    """First 4 bytes of sha256(f"{block_hash}_{name}") as a big-endian u32."""
    return int.from_bytes(hashlib.sha256(f"{block_hash}_{name}".encode()).digest()[:4], "big")


def placement(block_hash: str, name: str, numel: int, pool_len: int) -> tuple[str, int]:
    """("slice", start) when the parameter fits in the pool, else ("rotate", shift) of the tiled pool."""
    h = name_hash(block_hash, name)
    if numel <= pool_len:
        return "slice", h % (pool_len - numel + 1)
    return "rotate", h % numel


def weight_pool(block_hash: str, size: int, chunk: int = 1 << 24) -> np.ndarray:
    """The float32 pool: N(0, 0.02) from one PCG64 stream, drawn in chunks (the stream is the same as one
    call: the ziggurat keeps no state between calls) so the float64 temporaries stay small."""
    rng = get_rng(block_hash, 4)
    out = np.empty(size, dtype=np.float32)
    buf = np.empty(min(chunk, size), dtype=np.float64)
    for s in range(0, size, chunk):
        n = min(chunk, size - s)
        b = buf[:n]
        rng.standard_normal(out=b)
        b *= WEIGHT_STD  # numpy's normal(0, σ) is 0 + σ·z: the same doubles
        out[s:s + n] = b
    return out


def place(pool, name: str, shape, block_hash: str):
    """One parameter's values from the pool (numpy or torch 1-D array; returns the same kind)."""
    n = math.prod(shape)
    mode, k = placement(block_hash, name, n, len(pool))
    if mode == "slice":
        vals = pool[k:k + n]
    else:
        reps, rem = divmod(n, len(pool))
        parts = [pool] * reps + [pool[:rem]]
        vals = np.concatenate(parts) if isinstance(pool, np.ndarray) else _torch_cat(parts)
        if k:
            vals = np.concatenate([vals[k:], vals[:k]]) if isinstance(pool, np.ndarray) else _torch_cat([vals[k:], vals[:k]])
    return vals.reshape(shape)


def _torch_cat(parts):
    import torch
    return torch.cat(parts)


# --------------------------------------------------------------------------------------------------
# Inputs, permutations, target, distance (spec-v1 §3.2-3.3)


def input_seed(block_hash: str, public_key: str, nonce: int) -> str:
    return f"{block_hash}_{public_key}_nonce{nonce}"  # no underscore before the number


def permutation_seed(block_hash: str, public_key: str, nonce: int) -> str:
    return f"{block_hash}_{public_key}_nonce_{nonce}_permutations"


def input_normals32(block_hash: str, public_key: str, nonce: int, out32: np.ndarray, buf64: np.ndarray) -> None:
    """One nonce's (S, D) PCG64 standard normals, rounded to float32: the first of the reference's two roundings.

    The reference builds torch.tensor(x, dtype=float16) from the float64 normals, and torch converts float64 to
    float16 through float32 (two round-to-nearest-even steps); numpy's float64 -> float16 rounds once and differs
    by one fp16 ulp in about 1 value in 20000. float32 -> float16 (numpy or torch, CPU or CUDA) is the second step."""
    get_rng(input_seed(block_hash, public_key, nonce), 4).standard_normal(out=buf64)
    np.copyto(out32, buf64, casting="same_kind")


def input_embeddings(block_hash: str, public_key: str, nonces: Iterable[int], seq_len: int, dim: int) -> np.ndarray:
    """(B, S, D) float16: PCG64 standard normals per nonce, rounded to fp16 as the reference does."""
    nonces = list(nonces)
    out = np.empty((len(nonces), seq_len, dim), dtype=np.float16)
    buf = np.empty((seq_len, dim), dtype=np.float64)
    tmp = np.empty((seq_len, dim), dtype=np.float32)
    for i, n in enumerate(nonces):
        input_normals32(block_hash, public_key, n, tmp, buf)
        out[i] = tmp
    return out


def permutations(block_hash: str, public_key: str, nonces: Iterable[int], vocab_size: int) -> np.ndarray:
    """(B, V) int64 permutations."""
    nonces = list(nonces)
    return np.stack([get_rng(permutation_seed(block_hash, public_key, n), 1).permutation(vocab_size) for n in nonces]) \
        if nonces else np.empty((0, vocab_size), dtype=np.int64)


def target(block_hash: str, vocab_size: int) -> np.ndarray:
    """(V,) float64 unit vector; depends only on block_hash and V."""
    y = get_rng(f"{block_hash}_target", 1).standard_normal((1, vocab_size))
    y /= np.linalg.norm(y, axis=1, keepdims=True)  # per row, as the reference: the whole-array norm is a dot
    return y[0]


def valid(dist: np.ndarray, r_target: float) -> np.ndarray:
    """The v1 rule, written once (spec-v1 §4.1): a nonce is valid when its distance is under r_target (strictly;
    NaN never is). Boolean, one a distance."""
    return dist < r_target


def distances(logits: np.ndarray, perms: np.ndarray, tgt: np.ndarray) -> np.ndarray:
    """dist = ‖ normalise_f32(logits[perm]) − target ‖₂ in float64, per row."""
    p = np.take_along_axis(np.asarray(logits, dtype=np.float32), perms, axis=1)
    u = p / np.linalg.norm(p, axis=1, keepdims=True)
    return np.linalg.norm(u.astype(np.float64) - tgt[None, :], axis=1)


# --------------------------------------------------------------------------------------------------
# Batches (spec-v1 §3.4)


@dataclass
class ProofBatch:
    public_key: str
    block_hash: str
    block_height: int
    nonces: list[int]
    dist: list[float]
    node_id: int

    def sub_batch(self, r_target: float) -> "ProofBatch":
        keep = np.flatnonzero(valid(np.asarray(self.dist, dtype=np.float64), r_target))
        return dataclasses.replace(self, nonces=[self.nonces[i] for i in keep], dist=[float(self.dist[i]) for i in keep])

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


@dataclass
class ValidatedBatch(ProofBatch):
    received_dist: list[float] = field(default_factory=list)
    r_target: float = DEFAULT_R_TARGET
    fraud_threshold: float = DEFAULT_FRAUD_THRESHOLD
    n_invalid: int = -1
    probability_honest: float = -1.0
    fraud_detected: bool = False


def validate_batch(batch: ProofBatch, recomputed: list[float], r_target: float, fraud_threshold: float) -> ValidatedBatch:
    """Score a submitted batch against the validator's own distances.

    A nonce is invalid when the recomputed dist > r_target (the reference's strict test, no tolerance against the
    claimed dist), and also when the submitted dist itself is not < r_target. No honest node submits such a dist
    (generation keeps dist < r_target): the spec's reference asserts on it and crashes (spec-v1 F18), and gonka's
    later data.py answers probability_honest 0.0 and fraud_detected True at once. We score instead of crashing and
    give that verdict; n_invalid still counts every invalid nonce.
    """
    from poc.protocol.stats import fraud_test  # scipy: kept out of the input worker processes' imports

    # a recomputed distance that is NaN or infinite is invalid (`not d <= r_target`), never silently honest
    n_invalid = sum(1 for d, rd in zip(recomputed, batch.dist) if not d <= r_target or not rd < r_target)
    p, fraud = fraud_test(n_invalid, len(batch.nonces), PROBABILITY_MISMATCH, fraud_threshold)
    if any(not rd < r_target for rd in batch.dist):
        p, fraud = 0.0, True
    return ValidatedBatch(public_key=batch.public_key, block_hash=batch.block_hash, block_height=batch.block_height,
                          nonces=list(batch.nonces), dist=[float(d) for d in recomputed], node_id=batch.node_id,
                          received_dist=[float(d) for d in batch.dist], r_target=r_target,
                          fraud_threshold=fraud_threshold, n_invalid=n_invalid,
                          probability_honest=p if batch.nonces else 1.0, fraud_detected=fraud)
