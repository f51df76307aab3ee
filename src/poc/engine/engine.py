"""The one-device engine (EngineBase in this process): runs one job at a time batch by batch.

`Engine.run(job, emit, stop)` is blocking and meant for a worker thread: it calls `emit(BatchResult)` as
soon as each batch is on the host and returns a JobSummary. The next batch's host work (seeds, numpy RNG)
runs on a helper thread while the device computes the current one.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Sequence

import numpy as np
import torch

from poc.engine import memory
from poc.engine.base import EngineBase
from poc.engine.compute import DTYPE_NAMES, DTYPES, V1Compute, V2Compute, compile_flags, resolve_device
from poc.engine.jobs import BatchResult, Dealer, JobSummary, V1Job
from poc.logs import name_os_thread
from poc.model.options import ModelOptions
from poc.model.source import ModelSource
from poc.model.random_init import BuildStopped
from poc.protocol import v1

log = logging.getLogger("poc.engine")
PREPARE_THREAD = "poc-prepare"  # the thread that draws the next batch's inputs (its OS name too)


class Engine(EngineBase):
    """One device, in this process: the v1 model of the last job kept, the v2 checkpoint loaded at start."""

    def __init__(self, device: str | None = None, model_dir: "str | ModelSource | None" = None, dtype: str = "auto",
                 compile: bool | str = False, v1_input_workers: int | None = None, options: ModelOptions | None = None):
        super().__init__(loading=bool(model_dir))
        self.device = resolve_device(device)
        memory.return_freed_memory()  # a freed v1 model's memory leaves the process (CPU peaks match the estimate)
        # torch.compile at fixed batch shapes, CUDA only (compute.compile_flags)
        self.compile_v1, self.compile_v2 = compile_flags(compile, self.device)
        self.compile = self.compile_v2
        if v1_input_workers is None:  # on a GPU box the numpy RNG needs many cores to keep up
            v1_input_workers = max(1, min(16, (os.cpu_count() or 2) - 2)) if self.device.type == "cuda" else 0
        self.v1_input_workers = v1_input_workers
        self._executor = None  # the v1 input processes, started by load()
        self.model_dir = model_dir
        self.options = options or ModelOptions()  # FP8 forward, scales, experts, kernels, v1 pool threads
        self.dtype_flag = dtype
        self.v2: V2Compute | None = None
        self._v1: V1Compute | None = None
        self._prep_pool = ThreadPoolExecutor(1, thread_name_prefix=PREPARE_THREAD, initializer=name_os_thread,
                                             initargs=(PREPARE_THREAD,))

    # ---------------------------------------------------------------------------------------- models

    def _load(self) -> None:
        """Warm up torch (its first model build costs ~2 s, once), start the v1 input processes, and load the v2
        checkpoint given at start."""
        self._warmup()
        if self.v1_input_workers > 0 and self._executor is None:
            from poc.engine.v1inputs import make_executor
            self._executor = make_executor(self.v1_input_workers)
        if self.source is None:
            return
        from poc.parallel.build import build

        t0 = time.perf_counter()
        o = replace(self.options, compiled=self.compile_v2)  # built for the layers it runs: compiled on CUDA
        # a checkpoint directory, or random weights of a preset shape (random:<preset>[:fp8]): benchmarks and demos
        # no progress bar: its \r updates went into the server log (the load's time is logged when it ends)
        model, cfg = build(self.source, self.v2_dtype_arg(), self.device, options=o, progress=False)
        self.v2 = V2Compute(model, cfg, next(model.parameters()).dtype, self.device, self.source.name,
                            self.compile_v2)
        self.load_seconds = time.perf_counter() - t0

    def _unload(self) -> None:
        self.v2 = None
        gc.collect()  # the model's tensors go now, before the next checkpoint is read
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _warmup(self) -> None:
        tiny = v1.V1Params(dim=64, n_layers=1, n_heads=4, n_kv_heads=4, vocab_size=64, ffn_dim_multiplier=None,
                           multiple_of=32, norm_eps=1e-5, rope_theta=1e4, use_scaled_rope=False, seq_len=4)
        c = V1Compute(tiny, "warmup", torch.float32, self.device)
        c.run(c.prepare("warmup", [0, 1]))
        c.close()

    def v2_dtype_arg(self):
        """"auto": the checkpoint's dtype on CUDA, float32 on CPU (CPU half-precision matmuls are slow and
        the golden data is float32)."""
        if self.dtype_flag == "auto":
            return "auto" if self.device.type == "cuda" else torch.float32
        return DTYPES[self.dtype_flag]

    def v1_compute(self, params: v1.V1Params, block_hash: str, dtype: str, stop=None) -> V1Compute:
        """The v1 model for (params, block_hash, dtype), reused while they stay the same. A set `stop` gives a
        build up (random_init.BuildStopped), leaving no model behind."""
        key = (params, block_hash, DTYPES[dtype])
        if self._v1 is None or self._v1.key() != key:
            if self._v1 is not None:
                self._v1.close()
            self._v1 = None  # free the old model before building the next
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            c = V1Compute(params, block_hash, DTYPES[dtype], self.device, self.compile_v1, self.v1_input_workers,
                          self._executor, stop=stop, pool_workers=self.options.pool_workers)
            log.info("v1 model built: dim=%d layers=%d dtype=%s in %.1f s", params.dim, params.n_layers, dtype,
                     c.build_seconds)
            self._v1 = c
        return self._v1

    def build_v1(self, params: v1.V1Params, block_hash: str, dtype: str) -> None:
        self.v1_compute(params, block_hash, dtype)

    def v1_held_bytes(self) -> int:
        c = self._v1
        return memory.v1_weight_bytes(c.params, DTYPE_NAMES[c.dtype])[0] if c is not None else 0

    def release_v1(self) -> int:
        held = self.v1_held_bytes()
        c, self._v1 = self._v1, None
        if c is not None:
            c.close()
            del c
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return held

    # ------------------------------------------------------------------------------------ jobs

    def run(self, job, emit, stop, claim=None) -> JobSummary:
        with self.exclusive(claim):
            return self._run(job, emit, stop)

    def _run(self, job, emit, stop) -> JobSummary:
        """Pipelined: host prepares batch i+2 while the device runs batch i+1 and batch i is collected.

        Every launched batch is collected and emitted, also when a stop arrives: computed work is never
        dropped. max_nonces is counted at preparation, so no nonce past it is computed."""
        t0 = time.perf_counter()
        if isinstance(job, V1Job):
            try:
                comp = self.v1_compute(job.params, job.block_hash, job.dtype, stop)
            except BuildStopped:  # the client went away during the build: the device is free at once
                log.info("v1 model build stopped after %.1f s", time.perf_counter() - t0)
                return JobSummary(reason="stopped", batches=0, computed=0, elapsed=time.perf_counter() - t0)

            def prepare(nonces):
                return comp.prepare(job.public_key, nonces)
        else:
            comp = self.require_v2()

            def prepare(nonces):
                return comp.prepare(job.block_hash, job.public_key, nonces, job.seq_len, job.k_dim, job.stronger_rng)

        lim = job.limits
        computed = batches = 0
        dealer = Dealer(job)  # the engines' dealing rule; this loop holds its batches_ahead(): prepared, run, collected
        t_start = time.perf_counter()  # the duration limit counts compute, not the model build

        def submit_next():
            nonces = dealer.next()
            return self._prep_pool.submit(prepare, nonces) if nonces else None

        def finish(inflight) -> None:
            nonlocal computed, batches
            h, tl = inflight
            out = comp.collect(h)
            now = time.perf_counter()
            computed += len(h.prep.nonces)
            batches += 1
            emit(BatchResult(index=batches, nonces=h.prep.nonces, elapsed=now - t_start, batch_seconds=now - tl,
                             **out))

        fut = submit_next()
        inflight = None  # (handle, launch time)
        reason = "exhausted"
        while fut is not None or inflight is not None:
            handle = None
            if fut is not None:
                if stop.is_set():
                    reason = "stopped"
                elif lim.max_duration is not None and time.perf_counter() - t_start >= lim.max_duration:
                    reason = "max_duration"
                else:
                    try:
                        prep = fut.result()
                        fut = submit_next()
                        handle = (comp.launch(prep, pad_to=job.batch_size), time.perf_counter())
                    except BaseException:  # the job fails, but the batch already launched is computed: emit it
                        if fut is not None:
                            fut.cancel()
                        if inflight is not None:
                            with contextlib.suppress(Exception):
                                finish(inflight)
                        raise
                if handle is None:  # stopping: drop the prepared-but-not-launched batch, finish the in-flight one
                    fut.cancel()
                    fut = None
            if inflight is not None:
                finish(inflight)
            inflight = handle
        if lim.max_nonces is not None and computed >= lim.max_nonces and reason == "exhausted":
            reason = "max_nonces"
        return JobSummary(reason=reason, batches=batches, computed=computed, elapsed=time.perf_counter() - t0)

    # ------------------------------------------------------------------------- one-shot helpers

    def v1_distances(self, params: v1.V1Params, block_hash: str, public_key: str, nonces: Sequence[int],
                     dtype: str = "float16", batch_size: int = 64) -> np.ndarray:
        with self.exclusive():
            comp = self.v1_compute(params, block_hash, dtype)
            out = [comp.run(comp.prepare(public_key, nonces[i:i + batch_size]))
                   for i in range(0, len(nonces), batch_size)]
        return np.concatenate(out) if out else np.empty(0)

    def v2_artifacts(self, block_hash: str, public_key: str, nonces: Sequence[int], seq_len: int, k_dim: int,
                     stronger_rng: bool = False, batch_size: int = 32) -> tuple[list[dict], list[int]]:
        comp = self.require_v2()
        arts, dropped = [], []
        with self.exclusive():
            for i in range(0, len(nonces), batch_size):
                chunk = nonces[i:i + batch_size]
                a, d = comp.run(comp.prepare(block_hash, public_key, chunk, seq_len, k_dim, stronger_rng))
                arts += a
                dropped += d
        return arts, dropped

    def close(self) -> None:
        self._prep_pool.shutdown(wait=False, cancel_futures=True)
        if self._v1 is not None:
            self._v1.close()
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
