"""The rank process: one per device; every rank runs the same loop (SPMD), as under torchrun.

    python -m poc.engine.ranks HOST:PORT RANK      (DistEngine starts these; the auth key comes in $POC_RANK_KEY)

A rank connects back to the engine, joins the process group (NCCL on CUDA, gloo on CPU) and waits for commands.
Only each replica's leader (first stage, tp rank 0) reads commands from the engine: a job (a few seeds and a
shape), then per batch the nonces or the end. The first stage's tp ranks get each command from the leader (a
broadcast over a CPU (gloo) group); every later stage gets it from the stage before it, which hands it on as it
takes it (a point-to-point message on the CPU, not waited for; a batch's before the batch is launched). So a stage
waits only for the activations of the stage before it, never for the stages after it, and a pipeline of pp stages
works on pp batches at once even where a stage's host waits for its device (the CPU; a GPU whose launch queue is
full); all ranks of a replica still run exactly the batches the leader took, and stop at the same one. Every rank
derives its inputs from the seeds; the first stage builds the embeddings, the last stage post-processes and its
tp rank 0 sends the small results back from a thread of its own (its main thread goes on launching): the
single-device engine's V1Compute/V2Compute (engine/compute.py) run here with this rank's Stage. No aiohttp here.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import pickle
import queue
import sys
import threading
import time
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Client, Connection

import numpy as np
import torch
import torch.distributed as dist

from poc.engine.compute import DTYPES, Stage, V1Compute, V2Compute
from poc.engine.jobs import V1Job, V2Job
from poc.logs import OneLineFormatter, stacks_on_sigusr1
from poc.parallel import pp
from poc.parallel.build import Part, build
from poc.engine.rankgroup import RankConfig
from poc.model.source import ModelSource
from poc.protocol.pool import pool_workers

log = logging.getLogger("poc.ranks")

HEARTBEAT_S = 5.0  # an idle leader sends a heartbeat down the pipeline this often: waiting ranks never time out


def free_bytes(device: torch.device) -> int | None:
    """What a job could allocate on this rank's GPU: the free memory plus the allocator's cached-but-unused blocks;
    None on the CPU (the ranks share the host memory, which the server reads itself)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free) + max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def _isend_object(obj, dst: int, group) -> tuple:
    """Send a picklable object to global rank `dst` on a gloo group without waiting: (size work, data work, and
    the two tensors, kept alive until the works are done). _recv_object takes it."""
    data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    size = torch.tensor([data.numel()], dtype=torch.int64)
    return dist.isend(size, dst, group=group), dist.isend(data, dst, group=group), size, data


def _recv_object(src: int, group):
    size = torch.empty(1, dtype=torch.int64)
    dist.recv(size, src, group=group)
    data = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(data, src, group=group)
    return pickle.loads(data.numpy().tobytes())


def _done(sending: tuple) -> bool:
    return all(w.is_completed() for w in sending[:2])


