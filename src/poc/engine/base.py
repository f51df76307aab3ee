"""What every engine is, whatever runs its work: the one-device `Engine` (engine.py) and the rank processes'
`DistEngine` (poc.engine.dist) both implement `EngineBase`, and the server reads nothing else.

- Life cycle: `state` is loading | ready | busy | broken. `start_loading()` and `load()` move it, `mark_broken()`
  and a device failure (`is_device_failure`: a CUDA error leaves the device unusable) end it. `switch_model()`
  replaces the loaded checkpoint by another (`preflight()` first checks that it can be served); `unload_model()`
  leaves none.
- One device lock: `try_claim(owner)` gives one `Claim` or None; a job runs under a claim taken before it
  (`run(..., claim=)`, the server admits a request so) or under one it takes itself (`Busy` when held).
- Model info and memory: `v2` (name, config, dtype of the loaded checkpoint), and `check_v1_memory` /
  `check_v2_memory`, the estimate of one job against what this engine's devices have free.
"""

from __future__ import annotations

import abc
import contextlib
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from poc.engine import memory
from poc.engine.jobs import BatchResult, JobSummary, V1Job, V2Job
from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.model.options import ModelOptions
from poc.model.source import ModelSource
from poc.model.source import parse as parse_source
from poc.protocol import v1, v2

STATES = ("loading", "ready", "busy", "broken")
# tokens a forward of a v2 batch without a batch_size in its request: where throughput stops growing with the batch
# (one H100: W6Q 7,423 -> 7,478/min from 64 to 128 nonces of 1024; four H200: W7P 1,501 -> 1,507 from 64 to 96,
# W7 tp=4 2,042 -> 2,113 from 32 to 64), so batch 64 at seq_len 1024 (benchmarks/README.md)
TOKENS_PER_BATCH = 1 << 16


class Busy(RuntimeError):
    """A second job while one holds the device(s)."""


@dataclass
class ModelInfo:
    """What a caller may know of the loaded PoC v2 checkpoint."""

    cfg: ModelConfig
    name: str
    dtype: torch.dtype
    computes: dict | None = None  # what the model computes, as it reports it (Transformer.computes)


class Claim:
    """One holder of the device(s); `release()` is idempotent and may be called from any thread."""

    def __init__(self, lock: "DeviceLock", owner: str):
        self.lock, self.owner, self.released = lock, owner, False

    def release(self) -> None:
        self.lock.release(self)


class DeviceLock:
    """At most one holder. Listeners (`on_release`) hear every release, from the thread that released."""

    def __init__(self):
        self._mutex = threading.Lock()
        self.holder: Claim | None = None
        self._listeners: list[Callable[[], None]] = []

    @property
    def busy(self) -> bool:
        return self.holder is not None

    def try_claim(self, owner: str) -> Claim | None:
        with self._mutex:
            if self.holder is not None:
                return None
            self.holder = Claim(self, owner)
            return self.holder

    def release(self, claim: Claim) -> None:
        with self._mutex:
            if claim.released:
                return
            claim.released = True
            if self.holder is claim:
                self.holder = None
            listeners = list(self._listeners)
        for f in listeners:
            f()

    def on_release(self, f: Callable[[], None]) -> None:
        self._listeners.append(f)


def is_device_failure(e: BaseException) -> bool:
    """A failure after which the device cannot be trusted (a CUDA error: every later kernel fails too)."""
    return "CUDA error" in str(e) or type(e).__name__ == "AcceleratorError"


