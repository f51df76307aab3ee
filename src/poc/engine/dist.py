"""DistEngine: the Engine interface over replicas x pp x tp rank processes (poc.engine.factory picks it).

The server process never joins the process group. It starts `python -m poc.engine.ranks` once per rank (a
fresh interpreter: a spawned child would re-import the server's __main__, aiohttp and all), talks to them over
authenticated local sockets, hands each replica's leader the job and then its batches of nonces, and merges the
replicas' results into emit() in arrival order. Nonces are dealt by the rule the one-device Engine follows too
(jobs.Dealer): from the job's one iterator, a batch at a time, to whichever replica has room (pp + 2 batches a
replica), so the replicas' streams are disjoint and together exactly the job's, and a faster replica takes more.

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
import queue
import secrets
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from poc.engine.compute import DTYPES, compile_flags, resolve_device
from poc.engine import memory
from poc.engine.base import Claim, EngineBase, ModelInfo
from poc.engine.engine import Engine
from poc.engine.jobs import BatchResult, Dealer, JobSummary, Limits, V1Job, V2Job
from poc.errors import InputError
from poc.model.config import ModelConfig
from poc.model.options import ModelOptions
from poc.model.random_weights import random_spec
from poc.parallel.layout import Layout, RankConfig, RankDiagnostics
from poc.protocol import v1

log = logging.getLogger("poc.parallel")
SRC = str(Path(__file__).resolve().parents[2])  # the directory holding the poc package, for the ranks' sys.path


class RankFailure(RuntimeError):
    """A rank died, failed or timed out: the engine is broken until restart()."""


class _Ranks:
    """One generation of rank processes and their connections."""

    def __init__(self, world: int):
        self.procs: list[subprocess.Popen] = []
        self.conns: dict[int, Connection] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.closing = False
        self.locks = [threading.Lock() for _ in range(world)]
        self.reader: threading.Thread | None = None

    def send(self, rank: int, msg) -> None:
        with self.locks[rank]:
            self.conns[rank].send(msg)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)

    def close_conns(self) -> None:
        for c in self.conns.values():
            with contextlib.suppress(OSError):
                c.close()


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


class DistEngine(EngineBase):
    """The engine interface (EngineBase) over layout.world rank processes."""

    def __init__(self, device: str | None = None, model_dir: str | None = None, dtype: str = "auto", tp: int = 1,
                 pp: int = 1, world: int | None = None, timeout: float = 300.0, start_timeout: float = 180.0,
                 log_level: str | None = None, compile: bool | str = False, options: ModelOptions | None = None,
                 stage_delay: float = 0.0, diagnostics: RankDiagnostics | None = None):
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
        self._ranks: _Ranks | None = None
        self._job_ids = itertools.count(1)

    # ------------------------------------------------------------------------------------ processes

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, by rank."""
        return [p.pid for p in self._ranks.procs] if self._ranks else []

    def start(self) -> None:
        """Start the rank processes and wait until every one has joined the process group."""
        if self._ranks is not None:
            return
        L = self.layout
        g = _Ranks(L.world)
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        cuda = self.device.type == "cuda"
        threads = 1 if cuda else max(1, (os.cpu_count() or 1) // L.world)
        env = dict(os.environ, POC_RANK_KEY=key.hex(), OMP_NUM_THREADS=str(threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
        addr = f"127.0.0.1:{listener.address[1]}"
        log.info("starting %d rank processes: %d replica(s) x pp=%d x tp=%d on %s", L.world, L.replicas, L.pp,
                 L.tp, "cuda" if cuda else "cpu")
        try:
            g.procs = [subprocess.Popen([sys.executable, "-m", "poc.engine.ranks", addr, str(r)], env=env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL) for r in range(L.world)]
            deadline = time.monotonic() + self.start_timeout
            conns = self._accept(listener, g, deadline)
            for c in conns:
                msg = self._recv(c, g, deadline)
                g.conns[msg[1]] = c
            cfg = RankConfig(layout=L, backend="nccl" if cuda else "gloo", device_type=self.device.type,
                             store_port=0, timeout_s=self.timeout, threads=threads, log_level=self.log_level,
                             compile_v1=self.compile_v1, compile_v2=self.compile_v2, options=self.options,
                             stage_delay_s=self.stage_delay, diagnostics=self.diagnostics)
            g.send(0, cfg)
            msg = self._recv(g.conns[0], g, deadline)
            if msg[0] != "store":
                raise RankFailure(f"rank 0 did not start: {msg}")
            for r in range(1, L.world):
                g.send(r, dataclasses.replace(cfg, store_port=msg[1]))
            for r in range(L.world):
                msg = self._recv(g.conns[r], g, deadline)
                if msg[0] != "ready":
                    raise RankFailure(f"rank {r} did not start: {msg[2] if msg[0] == 'error' else msg}")
        except BaseException:
            g.closing = True
            g.kill()
            g.close_conns()
            raise
        finally:
            listener.close()
        g.reader = threading.Thread(target=self._read, args=(g,), name="poc-ranks-reader", daemon=True)
        g.reader.start()
        self._ranks = g

    def _accept(self, listener: Listener, g: _Ranks, deadline: float) -> list[Connection]:
        conns: list[Connection] = []

        def accept():
            with contextlib.suppress(OSError, EOFError):
                while len(conns) < len(g.procs):
                    conns.append(listener.accept())

        t = threading.Thread(target=accept, name="poc-ranks-accept", daemon=True)
        t.start()
        while len(conns) < len(g.procs):
            self._check_procs(g, deadline, "connect")
            time.sleep(0.02)
        t.join()
        return conns

    def _check_procs(self, g: _Ranks, deadline: float, what: str) -> None:
        for r, p in enumerate(g.procs):
            if p.poll() is not None:
                raise RankFailure(f"rank {r} exited with code {p.returncode} before it could {what}")
        if time.monotonic() > deadline:
            raise RankFailure(f"the rank processes did not {what} within {self.start_timeout:.0f} s")

    def _recv(self, c: Connection, g: _Ranks, deadline: float):
        while not c.poll(0.05):
            self._check_procs(g, deadline, "start")
        try:
            return c.recv()
        except (EOFError, OSError):
            self._check_procs(g, time.monotonic() + 5, "start")
            raise RankFailure("a rank closed its connection while starting") from None

    def _read(self, g: _Ranks) -> None:
        """Move every rank's messages into the inbox; a closed connection or an error report breaks the engine."""
        live = {c: r for r, c in g.conns.items()}
        while live and not g.closing:
            for c in wait(list(live), timeout=0.5):
                r = live[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del live[c]
                    if not g.closing:
                        code = None
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            code = g.procs[r].wait(timeout=2)
                        self._fail(g, f"rank {r} (pid {g.procs[r].pid}) exited"
                                      + (f" with code {code}" if code is not None else ""), drain=list(live))
                    continue
                if msg[0] == "error":
                    # a dead peer makes the survivors' collectives fail first ("connection reset"): name the
                    # rank that actually died when there is one, not the one that noticed
                    dead = self._dead_rank(g, wait_s=1.0, exclude=msg[1])
                    self._fail(g, f"rank {dead[0]} (pid {dead[1]}) exited with code {dead[2]}; rank {msg[1]} then "
                                  f"failed: {msg[2]}" if dead else f"rank {msg[1]} failed: {msg[2]}", drain=list(live))
                else:
                    g.inbox.put(msg)

    @staticmethod
    def _dead_rank(g: _Ranks, wait_s: float, exclude: int) -> tuple[int, int, int] | None:
        """(rank, pid, exit code) of a rank other than `exclude` (the reporter, which may abort itself after
        reporting) that has exited, waiting up to wait_s for one."""
        end = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(g.procs):
                code = None if r == exclude else p.poll()
                if code is not None:
                    return r, p.pid, code
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def _fail(self, g: _Ranks, reason: str, drain: Sequence[Connection] = ()) -> None:
        """Mark the engine broken, wake the running job, and stop every other rank (no hang on a dead peer).
        The reader passes the ranks' connections as `drain`: what the ranks sent before they were stopped (results
        of other replicas still in the sockets) goes to the job ahead of the failure."""
        if g.closing or g is not self._ranks:
            return
        g.closing = True
        log.error("engine broken: %s; stopping the other ranks", reason)
        g.kill()  # first: when the job sees the failure, no rank is left running
        for c in drain:  # the ranks have exited: each connection holds what was sent, then EOF
            with contextlib.suppress(EOFError, OSError):
                while c.poll(0):
                    msg = c.recv()
                    if msg[0] != "error":
                        g.inbox.put(msg)
        self.mark_broken(reason)
        g.inbox.put(("failed", reason))

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
        if g is None:
            return
        g.closing = True
        g.inbox.put(("failed", "the engine was closed"))  # a job still waiting ends now
        if graceful:
            for r in range(self.layout.replicas):
                with contextlib.suppress(OSError, KeyError):
                    g.send(self.layout.leader(r), ("exit",))
            end = time.monotonic() + 10
            for p in g.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.1, end - time.monotonic()))
        g.kill()
        g.close_conns()
        if g.reader is not None:
            g.reader.join(timeout=5)

    # ------------------------------------------------------------------------------------ models

    def _load(self) -> None:
        """Start the ranks and load the checkpoint given at start (each rank reads its own slices)."""
        t0 = time.perf_counter()
        if self.model_dir:  # refuse an uneven split here, before any process starts
            self.layout.check_config(_model_config(self.model_dir), f"model {Path(self.model_dir).name}")
        self.start()
        if self.model_dir:
            dtype = self.v2_dtype_arg()
            g = self._ranks
            for r in range(self.layout.replicas):
                g.send(self.layout.leader(r), ("load", self.model_dir, dtype))
            infos = self._wait_all(g, "loaded", self.layout.world, limit=3600.0)
            self.rank_free = {i: info["free"] for i, info in enumerate(infos) if info.get("free") is not None}
            cfg = _model_config(self.model_dir)
            self.v2 = ModelInfo(cfg, Path(self.model_dir).name, DTYPES[infos[0]["dtype"]], infos[0]["computes"])
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

    def _wait_all(self, g: _Ranks, kind: str, n: int, limit: float) -> list:
        out, last = [], time.monotonic()
        while len(out) < n:
            msg = self._next(g, 0.5)
            if msg is None:
                self._watchdog(g, last, limit)
            elif msg[0] == kind:
                out.append(msg[2])
                last = time.monotonic()
        return out

    def _next(self, g: _Ranks, timeout: float):
        """The next message from the ranks, None after `timeout` s; RankFailure if the engine broke. The messages
        the ranks sent before the failure come first (results reported before it are still emitted); _fail queues
        ("failed", reason) after them. A rank's ("memory", rank, free bytes) report is recorded here (free_bytes)
        and not returned."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = g.inbox.get(timeout=0 if self.broken_reason else max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                if self.broken_reason:
                    raise RankFailure(self.broken_reason) from None
                return None
            if msg[0] != "memory":
                break
            self.rank_free[msg[1]] = msg[2]
        if msg[0] == "failed":
            raise RankFailure(msg[1])
        return msg

    def _watchdog(self, g: _Ranks, last: float, limit: float) -> None:
        """Break the engine when the ranks have said nothing for `limit` s (a hang the ranks did not catch)."""
        if time.monotonic() - last > limit:
            self._fail(g, f"no word from the ranks for {limit:.0f} s")
            raise RankFailure(self.broken_reason)

    def _ready_ranks(self) -> _Ranks:
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
        """Deal batches of the job's nonces to the replicas by the engines' rule (jobs.Dealer: batches_ahead() each,
        a result's replacement dealt before the result goes to the consumer); stop/limits end the dealing, and every batch a replica launched
        is still reported (the leaders drop batches not yet launched on a stop)."""
        t0 = time.perf_counter()
        if isinstance(job, V1Job):
            self.check_v1(job.params)
            self.last_v1 = (job.params, job.dtype)  # the ranks build it for this job and keep it
        else:  # refused here: a rank that raised on it would break the engine
            self._check_v2(job.seq_len, job.k_dim)
        g = self._ready_ranks()
        L, jid, lim = self.layout, next(self._job_ids), job.limits
        spec = dataclasses.replace(job, nonces=None)  # the iterator stays here: batches go out as lists
        for r in range(L.replicas):
            g.send(L.leader(r), ("job", jid, spec, opts or {}))
        computed = batches = 0
        dealer = Dealer(job, L.replicas, L.pp)
        seqs = itertools.count(1)
        ended, done = [False] * L.replicas, [False] * L.replicas
        reason = None
        failure: Exception | None = None  # the nonce iterator's error: the job ends as on a stop, then raises it
        # the clock starts when a replica reports its model built ("started"): max_duration counts compute, not a
        # v1 model's build, as on one device; the batches dealt ahead meanwhile wait in the ranks' queues
        t_start, last = None, time.monotonic()
        flight = JobFlight(L.replicas, dealer.ahead)

        def post(r: int, msg) -> None:
            if not g.closing:  # a broken engine's ranks are gone; the results they sent before are still emitted
                g.send(L.leader(r), msg)

        def end_all(why: str, drop: bool) -> None:
            nonlocal reason
            reason = reason or why
            for r in range(L.replicas):
                if not ended[r]:
                    ended[r] = True
                    flight.ended(r)
                    post(r, ("end", jid, drop))

        def over_time() -> bool:
            return (lim.max_duration is not None and t_start is not None
                    and time.perf_counter() - t_start >= lim.max_duration)

        def deal(r: int) -> None:
            nonlocal failure
            if ended[r]:
                return
            if stop.is_set():
                return end_all("stopped", True)
            if over_time():
                return end_all("max_duration", True)
            try:
                nonces = dealer.next()
            except Exception as e:  # noqa: BLE001 - raised once the batches already launched are emitted
                failure = e
                return end_all("error", True)
            if not nonces:
                return end_all("exhausted", False)
            post(r, ("batch", jid, next(seqs), nonces))
            flight.dealt(r)

        def finish_on_error() -> None:
            """emit failed: end the job on the ranks so they stay in step (the results still arriving have no
            consumer left); ranks that do not end it break the engine rather than meet the next job mid-job."""
            end_all("error", True)
            wait_until = time.monotonic() + self.timeout
            while not all(done) and time.monotonic() < wait_until:
                msg = self._next(g, 0.1)
                if msg is not None and msg[0] == "done" and msg[1] == jid:
                    done[msg[2]] = True
            if not all(done):
                self._fail(g, f"replica(s) {[r for r in range(L.replicas) if not done[r]]} did not end job {jid} "
                              f"within {self.timeout:.0f} s of an error")

        try:
            for r in dealer.first():
                deal(r)
            while not all(done):
                msg = self._next(g, 0.1)
                if msg is None:  # no result yet: a stop or the deadline still drops what is not launched
                    if stop.is_set() and not all(ended):
                        end_all("stopped", True)
                    elif over_time() and not all(ended):
                        end_all("max_duration", True)
                    self._watchdog(g, last, self.timeout + 60)
                    continue
                last = time.monotonic()
                if msg[1] != jid:
                    continue  # a late message of an earlier job
                if msg[0] == "started":
                    t_start = t_start or time.perf_counter()
                elif msg[0] == "result":
                    t_result = time.perf_counter()
                    _, _, r, seq, payload, secs = msg
                    payload["replica"] = r
                    nonces = payload.pop("nonces")
                    computed += len(nonces)
                    batches += 1
                    flight.reported(r)
                    b = BatchResult(index=batches, nonces=nonces, elapsed=time.perf_counter() - t_start,
                                    batch_seconds=secs, dist=payload.get("dist"),
                                    artifacts=payload.get("artifacts"), dropped=payload.get("dropped", []))
                    n = flight.out[r]
                    deal(r)  # first: the consumer's time (a stream line, a callback's spooling) is not the devices'
                    flight.redealt(r, t_result, flight.out[r] > n)
                    t_emit = time.perf_counter()
                    on_result(seq, b, payload)
                    flight.emit_s += time.perf_counter() - t_emit
                elif msg[0] == "stats":
                    flight.ranks += [x for x in msg[3] or [] if x is not None]
                elif msg[0] == "done":
                    done[msg[2]] = True
        except RankFailure:
            raise
        except BaseException:
            with contextlib.suppress(Exception):
                finish_on_error()
            raise
        if failure is not None:
            raise failure
        if reason == "exhausted" and lim.max_nonces is not None and computed >= lim.max_nonces:
            reason = "max_nonces"
        self.last_job_stats = flight.summary()
        log.info("job %d pipeline: %s", jid, json.dumps(self.last_job_stats, separators=(",", ":")))
        return JobSummary(reason=reason or "exhausted", batches=batches, computed=computed,
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


def _model_config(model_dir: str) -> ModelConfig:
    spec = random_spec(model_dir)
    return spec[0] if spec else ModelConfig.from_hf(model_dir)