class _OnlyRank0(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or getattr(record, "every_rank", False)


def _setup_logging(rank: int, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    # one line per record, "Error:"/"Traceback" defused: the PyWorker reads this log too (spec/pyworker.md)
    handler.setFormatter(OneLineFormatter(f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s"))
    handler.addFilter(_OnlyRank0(rank))  # the engine reports other ranks' errors itself
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def _die_with_parent() -> None:
    """Exit when the engine's process dies, however it dies (no orphan holds a GPU). Not PR_SET_PDEATHSIG: that
    fires when the *thread* that started us ends, and the engine may start ranks from a short-lived thread."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="poc-parent-watch", daemon=True).start()


class JobClock:
    """Where one rank's time went in one job, sent to the engine when the job ends (DistEngine logs it and keeps it:
    `last_job_stats`): its forwards (device time: CUDA events around each forward, or the host clock on the CPU,
    where a forward runs synchronously), the span from its first forward's start to its last one's end (busy =
    forward / span: the share of the job its device computed), and on the host: waiting for commands (the leader:
    `starved`, waits for the engine to deal the next batch, with nothing queued; the other ranks: for the stage
    before them) and the reporter's wait for its last results at the job's end (`report_s`)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.batches = self.starved = 0
        self.forward_s = self.starved_s = self.command_s = self.report_s = 0.0
        self.first = self.last = self.start = None  # first forward's start, last forward's end, the open one's start
        self._pairs: collections.deque = collections.deque()  # CUDA: (start, end) events not yet added up

    def _now(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def forward(self, which: int) -> None:
        """Before (0) and after (1) a forward is launched."""
        t = self._now()
        if which == 0:
            self.start = t
            self.first = self.first if self.first is not None else t
            return
        self.batches += 1
        self.last = t
        if self.cuda:
            self._pairs.append((self.start, t))
            self.fold()
        else:
            self.forward_s += t - self.start

    def fold(self, final: bool = False) -> None:
        """Add up the forwards the device has finished (all of them when `final`: after a synchronize)."""
        while self._pairs and (final or self._pairs[0][1].query()):
            a, b = self._pairs.popleft()
            self.forward_s += a.elapsed_time(b) / 1e3

    def summary(self, rank: int, stage: int) -> dict:
        if self.cuda and self.last is not None:
            self.last.synchronize()
            self.fold(final=True)
        span = 0.0
        if self.first is not None and self.last is not None:
            span = self.first.elapsed_time(self.last) / 1e3 if self.cuda else self.last - self.first
        return {"rank": rank, "stage": stage, "batches": self.batches, "forward_s": round(self.forward_s, 4),
                "span_s": round(span, 4), "busy": round(self.forward_s / span, 4) if span > 0 else None,
                "starved": self.starved, "starved_s": round(self.starved_s, 4), "command_s": round(self.command_s, 4),
                "report_s": round(self.report_s, 4)}


class _Reporter:
    """The reporter rank's results, collected and sent by a thread of their own in launch order, so that its main
    thread goes on taking commands (and the stage before it never waits on a result). An error stops the reporting
    and is raised in the main thread at its next command (`check`) or when it waits for the rest (`drain`)."""

    def __init__(self, report: "collections.abc.Callable"):
        self.report, self.error = report, None
        self.q: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name="poc-report", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            item = self.q.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    self.report(*item)
            except BaseException as e:  # noqa: BLE001 - raised again in the main thread
                self.error = e
            finally:
                self.q.task_done()

    def put(self, item) -> None:
        self.q.put(item)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def drain(self) -> None:
        """Wait until every batch handed over is reported."""
        self.q.join()
        self.check()

    def close(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=60)


class Rank:
    def __init__(self, rank: int, cfg: RankConfig, conn: Connection):
        self.rank, self.cfg, self.conn = rank, cfg, conn
        L = self.layout = cfg.layout
        self.replica, self.stage, self.tp_rank = L.coords(rank)
        self.leader = L.leader(self.replica)
        self.is_first, self.is_last = self.stage == 0, self.stage == L.pp - 1
        self.is_reporter = rank == L.reporter(self.replica)
        # threads drawing a v1 pool: the ranks of a host draw theirs at once, so by default they share the cores
        self.pool_workers = cfg.options.pool_workers or max(1, pool_workers() // L.world)
        if cfg.device_type == "cuda":
            self.device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
            torch.set_num_threads(cfg.threads)
        self.pending: collections.deque = collections.deque()  # the leader's commands read ahead
        self._send_lock = threading.Lock()  # the main thread and the reporter thread both send to the engine
        self._passing: collections.deque = collections.deque()  # commands on their way to the next stage
        self.v2: V2Compute | None = None
        self.v1: tuple[tuple, V1Compute] | None = None  # (params, block_hash, dtype), its compute
        # this rank's part of the pipeline, for the compute (engine.compute) shared with the single-device engine
        self.io = Stage(first=self.is_first, last=self.is_last, reporter=self.is_reporter,
                        recv=lambda shape, dtype: pp.recv(shape, dtype, self.device, self.prev),
                        send=lambda out: pp.send(out, self.next), mark=self._mark)
        self._profile_dir, self._profiled = cfg.diagnostics.profile_dir, False
        timing = cfg.diagnostics.stage_timing and self.device.type == "cuda"
        self._timing, self._prev_end, self._host_s = (collections.deque() if timing else None), None, {}
        self.clock: JobClock | None = None  # the running job's (run_job)
        self._starve_t0: float | None = None  # the leader found nothing queued: since when (a job's batch ends it)

    # ------------------------------------------------------------------------------------ setup

    def init_groups(self, store) -> None:
        L, timeout = self.layout, timedelta(seconds=self.cfg.timeout_s)
        dist.init_process_group(self.cfg.backend, store=store, rank=self.rank, world_size=L.world, timeout=timeout)
        # every rank creates every group, in the same order (new_group's contract)
        self.ctrl = self.tp_group = self.stage_ctrl = None
        for ranks in L.replica_groups():
            g = dist.new_group(ranks, timeout=timeout, backend="gloo")  # commands travel on the CPU
            if self.rank in ranks:
                self.ctrl = g
        if L.tp > 1:  # the first stage's tp ranks take each command from the leader: a broadcast on the CPU
            for r in range(L.replicas):
                ranks = [L.rank(r, 0, t) for t in range(L.tp)]
                g = dist.new_group(ranks, timeout=timeout, backend="gloo")
                if self.rank in ranks:
                    self.stage_ctrl = g
        if L.tp > 1:
            for ranks in L.tp_groups():
                g = dist.new_group(ranks, timeout=timeout)
                if self.rank in ranks:
                    self.tp_group = g
        # pipeline sends/receives are point-to-point on the world group, between the same tp rank of two stages
        self.prev = L.rank(self.replica, self.stage - 1, self.tp_rank) if not self.is_first else None
        self.next = L.rank(self.replica, self.stage + 1, self.tp_rank) if not self.is_last else None
        # this rank's part of every model, its partial sums all-reduced as the options say
        self.part = Part(self.stage, L.pp, self.tp_rank, L.tp, self.tp_group, self.cfg.options.tp_reduce)

    def send(self, msg) -> None:
        with self._send_lock:
            self.conn.send(msg)

    # ------------------------------------------------------------------------------------ commands

    def next_command(self):
        """The next command (or an idle heartbeat): the first stage's from the leader, which reads it from the
        engine (and broadcasts it to its stage's other tp ranks); a later stage's from the stage before it
        (its pass_on)."""
        if not self.is_first:
            return _recv_object(self.prev, self.ctrl)
        if self.stage_ctrl is None:
            return self._read_command()
        obj = [self._read_command() if self.rank == self.leader else None]
        dist.broadcast_object_list(obj, src=self.leader, group=self.stage_ctrl, device=torch.device("cpu"))
        return obj[0]

    def pass_on(self, cmd, wait: bool = False) -> None:
        """Hand a command to the same tp rank of the next stage, without waiting for it to be taken (`wait`: until
        it was): a batch's before this rank launches it, so the next stage queues its part (the receive of the
        activations, its forward) while this one computes."""
        if self.next is None:
            return
        self._passing.append(_isend_object(cmd, self.next, self.ctrl))
        while self._passing and (wait or len(self._passing) > 64 or _done(self._passing[0])):
            for w in self._passing.popleft()[:2]:
                w.wait()

    def _read_command(self):
        while self.conn.poll(0):  # read ahead: an "end" that drops work cancels the batches queued before it
            self.pending.append(self.conn.recv())
        if not self.pending:
            if self.clock is not None and self._starve_t0 is None:
                self._starve_t0 = time.perf_counter()  # inside a job with nothing queued: the engine is behind
            if not self.conn.poll(HEARTBEAT_S):
                return ("idle",)
            self.pending.append(self.conn.recv())
            if self._starve_t0 is not None and self.pending[-1][0] == "batch" and self.clock is not None:
                self.clock.starved += 1
                self.clock.starved_s += time.perf_counter() - self._starve_t0
        self._starve_t0 = None
        ends = [m for m in self.pending if m[0] == "end" and m[2]]
        if ends:
            jid = ends[0][1]
            kept = [m for m in self.pending if not (m[0] == "batch" and m[1] == jid)]
            self.pending = collections.deque(kept)
        return self.pending.popleft()

    def serve(self) -> None:
        while True:
            cmd = self.next_command()
            kind = cmd[0]
            if kind not in ("idle", "exit", "load", "job", "drop_v1"):
                raise RuntimeError(f"unknown command {kind!r}")
            self.pass_on(cmd, wait=kind == "exit")  # the next stage starts on it too (a load, a job) or stays alive
            if kind == "exit":
                return
            if kind == "load":
                self.load(*cmd[1:])
            elif kind == "job":
                self.run_job(*cmd[1:])
            elif kind == "drop_v1":  # the server's v1 cache went idle (POC_V1_CACHE_IDLE)
                if self.v1 is not None:
                    self.v1[1].close()
                self.v1 = None
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()

    # ------------------------------------------------------------------------------------ models

    def load(self, source: ModelSource, dtype) -> None:
        t0 = time.perf_counter()
        self.v2 = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        L, o = self.layout, replace(self.cfg.options, compiled=self.cfg.compile_v2)  # built for compiled layers or not
        # a checkpoint's slices read from its files, or a preset's random weights made on this device: only this part
        model, mcfg = build(source, dtype, self.device, self.part, o)
        mdtype = next(model.parameters()).dtype
        # compiled at fixed shapes like the single-device engine (a short last batch compiles its own shape)
        self.v2 = V2Compute(model, mcfg, mdtype, self.device, source.name, self.cfg.compile_v2, stage=self.io)
        n_bytes = sum(t.numel() * t.element_size() for t in self.v2.model.state_dict().values())
        log.info("loaded %s: stage %d/%d tp %d/%d, %.1f MB on this rank in %.1f s", source, self.stage, L.pp,
                 self.tp_rank, L.tp, n_bytes / 1e6, time.perf_counter() - t0)
        self.send(("loaded", self.rank, {"bytes": n_bytes, "seconds": time.perf_counter() - t0,
                                         "dtype": str(mdtype).removeprefix("torch."), "free": free_bytes(self.device),
                                         "computes": self.v2.computes}))

    def v1_model(self, job: V1Job):
        key = (job.params, job.block_hash, job.dtype)
        if self.v1 is None or self.v1[0] != key:
            self.v1 = None
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
            t0 = time.perf_counter()
            self.v1 = (key, V1Compute(job.params, job.block_hash, DTYPES[job.dtype], self.device, self.cfg.compile_v1,
                                      part=self.part, stage=self.io, pool_workers=self.pool_workers))
            log.info("v1 model built: dim=%d layers=%d dtype=%s in %.1f s", job.params.dim, job.params.n_layers,
                     job.dtype, time.perf_counter() - t0)
        return self.v1[1]

    # ------------------------------------------------------------------------------------ jobs

    def run_job(self, job_id: int, job, opts: dict) -> None:
        """Batches until the end comes down the pipeline. Each batch's command goes on to the next stage, then the
        batch is launched; the reporter hands its launched batches to its report thread, so no rank ever waits for
        a result before taking the next command: how many batches a replica holds is the engine's dealing
        (DistEngine: pp + 2), and a pipeline of pp stages computes pp of them at once."""
        if isinstance(job, V1Job):
            self.v1_model(job)  # built before the clock starts: max_duration counts compute, as on one device
        if self.is_reporter:
            self.send(("started", job_id, self.replica))
        prof = None
        if self._profile_dir and not self._profiled:  # POC_RANK_PROFILE: the first job's steady-state batches
            from poc.profiling import StepProfiler
            prof = StepProfiler(self._profile_dir, f"rank{self.rank}", self.device)
        clock = self.clock = JobClock(self.device)
        reporter = _Reporter(lambda *item: self.report(job_id, job, opts, *item)) if self.is_reporter else None
        try:
            while True:
                t0 = time.perf_counter()
                cmd = self.next_command()
                self._host("command", t0)
                clock.command_s += time.perf_counter() - t0
                if reporter is not None:
                    reporter.check()
                if cmd[0] == "idle":
                    self.pass_on(cmd)
                    continue
                if cmd[1] != job_id:
                    raise RuntimeError(f"command {cmd[0]!r} of job {cmd[1]} inside job {job_id}")
                if cmd[0] == "end":
                    self.pass_on(cmd)
                    if reporter is not None:
                        t0 = time.perf_counter()
                        reporter.drain()
                        clock.report_s += time.perf_counter() - t0
                    if prof is not None:
                        prof.close()
                    break
                _, _, seq, nonces = cmd
                self.pass_on(cmd)
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    try:
                        out = self.launch_v1(job, nonces) if isinstance(job, V1Job) else self.launch_v2(job, nonces)
                    except BaseException:  # the job fails, but the batches launched before are computed: report
                        if reporter is not None:  # them ahead of the error, as Engine emits its one
                            with contextlib.suppress(BaseException):
                                reporter.drain()
                        raise
                if reporter is not None and out is not None:
                    reporter.put((seq, nonces, out, t0))
                self._log_timing()
                if prof is not None:
                    prof.step()
                    self._profiled = prof.done
        finally:
            self.clock = None
            if reporter is not None:
                reporter.close()
        stats = self.gather_stats(clock.summary(self.rank, self.stage))
        if self.device.type == "cuda":  # for the server's memory check before the next job (poc.engine.memory)
            self.send(("memory", self.rank, free_bytes(self.device)))
        if self.is_reporter:
            self.send(("stats", job_id, self.replica, stats))
            self.send(("done", job_id, self.replica))

    def gather_stats(self, mine: dict) -> list[dict] | None:
        """Every rank's JobClock summary of the job, at the replica's reporter (which sends them ahead of "done");
        None elsewhere."""
        if self.layout.group_size == 1:
            return [mine]
        reporter = self.layout.reporter(self.replica)
        out = [None] * self.layout.group_size if self.rank == reporter else None
        dist.gather_object(mine, out, dst=reporter, group=self.ctrl)
        return out

    def launch_v2(self, job: V2Job, nonces: list[int]):
        """Queue one batch: host work first (seeds, the post-processing plan), then only device work."""
        t0 = time.perf_counter()
        prep = self.v2.prepare(job.block_hash, job.public_key, nonces, job.seq_len, job.k_dim, job.stronger_rng)
        self._host("prepare", t0)
        t0 = time.perf_counter()
        handle = self.v2.launch(prep, pad_to=job.batch_size)  # a short last batch padded, as on one device
        self._host("launch", t0)
        return handle

    def launch_v1(self, job: V1Job, nonces: list[int]):
        comp = self.v1_model(job)
        return comp.launch(comp.prepare(job.public_key, nonces), pad_to=job.batch_size)

    def _host(self, name: str, t0: float) -> None:
        """POC_STAGE_TIMING: add the host seconds since t0 to this batch's host time under `name`."""
        if self._timing is not None:
            self._host_s[name] = self._host_s.get(name, 0.0) + time.perf_counter() - t0

    def _mark(self, which: int) -> None:
        """Before (0) and after (1) this rank's forward is launched: the job's JobClock; the stand-in device time of
        CPU tests (RankConfig.stage_delay_s); with POC_STAGE_TIMING=1 (CUDA) events logged once the device has run
        them, with the idle time since the previous batch's forward ended (a pipeline stage waiting for its input)
        and the host seconds by step since the previous forward was launched (waiting for the command, making the
        inputs, launching the forward): a host that blocks shows here."""
        if which == 1 and self.cfg.stage_delay_s:
            time.sleep(self.cfg.stage_delay_s)  # a stand-in for device time (tests: RankConfig.stage_delay_s)
        if self.clock is not None:
            self.clock.forward(which)
        if self._timing is None:
            return
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        host = {}
        if which == 1:  # the batch's host times so far (command wait, input/recv, forward launch) go with it
            host, self._host_s = {k: round(1e3 * v, 1) for k, v in self._host_s.items()}, {}
        self._timing.append((ev, host))

    def _log_timing(self) -> None:
        if self._timing is None:
            return
        while len(self._timing) >= 2 and self._timing[1][0].query():
            (start, _), (end, host) = self._timing.popleft(), self._timing.popleft()
            idle = self._prev_end.elapsed_time(start) if self._prev_end is not None else float("nan")
            log.warning("stage %d: forward %.1f ms, idle before it %.1f ms; host ms %s", self.stage,
                        start.elapsed_time(end), idle, host, extra={"every_rank": True})
            self._prev_end = end

    def report(self, job_id: int, job, opts: dict, seq: int, nonces: list[int], out, t0: float) -> None:
        """One launched batch's results to the engine, once computed (on the reporter's report thread)."""
        comp = self.v1[1] if isinstance(job, V1Job) else self.v2
        payload = {"nonces": nonces, **comp.collect(out)}
        if opts.get("vectors"):
            payload["vectors"] = out.wait().float().numpy().copy()
        self.send(("result", job_id, self.replica, seq, payload, time.perf_counter() - t0))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    host, port = argv[0].rsplit(":", 1)
    rank = int(argv[1])
    _die_with_parent()
    conn = Client((host, int(port)), authkey=bytes.fromhex(os.environ.pop("POC_RANK_KEY")))
    conn.send(("hello", rank, os.getpid()))
    cfg: RankConfig = conn.recv()
    _setup_logging(rank, cfg.log_level)
    stacks_on_sigusr1()
    try:
        if rank == 0:  # the rendezvous store lives here, on a port the OS picked (no free-port race)
            store = dist.TCPStore(cfg.store_host, 0, cfg.layout.world, is_master=True,
                                  timeout=timedelta(seconds=cfg.timeout_s), wait_for_workers=False)
            conn.send(("store", store.port))
        else:
            store = dist.TCPStore(cfg.store_host, cfg.store_port, cfg.layout.world, is_master=False,
                                  timeout=timedelta(seconds=cfg.timeout_s))
        r = Rank(rank, cfg, conn)
        r.init_groups(store)
        conn.send(("ready", rank))
        r.serve()
    except (EOFError, ConnectionError, BrokenPipeError):
        return 1  # the engine went away: nothing to report to
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the engine as one line
        try:
            conn.send(("error", rank, (f"{type(e).__name__}: {e}".strip().splitlines() or ["?"])[0][:500]))
        except (OSError, EOFError):
            pass
        return 1
    try:
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001
        pass
    return 0


if __name__ == "__main__":
    np.seterr(all="ignore")
    sys.exit(main())