class EngineBase(abc.ABC):
    """The engine interface: life cycle, one device lock, model info, memory estimates, jobs."""

    device: torch.device
    source: ModelSource | None = None  # the PoC v2 model this engine serves (model/source.py), parsed once
    v2: ModelInfo | None
    compile_v1: bool
    compile_v2: bool
    options: ModelOptions = ModelOptions()  # how models are built and computed (each engine sets its own)

    def __init__(self, loading: bool):
        self.lock = DeviceLock()
        self.broken_reason: str | None = None
        self.load_seconds: float | None = None
        self._loading = loading

    # ------------------------------------------------------------------------------------ life cycle

    @property
    def model_dir(self) -> str | None:
        """The --model this engine serves, as it was given (a checkpoint directory, random:<preset>[:fp8]); None: PoC
        v1 only. Set, it is parsed (source.parse: an InputError for a preset that does not exist)."""
        return None if self.source is None else str(self.source)

    @model_dir.setter
    def model_dir(self, model: "str | ModelSource | None") -> None:
        self.source = parse_source(model) if model else None

    @property
    def state(self) -> str:
        if self.broken_reason:
            return "broken"
        if self._loading:
            return "loading"
        return "busy" if self.lock.busy else "ready"

    def start_loading(self) -> None:
        """The model is being (re)loaded: jobs wait for `load()` to end."""
        self._loading = True

    def loaded(self) -> None:
        self._loading = False

    def mark_broken(self, reason: str) -> None:
        """The engine cannot run jobs until it is restarted (the latest reason is reported)."""
        self.broken_reason = reason
        self._loading = False

    def clear_broken(self) -> None:
        self.broken_reason = None

    def load(self) -> None:
        """Warm up and load the checkpoint given at start (blocking: run it on a thread). A failure breaks the
        engine ("model load failed: ...") and is raised."""
        self.start_loading()
        try:
            self._load()
        except Exception as e:
            self.mark_broken(f"model load failed: {type(e).__name__}: {e}")
            raise
        self.loaded()

    @abc.abstractmethod
    def _load(self) -> None: ...

    def preflight(self, model_dir: str) -> ModelConfig:
        """The checkpoint's config, checked as far as it can be without loading (InputError when it cannot be
        served here): run before `switch_model`, so a bad choice leaves the loaded model in place."""
        return parse_source(model_dir).config()

    def switch_model(self, model_dir: str, dtype: str | None = None) -> None:
        """Unload the loaded checkpoint and load `model_dir` in its place (blocking: a thread, under the caller's
        claim; `dtype` replaces the --dtype flag when given). A failure breaks the engine with the reason and leaves
        it holding no model (never the old one half unloaded); a later switch may load another."""
        self.start_loading()
        self.clear_broken()
        self.v2 = None
        self._unload()
        self.model_dir = model_dir
        if dtype is not None:
            self.dtype_flag = dtype
        self.load()

    def unload_model(self) -> None:
        """Unload the loaded checkpoint and serve none: PoC v1 only, as after a start without --model (blocking: a
        thread, under the caller's claim). Clears a broken state; a failure breaks the engine with the reason."""
        self.start_loading()
        self.clear_broken()
        self.v2 = None
        try:
            self._release()
        except Exception as e:
            self.mark_broken(f"unloading failed: {type(e).__name__}: {e}")
            raise
        self.model_dir = None
        self.load()

    @abc.abstractmethod
    def _unload(self) -> None:
        """Free what the loaded checkpoint holds (before another is loaded)."""

    def _release(self) -> None:
        """Free everything the loaded checkpoint holds, with no other to follow (unload_model)."""
        self._unload()

    @abc.abstractmethod
    def close(self) -> None: ...

    # ------------------------------------------------------------------------------------ the device lock

    @property
    def busy(self) -> bool:
        return self.lock.busy

    def try_claim(self, owner: str) -> Claim | None:
        return self.lock.try_claim(owner)

    @contextlib.contextmanager
    def exclusive(self, claim: Claim | None = None, owner: str = "job"):
        """Hold the device(s) for one job: under `claim` (taken by the caller, kept by it) or under a claim taken
        here (Busy at once if another holds them). A device failure inside breaks the engine."""
        own = None
        if claim is None:
            own = self.lock.try_claim(owner)
            if own is None:
                raise Busy("a job is already running")
        elif claim is not self.lock.holder:
            raise Busy(f"the claim of {claim.owner!r} does not hold the device")
        try:
            yield
        except Exception as e:
            if is_device_failure(e):
                self.mark_broken(f"{type(e).__name__}: {e}")
            raise
        finally:
            if own is not None:
                own.release()

    # ------------------------------------------------------------------------------------ jobs

    @abc.abstractmethod
    def run(self, job: V1Job | V2Job, emit: Callable[[BatchResult], None], stop: threading.Event,
            claim: Claim | None = None) -> JobSummary:
        """Run one job batch by batch under `exclusive(claim)` (blocking: a worker thread): emit(BatchResult) as
        each batch is on the host, every launched batch emitted also on a stop; a JobSummary at the end."""

    @abc.abstractmethod
    def v1_distances(self, params: v1.V1Params, block_hash: str, public_key: str, nonces: Sequence[int],
                     dtype: str = "float16", batch_size: int = 64) -> np.ndarray:
        """Distances for explicit nonces (validation, the CLI)."""

    @abc.abstractmethod
    def v2_artifacts(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                     stronger_rng: bool = False, batch_size: int = 32) -> tuple[list[dict], list[int]]: ...

    def build_v1(self, params: v1.V1Params, block_hash: str, dtype: str) -> None:
        """Build the v1 model of a coming job ahead of it (blocking), where the engine keeps one; else nothing."""

    def require_v2(self) -> ModelInfo:
        if self.v2 is None:
            raise InputError("no PoC v2 model is loaded: start the server with --model DIR", "params.model")
        return self.v2

    # ------------------------------------------------------------------------------------ memory

    def parallel_dims(self) -> tuple[int, int, int]:
        """(tp, pp, ranks): how a model is split over this engine's devices."""
        return 1, 1, 1

    @property
    def replicas(self) -> int:
        """Independent groups a job's batches are dealt to, each computing its own (1: one group)."""
        return 1

    last_job_stats: dict | None = None  # the last job's per-replica and per-rank figures, where an engine keeps them
    # (DistEngine: JobFlight.summary, each rank's batches and stage among them)

    def free_bytes(self) -> int | None:
        """The tightest device's free memory as its holder reports it; None: read it here (memory.check_fits)."""
        return None

    @abc.abstractmethod
    def v1_held_bytes(self) -> int:
        """A device's bytes held by the cached v1 model, freed before the next one is built."""

    def release_v1(self) -> int:
        """Drop the cached v1 model (the caller holds the device claim); the bytes a device got back (v1_held_bytes).
        The next v1 job builds its model again."""
        return 0

    def check_v1_memory(self, params: v1.V1Params, batch_size: int, dtype: str, headroom: float = 0.9) -> None:
        """422 (InputError) when the v1 model and a batch of this size do not fit the free device memory."""
        tp, pp, ranks = self.parallel_dims()
        cuda = self.device.type == "cuda"
        est = memory.v1_estimate(params, batch_size, dtype, tp=tp, pp=pp, cuda=cuda, fused=cuda and self.compile_v1)
        memory.check_fits(est, self.device, reclaimable=self.v1_held_bytes(), headroom=headroom, field="params",
                          free=self.free_bytes(), ranks=ranks)

    def check_v2_memory(self, batch_size: int, seq_len: int, headroom: float = 0.9) -> None:
        """422 (InputError) when a batch of this shape through the loaded model does not fit."""
        tp, _pp, ranks = self.parallel_dims()
        info = self.require_v2()
        cuda = self.device.type == "cuda"
        est = memory.v2_estimate(info.cfg, batch_size, seq_len, info.dtype.itemsize, tp=tp, cuda=cuda,
                                 fused=cuda and self.compile_v2, w8a8=self.v2_w8a8())
        memory.check_fits(est, self.device, headroom=headroom, field="params.seq_len", free=self.free_bytes(),
                          ranks=ranks)

    def v2_fp8(self) -> dict | None:
        """How the loaded v2 model computes its FP8 weights, as the model reports it (Transformer.computes):
        {"forward": "w8a8" | "dequant", "scales": "ue8m0" | "float32" (W8A8's scale format; None for dequant)}; None
        without a model or for one that is not an FP8 checkpoint."""
        computes = self.v2.computes if self.v2 is not None else None
        return computes["fp8"] if computes else None

    def v2_attention(self) -> str | None:
        """The attention recipe the loaded v2 model computes (model/attention.py: fp8, fp8kv or bf16), as the model
        reports it; None without a model."""
        computes = self.v2.computes if self.v2 is not None else None
        return computes["attention"] if computes else None

    def v2_router(self) -> str | None:
        """How the loaded v2 model's sigmoid router computes its float32 GEMM (split or float32: ModelOptions.
        router_gemm), as the model reports it; None without a model or for another router."""
        computes = self.v2.computes if self.v2 is not None else None
        return computes.get("router") if computes else None

    def v2_w8a8(self) -> bool:
        """Whether the loaded v2 model is an FP8 checkpoint computed W8A8 (its experts' activations are FP8)."""
        fp8 = self.v2_fp8()
        return fp8 is not None and fp8["forward"] == "w8a8"

    def default_v2_batch(self, seq_len: int, headroom: float = 0.9, cap: int = 4096) -> int:
        """The batch size of a PoC v2 job whose request gives none (a Gonka node sends none): on CUDA the largest
        power of two with at most TOKENS_PER_BATCH tokens (batch x seq_len) whose memory estimate fits the loaded
        model on this engine's layout (check_v2_memory: a tp rank's share of the activations, the tightest GPU's
        free memory as the ranks report it), at most `cap`; on the CPU the protocol's default (32)."""
        if self.device.type != "cuda":
            return max(1, min(cap, v2.DEFAULT_BATCH_SIZE))
        b = 1 << max(0, min(cap, max(1, TOKENS_PER_BATCH // max(1, seq_len))).bit_length() - 1)
        while b > 1:
            try:
                self.check_v2_memory(b, seq_len, headroom)
                return b
            except InputError:
                b //= 2
        return 1
