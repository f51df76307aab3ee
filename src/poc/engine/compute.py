"""One batch of nonces through one model on one device: inputs -> forward -> post-process -> small results.

`V1Compute` holds a random model for (params, block_hash, dtype); `V2Compute` holds a loaded checkpoint.
Both split a batch into `prepare` (host work: seeds, numpy RNG; safe to run on another thread while the
device is busy with the previous batch) and `run` (device work), so the runner can overlap them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from poc import dtypes
from poc.model.compile import maybe_compile, note_new_shape
from poc.model.random_init import build_v1_model
from poc.model.transformer import Transformer
from poc.protocol import v1, v2

log = logging.getLogger("poc.compute")

DTYPES = {name: getattr(torch, name) for name in dtypes.NAMES}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


def resolve_device(device: str | None) -> torch.device:
    """cpu, cuda or cuda:N (None/auto: cuda when available); anything else is an InputError naming --device."""
    from poc.errors import InputError

    if device in (None, "", "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise InputError(f"--device must be cpu, cuda or cuda:N, got {device!r}", "device")
    if d.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda was asked for, but CUDA is not available here", "device")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise InputError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) are visible", "device")
    return d


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Handle:
    """A batch whose device work was launched; `collect` waits for it."""

    def __init__(self, prep, out: torch.Tensor, device: torch.device):
        self.prep = prep
        if device.type == "cuda":
            self.host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
            self.host.copy_(out, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = out, None

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host


def compile_flags(compile, device: torch.device) -> tuple[bool, bool]:
    """(compile v1, compile v2) for the --compile flag: "auto" and "on" compile both protocols on CUDA, "off" and
    the CPU neither. The compiled path computes eager's bits (eager_numerics; v2 bf16 over 1000 nonces: mean L2
    3e-10, v1 fp16: |delta dist| 8e-8, benchmarks/h100/accuracy_exact.json), so there is no accuracy reason to
    keep it off; the cost is compiling each new batch shape once (about 20 s on the first batch)."""
    from poc.errors import InputError

    mode = {True: "on", False: "off"}.get(compile, compile)
    if mode not in ("auto", "on", "off"):
        raise InputError(f"compile must be auto, on or off, got {compile!r}", "compile")
    on = device.type == "cuda" and mode != "off"
    return on, on


def _pad_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """Repeat the last row up to n rows (a short batch keeps the compiled shape; the extra rows are dropped)."""
    if t.shape[0] >= n:
        return t
    return torch.cat([t, t[-1:].expand(n - t.shape[0], *t.shape[1:])])


# --------------------------------------------------------------------------------------------------
# v1


@dataclass
class V1Prepared:
    nonces: list[int]
    x: torch.Tensor  # (B, S, D) float16, host (pinned on CUDA)
    perms: torch.Tensor  # (B, V) int64, host


class V1Compute:
    """The v1 random model for one (params, block_hash, dtype), plus its target vector."""

    def __init__(self, params: v1.V1Params, block_hash: str, dtype: torch.dtype, device: torch.device,
                 compile: bool = False, input_workers: int = 0, executor=None):
        self.params, self.block_hash, self.dtype, self.device = params, block_hash, dtype, device
        self.input_workers = input_workers  # > 0: inputs drawn by that many processes (V1InputPool)
        self._pool = None
        self._executor = executor  # shared worker processes (the engine's), or None: the pool makes its own
        t0 = time.perf_counter()
        self.model = build_v1_model(params, block_hash, dtype, device).fuse()
        self.target = torch.from_numpy(v1.target(block_hash, params.vocab_size)).to(device)  # float64
        self._step = maybe_compile(Transformer.layer_step, compile)
        self._post = maybe_compile(self._distances, compile)
        self.compiled = compile
        _sync(device)
        self.build_seconds = time.perf_counter() - t0

    def key(self) -> tuple:
        return (self.params, self.block_hash, self.dtype)

    def prepare(self, public_key: str, nonces: Sequence[int]) -> V1Prepared:
        p = self.params
        if self.input_workers > 0 and len(nonces) > 1:
            if self._pool is None or self._pool.batch < len(nonces):
                from poc.engine.v1inputs import PoolUnavailable, V1InputPool
                self.close()
                try:
                    self._pool = V1InputPool(len(nonces), p.seq_len, p.dim, p.vocab_size, self.input_workers,
                                             executor=self._executor)
                except PoolUnavailable as e:
                    log.warning("v1 inputs drawn in this process, slower: %s", e)
                    self.input_workers = 0
            if self._pool is not None:
                x, perms = self._pool.fill(self.block_hash, public_key, list(nonces))
                return V1Prepared(list(nonces), torch.from_numpy(x), torch.from_numpy(perms))
        x = torch.from_numpy(v1.input_embeddings(self.block_hash, public_key, nonces, p.seq_len, p.dim))
        perms = torch.from_numpy(v1.permutations(self.block_hash, public_key, nonces, p.vocab_size))
        if self.device.type == "cuda":
            x, perms = x.pin_memory(), perms.pin_memory()
        return V1Prepared(list(nonces), x, perms)

    def _batch(self, x16: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
        logits = self.model(x16.to(self.dtype), last_only=True, logits=True, step=self._step)  # fp16 first
        return self._post(logits, perms)

    def _distances(self, logits: torch.Tensor, perms: torch.Tensor) -> torch.Tensor:
        p = torch.gather(logits.float(), 1, perms)
        u = p / torch.linalg.vector_norm(p, dim=1, keepdim=True)  # float32, as the reference
        return torch.linalg.vector_norm(u.double() - self.target[None, :], dim=1)

    @torch.inference_mode()
    def launch(self, prep: V1Prepared, pad_to: int | None = None) -> Handle:
        x = prep.x.to(self.device, non_blocking=True)
        perms = prep.perms.to(self.device, non_blocking=True)
        n = len(prep.nonces)
        if self.compiled and pad_to and n < pad_to:
            x, perms = _pad_rows(x, pad_to), _pad_rows(perms, pad_to)
        if self.compiled:
            note_new_shape("PoC v1", x.shape[0], x.shape[1])
        return Handle(prep, self._batch(x, perms)[:n], self.device)

    def collect(self, h: Handle) -> dict:
        return {"dist": h.wait().numpy().copy()}

    def run(self, prep: V1Prepared) -> np.ndarray:
        """float64 distances, one per nonce."""
        return self.collect(self.launch(prep))["dist"]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


# --------------------------------------------------------------------------------------------------
# v2


@dataclass
class V2Prepared:
    nonces: list[int]
    seeds: torch.Tensor  # (B,) or (B, 8) int64 input seeds
    pick: torch.Tensor  # (B, k) int64
    haar: torch.Tensor  # (B, k-1, k) float32
    seq_len: int
    block_hash: str


class V2Compute:
    """A loaded checkpoint; computes artifacts for any (block_hash, public_key, nonces, seq_len, k_dim)."""

    def __init__(self, model, cfg, dtype: torch.dtype, device: torch.device, name: str, compile: bool = False,
                 compile_inputs: bool = True, compile_model: bool = True):
        self.model, self.cfg, self.dtype, self.device, self.name = model.fuse(), cfg, dtype, device, name
        self._vectors: tuple[str, torch.Tensor] | None = None
        self._keys: torch.Tensor | None = None
        # three compiled pieces, each small: the inputs, one layer (reused by all), the projection
        self._inputs = maybe_compile(v2.inputs_from_seeds, compile and compile_inputs)
        self._step = maybe_compile(Transformer.layer_step, compile and compile_model)
        self._project = maybe_compile(v2.project_tensors, compile)
        self.compiled = compile
        for block in self.model.layers.values():  # MoE dispatch: its elementwise steps compiled too
            if block is not None and hasattr(block.mlp, "fast"):
                block.mlp.fast = compile and compile_model

    def reflections(self, block_hash: str) -> torch.Tensor:
        if self._vectors is None or self._vectors[0] != block_hash:
            v = v2.layer_vectors(block_hash, self.cfg.n_layers, self.cfg.dim, self.device)
            self._vectors = (block_hash, v.to(self.dtype))
        return self._vectors[1]

    def prepare(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                stronger_rng: bool = False) -> V2Prepared:
        seeds = v2.input_seeds(block_hash, public_key, nonces, stronger_rng)
        pl = v2.plan(block_hash, public_key, nonces, self.cfg.dim, k_dim, "cpu")
        t = (seeds, pl.pick, pl.haar)
        if self.device.type == "cuda":
            t = tuple(x.pin_memory() for x in t)
        return V2Prepared(list(nonces), *t, seq_len=seq_len, block_hash=block_hash)

    def _batch(self, seeds, keys, pick, haar, refl, seq_len: int) -> torch.Tensor:
        x = self._inputs(seeds, seq_len, self.cfg.dim, keys).to(self.dtype)
        h = self.model(x, reflections=refl, last_only=True, step=self._step)
        return self._project(h, pick, haar)

    @torch.inference_mode()
    def launch(self, prep: V2Prepared, pad_to: int | None = None) -> Handle:
        dev = self.device
        if self.model.rope_cos.shape[0] < prep.seq_len or self.model.rope_cos.device != dev:
            self.model.init_rope(dev, max(prep.seq_len, self.cfg.max_seq_len))  # outside any compiled graph
        seeds, pick, haar = (t.to(dev, non_blocking=True) for t in (prep.seeds, prep.pick, prep.haar))
        n = len(prep.nonces)
        if self.compiled and pad_to and n < pad_to:
            seeds, pick, haar = (_pad_rows(t, pad_to) for t in (seeds, pick, haar))
        if self.compiled:
            note_new_shape(f"PoC v2 ({self.name})", seeds.shape[0], prep.seq_len)
        out = self._batch(seeds, self.keys(prep.seq_len), pick, haar, self.reflections(prep.block_hash), prep.seq_len)
        return Handle(prep, out[:n], dev)

    def keys(self, seq_len: int) -> torch.Tensor:
        n = seq_len * self.cfg.dim
        if self._keys is None or self._keys.numel() < n:
            self._keys = v2.hash_keys(n, self.device)
        return self._keys

    def collect(self, h: Handle) -> dict:
        arts, dropped = v2.artifacts(h.prep.nonces, h.wait())
        return {"artifacts": arts, "dropped": dropped}

    def vectors(self, prep: V2Prepared) -> torch.Tensor:
        """(B, k) float32 unit vectors (host)."""
        return self.launch(prep).wait()

    def run(self, prep: V2Prepared) -> tuple[list[dict], list[int]]:
        """(artifacts, nonces dropped for NaN/Inf)."""
        out = self.collect(self.launch(prep))
        return out["artifacts"], out["dropped"]
