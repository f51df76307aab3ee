"""Compile at start: batches of the expected shapes run through the engine before "Application startup complete.",
so that the first job's first batch does not wait ~20 s for torch.compile (issue 17; on CUDA, where the server
compiles; on the CPU nothing compiles and the batches run all the same).

    --compile-at-start SPEC   (env POC_COMPILE_AT_START)

SPEC is a comma-separated list of
    v2:BATCH:SEQ_LEN     the --model checkpoint (PoC v2) at that batch size and seq_len (k_dim 12)
    v1:BATCH             PoC v1 at gonka's MainNet params (what worker.py benchmarks by default), float16
or a JSON list of {"batch_size": N, "params": {...}} objects, `params` as in a /generate request (v1: every key; v2:
seq_len and k_dim, its model is the served one), an optional "dtype" for v1 and an optional "batches" (default 1): run
that many batches a replica and log the engine's own rate after the first (nonces/s from the first batch's result to
the last's, as poc.bench times them: the engine alone on this server's devices, before any route runs;
benchmarks/diagnostics/serve_layouts.py reads it).

Every replica computes at least one batch of each shape (a job's first batches are dealt one a replica in turn:
jobs.Dealer), and each batch passes every pipeline stage of its replica, so the first job of that shape compiles
nothing on any rank. With rank processes the log then says, per replica, how many batches each of its ranks ran (a
warning names a rank that ran none: there the first job compiles). scripts/docker_entrypoint.sh sets
it on a Vast worker to the PyWorker benchmark's shape. The batches use worker.py's benchmark block hash, so the v1
model that the warm-up builds is the one the PyWorker's benchmark then uses. Compiled kernels also land in the
on-disk caches (TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR): a restart with the cache kept compiles much faster.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from dataclasses import dataclass

from poc.errors import InputError

log = logging.getLogger("poc.server")

FLAG = "--compile-at-start"
BLOCK_HASH = PUBLIC_KEY = "pyworker-benchmark"  # worker.py's bench_payload(): the benchmark reuses the v1 model
V1_DTYPES = ("float16", "bfloat16", "float32")


@dataclass(frozen=True)
class WarmShape:
    protocol: str  # v1 | v2
    batch_size: int
    params: str  # the params object as JSON (v1: every key; v2: seq_len, k_dim): hashable, as ServerConfig is
    dtype: str = "float16"  # v1 only
    batches: int = 1  # more than 1: timed, the engine's rate logged

    def label(self) -> str:
        p = json.loads(self.params)
        if self.protocol == "v2":
            return f"v2 batch {self.batch_size} seq_len {p['seq_len']}"
        return f"v1 batch {self.batch_size} dim {p['dim']} layers {p['n_layers']} seq_len {p['seq_len']} {self.dtype}"


def parse(text: str | None, model: str | None) -> tuple[WarmShape, ...]:
    """The setting -> shapes; an InputError naming the flag and the bad item."""
    text = (text or "").strip()
    if not text:
        return ()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{FLAG}: not valid JSON: {e}", "compile_at_start") from None
        if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
            raise InputError(f"{FLAG}: a JSON list of {{\"batch_size\", \"params\"}} objects", "compile_at_start")
        shapes = [_from_json(i) for i in items]
    else:
        shapes = [_from_short(part.strip()) for part in text.split(",") if part.strip()]
    if any(s.protocol == "v2" for s in shapes) and not model:
        raise InputError(f"{FLAG}: a v2 shape needs --model (the checkpoint it compiles)", "compile_at_start")
    return tuple(shapes)


def _batch(v, item) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 4096:
        raise InputError(f"{FLAG}: batch_size must be an integer in 1..4096 in {item!r}", "compile_at_start")
    return v


def _from_short(item: str) -> WarmShape:
    m = re.fullmatch(r"v2:(\d+):(\d+)", item)
    if m:
        seq = int(m.group(2))
        if seq < 1:
            raise InputError(f"{FLAG}: seq_len must be >= 1 in {item!r}", "compile_at_start")
        return WarmShape("v2", _batch(int(m.group(1)), item), json.dumps({"seq_len": seq, "k_dim": 12}))
    m = re.fullmatch(r"v1:(\d+)", item)
    if m:
        from poc.protocol.v1 import PARAMS_V2  # gonka's MainNet v1 params

        return WarmShape("v1", _batch(int(m.group(1)), item), json.dumps(PARAMS_V2.to_json()))
    raise InputError(f"{FLAG}: {item!r} is not v2:BATCH:SEQ_LEN, v1:BATCH or a JSON list", "compile_at_start")


def _from_json(item: dict) -> WarmShape:
    extra = sorted(set(item) - {"batch_size", "params", "dtype", "batches"})
    if extra or "params" not in item or not isinstance(item["params"], dict):
        raise InputError(f"{FLAG}: each item is {{\"batch_size\", \"params\", optional \"dtype\", \"batches\"}}, "
                         f"got {item!r}", "compile_at_start")
    batch, p = _batch(item.get("batch_size"), item), item["params"]
    n = item.get("batches", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= 1000:
        raise InputError(f"{FLAG}: batches must be an integer in 1..1000 in {item!r}", "compile_at_start")
    if "dim" in p:  # v1, as /generate tells them apart
        from poc.protocol.v1 import V1Params

        params = V1Params.from_json(p, f"{FLAG} params")
        dtype = item.get("dtype", "float16")
        if dtype not in V1_DTYPES:
            raise InputError(f"{FLAG}: dtype must be one of {', '.join(V1_DTYPES)}, got {dtype!r}", "compile_at_start")
        return WarmShape("v1", batch, json.dumps(params.to_json()), dtype, n)
    seq, k = p.get("seq_len"), p.get("k_dim", 12)
    for name, v in (("seq_len", seq), ("k_dim", k)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise InputError(f"{FLAG}: params.{name} must be a positive integer in {item!r}", "compile_at_start")
    return WarmShape("v2", batch, json.dumps({"seq_len": seq, "k_dim": k}), batches=n)


def _job(shape: WarmShape, replicas: int = 1):
    import itertools

    from poc.engine.jobs import Limits, V1Job, V2Job

    p = json.loads(shape.params)
    # full batches (the compiled shape), `batches` for each replica: the first round deals one to every replica
    limits = Limits(max_nonces=shape.batch_size * shape.batches * replicas, max_duration=None)
    if shape.protocol == "v2":
        return V2Job(BLOCK_HASH, PUBLIC_KEY, 1, p["seq_len"], p["k_dim"], itertools.count(), shape.batch_size,
                     limits=limits)
    from poc.protocol.v1 import V1Params

    return V1Job(BLOCK_HASH, PUBLIC_KEY, 1, V1Params.from_json(p), 1.4, itertools.count(), shape.batch_size,
                 dtype=shape.dtype, limits=limits)


def run(engine, shapes: tuple[WarmShape, ...], claim=None) -> None:
    """Blocking (a worker thread): one batch of each shape through engine.run. A failure is logged and the server
    starts all the same (its first job of that shape then compiles, or fails the same way, visibly)."""
    from poc.engine.jobs import steady_rate
    from poc.logs import describe

    compiled = engine.compile_v2 or engine.compile_v1
    for s in shapes:
        t0 = time.perf_counter()
        try:
            if s.protocol == "v2":  # the request schema's checks (a /generate of this shape would get a 400)
                cfg, p = engine.require_v2().cfg, json.loads(s.params)
                if p["seq_len"] > cfg.max_seq_len or p["k_dim"] > cfg.dim:
                    raise InputError(f"seq_len {p['seq_len']} / k_dim {p['k_dim']} past the model's "
                                     f"max_position_embeddings {cfg.max_seq_len} / hidden size {cfg.dim}")
            times, sizes = [], []

            def emit(b) -> None:
                times.append(time.perf_counter())
                sizes.append(len(b.nonces))

            summary = engine.run(_job(s, engine.replicas), emit, threading.Event(), claim=claim)
        except Exception as e:
            log.warning("compile at start: %s failed %s; serving without it", s.label(), describe(e))
            continue
        rate, n = "", engine.replicas
        if len(times) >= n + 2:  # the steady rate: after each replica's first result, which carries its compile
            rate = (f"; the engine alone after each replica's first batch: {steady_rate(times, sizes, n):.3f} "
                    "nonces/s")
        log.info("compile at start: %s, %d nonces in %d batch(es), %.1f s%s%s", s.label(), summary.computed,
                 summary.batches, time.perf_counter() - t0, "" if compiled else " (compile is off: run, not compiled)",
                 rate)
        _log_replicas(engine, s)


def _log_replicas(engine, shape: WarmShape) -> None:
    """One line a replica: the batches each of its ranks ran (every stage, every tp rank), from the job's figures
    (engine.last_job_stats; an engine without them, one device, has its one line above)."""
    stats = engine.last_job_stats
    if not stats or not stats.get("ranks"):
        return
    tp, pp, _ = engine.parallel_dims()
    group = tp * pp  # a replica's ranks are consecutive: rank = replica * tp * pp + stage * tp + tp_rank
    n = engine.replicas
    for r in range(n):
        ranks = {x["rank"]: x for x in stats["ranks"] if x["rank"] // group == r}
        cold = [k for k in range(r * group, (r + 1) * group) if ranks.get(k, {}).get("batches", 0) == 0]
        if cold:
            log.warning("compile at start: %s, replica %d/%d NOT warm: rank(s) %s ran no batch of it (the first job "
                        "of this shape compiles there)", shape.label(), r + 1, n, ", ".join(map(str, cold)))
            continue
        log.info("compile at start: %s, replica %d/%d warm: its %d rank(s) (%d-%d, %d stage(s)) ran %d batch(es) "
                 "each", shape.label(), r + 1, n, group, r * group, (r + 1) * group - 1, pp,
                 min(x["batches"] for x in ranks.values()))
