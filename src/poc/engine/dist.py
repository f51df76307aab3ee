"""DistEngine: the Engine interface over replicas x pp x tp rank processes (poc.engine.factory picks it).

The server process never joins the process group. The engine owns one RankGroup at a time (poc.engine.rankgroup:
the rank processes started, read, failed and ended), hands each replica's leader the job and then its batches of
nonces, and merges the replicas' results into emit() in arrival order. Nonces are dealt by the rule the one-device
Engine follows too (jobs.Dealer): from the job's one iterator, a batch at a time, to whichever replica has room
(pp + 2 batches a replica), so the replicas' streams are disjoint and together exactly the job's, and a faster
replica takes more. One job's dealing is a JobRun.

A rank that dies, fails or times out breaks the engine: the running job raises RankFailure (the server writes it
as the stream's error line), the other ranks are killed, /health reads state == "broken", and restart() (or a new
engine) starts clean ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from poc.engine import memory
from poc.engine.base import Claim, EngineBase, ModelInfo
from poc.engine.compute import DTYPES, compile_flags, resolve_device
from poc.engine.engine import Engine
from poc.engine.jobs import BatchResult, Dealer, JobSummary, Limits, V1Job, V2Job
from poc.engine.rankgroup import RankConfig, RankDiagnostics, RankFailure, RankGroup
from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.model.options import ModelOptions
from poc.model.source import ModelSource
from poc.parallel.layout import Layout
from poc.protocol import v1

log = logging.getLogger("poc.parallel")

__all__ = ["DistEngine", "JobFlight", "JobRun", "RankFailure"]


class JobFlight:
    """The engine's view of one job's pipelines: per replica, the batches dealt and not yet reported (in flight),
    time-weighted from the replica's first result until its dealing ends (the steady state: before it the first
    batches fill the pipeline, after it they drain), and the least in flight just after a result's replacement
    was dealt (what the dealing keeps); the time from a result's arrival to its replacement being dealt (the
    engine's part of the round trip; the consumer's emit comes after the deal); with each rank's JobClock
    (poc.engine.ranks) added at the end: `summary()` is DistEngine.last_job_stats."""

    def __init__(self, replicas: int, ahead: int):
        self.ahead = ahead
        self.out = [0] * replicas
        self.steady = [False] * replicas
        self.t = [0.0] * replicas
        self.area = [0.0] * replicas
        self.span = [0.0] * replicas
        self.low: list[int | None] = [None] * replicas
        self.results = [0] * replicas
        self.redeal: list[float] = []  # seconds from a result's arrival to its replacement's deal
        self.emit_s = 0.0
        self.ranks: list[dict] = []

    def _tick(self, r: int, now: float) -> None:
        if self.steady[r]:
            self.area[r] += self.out[r] * (now - self.t[r])
            self.span[r] += now - self.t[r]
        self.t[r] = now

    def dealt(self, r: int) -> None:
        self._tick(r, time.perf_counter())
        self.out[r] += 1

    def reported(self, r: int) -> None:
        self._tick(r, time.perf_counter())
        self.out[r] -= 1
        self.results[r] += 1
        if self.results[r] == 1:
            self.steady[r] = True

    def redealt(self, r: int, t_result: float, dealt: bool) -> None:
        """After a result of replica r arrived at t_result: its replacement was dealt (or the dealing has ended)."""
        if dealt and self.steady[r]:
            self.redeal.append(time.perf_counter() - t_result)
            self.low[r] = self.out[r] if self.low[r] is None else min(self.low[r], self.out[r])

    def ended(self, r: int) -> None:
        self._tick(r, time.perf_counter())
        self.steady[r] = False

    def summary(self) -> dict:
        red = sorted(self.redeal)
        per = zip(self.results, self.area, self.span, self.low)
        return {"ahead": self.ahead,
                "replicas": [{"results": n, "mean_in_flight": round(a / s, 3) if s > 0 else None, "min_in_flight": lo}
                             for n, a, s, lo in per],
                "redeal_ms": ({"p50": round(1e3 * red[len(red) // 2], 3), "max": round(1e3 * red[-1], 3)}
                              if red else None),
                "emit_s": round(self.emit_s, 4), "ranks": self.ranks}


class JobRun:
    """One job dealt to the replicas of a RankGroup (DistEngine._run): batches of the job's nonces by the engines' rule
    (jobs.Dealer: batches_ahead() each, a result's replacement dealt before the result goes to the consumer), the
    replicas' messages taken until every replica is done; stop/limits end the dealing, and every batch a replica
    launched is still reported (the leaders drop batches not yet launched on a stop)."""

    def __init__(self, engine: "DistEngine", g: RankGroup, job, jid: int, on_result, stop: threading.Event):
        self.engine, self.g, self.job, self.jid, self.on_result, self.stop = engine, g, job, jid, on_result, stop
        self.L, self.lim = engine.layout, job.limits
        self.dealer = Dealer(job, self.L.replicas, self.L.pp)
        self.seqs = itertools.count(1)
        self.ended, self.done = [False] * self.L.replicas, [False] * self.L.replicas
        self.computed = self.batches = 0
        self.reason: str | None = None
        self.failure: Exception | None = None  # the nonce iterator's error: the job ends as on a stop, then raises it
        # the clock starts when a replica reports its model built ("started"): max_duration counts compute, not a
        # v1 model's build, as on one device; the batches dealt ahead meanwhile wait in the ranks' queues
        self.t_start: float | None = None
        self.flight = JobFlight(self.L.replicas, self.dealer.ahead)

    def run(self) -> str:
        """Deal, take the replicas' messages until all are done; the reason the dealing ended."""
        g, L = self.g, self.L
        last = time.monotonic()
        try:
            for r in self.dealer.first():
                self.deal(r)
            while not all(self.done):
                msg = g.next(0.1)
                if msg is None:  # no result yet: a stop or the deadline still drops what is not launched
                    if self.stop.is_set() and not all(self.ended):
                        self.end_all("stopped", True)
                    elif self.over_time() and not all(self.ended):
                        self.end_all("max_duration", True)
                    g.watchdog(last, self.engine.timeout + 60)
                    continue
                last = time.monotonic()
                if msg[1] == self.jid:  # else a late message of an earlier job
                    self.receive(msg)
        except RankFailure:
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                self.finish_on_error()
            raise
        if self.failure is not None:
            raise self.failure
        if self.reason == "exhausted" and self.lim.max_nonces is not None and self.computed >= self.lim.max_nonces:
            self.reason = "max_nonces"
        return self.reason or "exhausted"

    def receive(self, msg) -> None:
        """One message of this job from a replica: its model is built, a batch's result, its ranks' figures, done."""
        if msg[0] == "started":
            self.t_start = self.t_start or time.perf_counter()
        elif msg[0] == "result":
            t_result = time.perf_counter()
            _, _, r, seq, payload, secs = msg
            payload["replica"] = r
            nonces = payload.pop("nonces")
            self.computed += len(nonces)
            self.batches += 1
            self.flight.reported(r)
            b = BatchResult(index=self.batches, nonces=nonces, elapsed=time.perf_counter() - self.t_start,
                            batch_seconds=secs, dist=payload.get("dist"), artifacts=payload.get("artifacts"),
                            dropped=payload.get("dropped", []))
            n = self.flight.out[r]
            self.deal(r)  # first: the consumer's time (a stream line, a callback's spooling) is not the devices'
            self.flight.redealt(r, t_result, self.flight.out[r] > n)
            t_emit = time.perf_counter()
            self.on_result(seq, b, payload)
            self.flight.emit_s += time.perf_counter() - t_emit
        elif msg[0] == "stats":
            self.flight.ranks += [x for x in msg[3] or [] if x is not None]
        elif msg[0] == "done":
            self.done[msg[2]] = True

    def deal(self, r: int) -> None:
        """Replica r's next batch, or the end of its dealing (a stop, the deadline, the nonces exhausted or failed)."""
        if self.ended[r]:
            return
        if self.stop.is_set():
            return self.end_all("stopped", True)
        if self.over_time():
            return self.end_all("max_duration", True)
        try:
            nonces = self.dealer.next()
        except Exception as e:  # noqa: BLE001 - raised once the batches already launched are emitted
            self.failure = e
            return self.end_all("error", True)
        if not nonces:
            return self.end_all("exhausted", False)
        self.g.post(self.L.leader(r), ("batch", self.jid, next(self.seqs), nonces))
        self.flight.dealt(r)

    def end_all(self, why: str, drop: bool) -> None:
        """End every replica's dealing (`drop`: the batches it has not launched are dropped)."""
        self.reason = self.reason or why
        for r in range(self.L.replicas):
            if not self.ended[r]:
                self.ended[r] = True
                self.flight.ended(r)
                self.g.post(self.L.leader(r), ("end", self.jid, drop))

    def over_time(self) -> bool:
        return (self.lim.max_duration is not None and self.t_start is not None
                and time.perf_counter() - self.t_start >= self.lim.max_duration)

    def finish_on_error(self) -> None:
        """emit failed: end the job on the ranks so they stay in step (the results still arriving have no consumer
        left); ranks that do not end it break the engine rather than meet the next job mid-job."""
        self.end_all("error", True)
        timeout = self.engine.timeout
        wait_until = time.monotonic() + timeout
        while not all(self.done) and time.monotonic() < wait_until:
            msg = self.g.next(0.1)
            if msg is not None and msg[0] == "done" and msg[1] == self.jid:
                self.done[msg[2]] = True
        if not all(self.done):
            self.g.fail(f"replica(s) {[r for r in range(self.L.replicas) if not self.done[r]]} did not end job "
                        f"{self.jid} within {timeout:.0f} s of an error")


class DistEngine(EngineBase):
    """The engine interface (EngineBase) over layout.world rank processes: it loads the checkpoint on them, deals each
    job's batches (JobRun) and runs the one-shot helpers; its RankGroup runs the processes."""

    def __init__(self, device: str | None = None, model_dir: "str | ModelSource | None" = None, dtype: str = "auto",
                 tp: int = 1, pp: int = 1, world: int | None = None, timeout: float = 300.0,
                 start_timeout: float = 180.0, log_level: str | None = None, compile: bool | str = False,
                 options: ModelOptions | None = None, stage_delay: float = 0.0,
                 diagnostics: RankDiagnostics | None = None):
        super().__init__(loading=bool(model_dir))
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            self.device = torch.device("cuda", 0)  # the engine spans devices 0..world-1; this names the first
        self.layout = Layout(world or tp * pp, tp, pp)
        if self.device.type == "cuda" and self.layout.world > torch.cuda.device_count():
            raise InputError(f"{self.layout.world} ranks need {self.layout.world} GPUs; "
                             f"{torch.cuda.device_count()} are visible", "devices")
        self.model_dir, self.dtype_flag = model_dir, dtype
        self.timeout, self.start_timeout = timeout, start_timeout
        self.log_level = log_level or logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.v2: ModelInfo | None = None
        self.rank_free: dict[int, int] = {}  # rank -> free GPU bytes, as last reported (free_bytes)
        self.last_v1: tuple | None = None  # (params, dtype) of the v1 model the ranks hold: freed before the next
        # as Engine (compute.compile_flags); CUDA only (the collectives inside the layer are traced)
        self.compile_v1, self.compile_v2 = compile_flags(compile, self.device)
        self.compile = self.compile_v2
        self.options = options or ModelOptions()  # the ranks build and compute their models so (RankConfig)
        self.diagnostics = diagnostics or RankDiagnostics()  # the ranks' (RankConfig): stage timing, profiles
        self.stage_delay = stage_delay  # tests and CPU smoke runs: seconds a rank sleeps after each forward
        self.last_job_stats: dict | None = None  # the last job's pipeline figures (JobFlight.summary)
        self._ranks: RankGroup | None = None
        self._job_ids = itertools.count(1)

    # ------------------------------------------------------------------------------------ processes

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, by rank."""
        return self._ranks.pids if self._ranks else []

    def rank_config(self) -> RankConfig:
        """What every rank is told: the layout, the backend, this engine's settings (store_port 0: rank 0's own)."""
        cuda = self.device.type == "cuda"
        return RankConfig(layout=self.layout, backend="nccl" if cuda else "gloo", device_type=self.device.type,
                          store_port=0, timeout_s=self.timeout,
                          threads=1 if cuda else max(1, (os.cpu_count() or 1) // self.layout.world),
                          log_level=self.log_level, compile_v1=self.compile_v1, compile_v2=self.compile_v2,
                          options=self.options, stage_delay_s=self.stage_delay, diagnostics=self.diagnostics)

    def new_group(self) -> RankGroup:
        """A group of rank processes for this engine, not yet started: its failure breaks the engine, its ranks'
        free-memory reports are recorded (free_bytes)."""
        return RankGroup(self.rank_config(), on_fail=self.mark_broken, on_memory=self._free_reported)

    def _free_reported(self, rank: int, free: int) -> None:
        self.rank_free[rank] = free

    def start(self) -> None:
        """Start the rank processes and wait until every one has joined the process group."""
        if self._ranks is not None:
            return
        g = self.new_group()
        g.start(self.start_timeout)
        self._ranks = g

    def restart(self) -> None:
        """Kill every rank, start fresh ones and reload the checkpoint: a broken engine comes back clean."""
        self._shutdown(graceful=False)
        self.clear_broken()
        self.load()

    def close(self) -> None:
        self._shutdown(graceful=True)

    def _shutdown(self, graceful: bool) -> None:
        g, self._ranks = self._ranks, None
        self.rank_free, self.last_v1 = {}, None  # what the gone ranks held and reported
        if g is not None:
            g.shutdown(graceful)

    # ------------------------------------------------------------------------------------ models

    def _load(self) -> None:
        """Start the ranks and load the checkpoint given at start (each rank reads its own slices)."""
        t0 = time.perf_counter()
        src = self.source
        cfg = src.config() if src is not None else None
        if src is not None:  # refuse an uneven split here, before any process starts
            self.layout.check_config(cfg, f"model {src.name}")
        self.start()
        if src is not None:
            dtype = self.v2_dtype_arg()
            g = self._ranks
            for r in range(self.layout.replicas):
                g.send(self.layout.leader(r), ("load", src, dtype))
            infos = g.wait_all("loaded", self.layout.world, limit=3600.0)
            self.rank_free = {i: info["free"] for i, info in enumerate(infos) if info.get("free") is not None}
            self.v2 = ModelInfo(cfg, src.name, DTYPES[infos[0]["dtype"]], infos[0]["computes"])
        self.load_seconds = time.perf_counter() - t0

    v2_dtype_arg = Engine.v2_dtype_arg

    def preflight(self, model_dir: str) -> ModelConfig:
        cfg = super().preflight(model_dir)
        self.layout.check_config(cfg, f"model {Path(model_dir).name}")  # an uneven split, before the ranks go
        return cfg

    def _unload(self) -> None:
        """Live ranks drop their checkpoint when they get the next one ("load" frees it first); ranks a failure
        killed are cleared, and `_load` starts fresh ones."""
        if self._ranks is not None and self._ranks.closing:
            self._shutdown(graceful=False)

    def _release(self) -> None:
        """The ranks exit (their memory goes with them); `_load` starts fresh ones that hold no checkpoint."""
        self._shutdown(graceful=True)

    def _ready_ranks(self) -> RankGroup:
        if self.broken_reason:
            raise RankFailure(f"the engine is broken ({self.broken_reason}): restart it")
        if self._ranks is None:
            self.start()
        return self._ranks

    def parallel_dims(self) -> tuple[int, int, int]:
        return self.layout.tp, self.layout.pp, self.layout.world

    @property
    def replicas(self) -> int:
        return self.layout.replicas

    def v1_held_bytes(self) -> int:
        """Each rank frees its shard of the last v1 model before the next build."""
        if self.last_v1 is None:
            return 0
        return memory.v1_weight_bytes(*self.last_v1)[0] // (self.layout.tp * self.layout.pp)

    def release_v1(self) -> int:
        """Each rank drops its shard of the last v1 model (a command between jobs: the caller holds the claim)."""
        held, g = self.v1_held_bytes(), self._ranks
        if held == 0 or g is None or g.closing or self.broken_reason:
            return 0
        for r in range(self.layout.replicas):
            g.send(self.layout.leader(r), ("drop_v1",))
        self.last_v1 = None
        return held

    def free_bytes(self) -> int | None:
        """The tightest GPU's free memory (free + cached-but-unused) as the ranks last reported it (after loading,
        after each job); None on the CPU or before any report."""
        return min(self.rank_free.values()) if self.rank_free else None

    def check_v1(self, params: v1.V1Params) -> None:
        """Refuse v1 params whose model does not split over this layout, naming the numbers."""
        from poc.model.random_init import v1_config

        self.layout.check_config(v1_config(params), "the v1 model of these params")

    # ------------------------------------------------------------------------------------ jobs

    def run(self, job: V1Job | V2Job, emit: Callable[[BatchResult], None], stop: threading.Event,
            claim: Claim | None = None) -> JobSummary:
        with self.exclusive(claim):
            return self._run(job, lambda seq, b, payload: emit(b), stop)

    def _run(self, job, on_result, stop: threading.Event, opts: dict | None = None) -> JobSummary:
        """Hand each replica's leader the job, then deal its batches (JobRun); on_result(seq, BatchResult, payload)
        as each arrives."""
        t0 = time.perf_counter()
        if isinstance(job, V1Job):
            self.check_v1(job.params)
            self.last_v1 = (job.params, job.dtype)  # the ranks build it for this job and keep it
        else:  # refused here: a rank that raised on it would break the engine
            self._check_v2(job.seq_len, job.k_dim)
        g = self._ready_ranks()
        jid = next(self._job_ids)
        spec = dataclasses.replace(job, nonces=None)  # the iterator stays here: batches go out as lists
        for r in range(self.layout.replicas):
            g.send(self.layout.leader(r), ("job", jid, spec, opts or {}))
        deal = JobRun(self, g, job, jid, on_result, stop)
        reason = deal.run()
        self.last_job_stats = deal.flight.summary()
        log.info("job %d pipeline: %s", jid, json.dumps(self.last_job_stats, separators=(",", ":")))
        return JobSummary(reason=reason, batches=deal.batches, computed=deal.computed,
                          elapsed=time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------ one-shot helpers

    def _collect(self, job, opts: dict | None = None) -> list[tuple[BatchResult, dict]]:
        """Every batch of a finite job, in the nonces' order."""
        out: dict[int, tuple[BatchResult, dict]] = {}
        with self.exclusive():
            self._run(job, lambda seq, b, payload: out.__setitem__(seq, (b, payload)), threading.Event(), opts)
        return [out[k] for k in sorted(out)]

    def v1_distances(self, params: v1.V1Params, block_hash: str, public_key: str, nonces: Sequence[int],
                     dtype: str = "float16", batch_size: int = 64) -> np.ndarray:
        """Distances for explicit nonces (validation, the CLI)."""
        job = V1Job(block_hash, public_key, 0, params, 0.0, iter(list(nonces)), batch_size, dtype,
                    Limits(max_nonces=None, max_duration=None))
        parts = [b.dist for b, _ in self._collect(job)]
        return np.concatenate(parts) if parts else np.empty(0)

    def v2_artifacts(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                     stronger_rng: bool = False, batch_size: int = 32) -> tuple[list[dict], list[int]]:
        arts, dropped = [], []
        for b, _ in self._collect(self._v2_job(block_hash, public_key, nonces, seq_len, k_dim, stronger_rng,
                                               batch_size)):
            arts += b.artifacts
            dropped += b.dropped
        return arts, dropped

    def v2_vectors(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                   stronger_rng: bool = False, batch_size: int = 32) -> np.ndarray:
        """(N, k) float32 unit vectors before the fp16 encoding (for comparing numerics)."""
        job = self._v2_job(block_hash, public_key, nonces, seq_len, k_dim, stronger_rng, batch_size)
        parts = [p["vectors"] for _, p in self._collect(job, {"vectors": True})]
        return np.concatenate(parts) if parts else np.empty((0, k_dim), np.float32)

    def _check_v2(self, seq_len: int, k_dim: int) -> None:
        """Refuse a v2 shape the ranks cannot run, before any of them sees it."""
        cfg = self.require_v2().cfg
        if not 1 <= k_dim <= cfg.dim:
            raise InputError(f"k_dim must be in [1, {cfg.dim}] (the model's hidden size), got {k_dim}", "k_dim")
        if seq_len < 1:
            raise InputError(f"seq_len must be >= 1, got {seq_len}", "seq_len")

    def _v2_job(self, block_hash, public_key, nonces, seq_len, k_dim, stronger_rng, batch_size) -> V2Job:
        self._check_v2(seq_len, k_dim)
        return V2Job(block_hash, public_key, 0, seq_len, k_dim, iter(list(nonces)), batch_size, stronger_rng,
                     Limits(max_nonces=None, max_duration=None))

