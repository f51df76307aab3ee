"""RankGroup: one generation of rank processes, as DistEngine (poc.engine.dist) owns it.

The group starts `python -m poc.engine.ranks` once per rank (a fresh interpreter: a spawned child would re-import the
server's __main__, aiohttp and all), accepts each rank's authenticated local connection, hands every rank its
RankConfig (rank 0 first: it binds the rendezvous store and reports its port) and waits until all have joined the
process group. A thread of its own then moves the ranks' messages into one inbox. A rank that exits, or reports an
error, fails the group: every other rank is killed, what the ranks sent before is drained into the inbox ahead of
("failed", reason), and the owner hears the reason (on_fail: the engine breaks). The owner takes messages with
`next()` (a rank's free-memory report goes to on_memory, never to the owner's loop), and `watchdog()` fails a group
that said nothing for too long. What runs jobs on the group (the dealing, the results) is DistEngine's.

RankConfig is what the ranks are told; plain data, like RankDiagnostics (the ranks' diagnostics, read from the
environment by the server's ServerConfig, the CLI and the bench alike).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener, wait
from pathlib import Path
from typing import Callable, Mapping, Sequence

from poc.model.options import ModelOptions
from poc.parallel.layout import Layout
from poc.switches import env_flag

log = logging.getLogger("poc.parallel")
SRC = str(Path(__file__).resolve().parents[2])  # the directory holding the poc package, for the ranks' sys.path


class RankFailure(RuntimeError):
    """A rank died, failed or timed out: the engine is broken until restart()."""


@dataclass(frozen=True)
class RankDiagnostics:
    """The rank processes' diagnostics, off by default (README's Configuration table)."""

    stage_timing: bool = False  # POC_STAGE_TIMING: log each batch's forward and idle time (CUDA events)
    profile_dir: str | None = None  # POC_RANK_PROFILE: profile batches 4-7 of the first job into DIR/rank<N>.json

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "RankDiagnostics":
        return cls(stage_timing=env_flag(env, "POC_STAGE_TIMING", False, "stage_timing"),
                   profile_dir=env.get("POC_RANK_PROFILE") or None)


@dataclass(frozen=True)
class RankConfig:
    """What the engine tells every rank process after it connects (plain data: the server process builds it)."""

    layout: Layout
    backend: str  # "nccl" or "gloo"
    device_type: str  # "cuda" or "cpu"
    store_port: int  # rank 0's TCPStore (0 for rank 0 itself: it binds a free port and reports it)
    timeout_s: float = 300.0  # collectives; a timed-out collective raises and breaks the engine
    threads: int = 1  # torch CPU threads per rank
    log_level: str = "INFO"
    store_host: str = "127.0.0.1"
    compile_v1: bool = False  # torch.compile of the decoder layer (and v2's input generator) in the ranks
    compile_v2: bool = False
    options: ModelOptions = ModelOptions()  # FP8 forward, scales and experts, kernels, tp reduce, v1 pool threads
    diagnostics: RankDiagnostics = RankDiagnostics()  # POC_STAGE_TIMING, POC_RANK_PROFILE
    stage_delay_s: float = 0.0  # tests: seconds slept after each forward, standing in for device time


class RankGroup:
    """layout.world rank processes and their connections, started, read, failed and ended as one."""

    def __init__(self, config: RankConfig, on_fail: Callable[[str], None],
                 on_memory: Callable[[int, int], None] = lambda rank, free: None):
        self.config, self.on_fail, self.on_memory = config, on_fail, on_memory
        world = config.layout.world
        self.procs: list[subprocess.Popen] = []
        self.conns: dict[int, Connection] = {}
        self.inbox: queue.Queue = queue.Queue()
        self.closing = False  # failed or shut down: nothing more is sent, a failure is reported once
        self.locks = [threading.Lock() for _ in range(world)]
        self.reader: threading.Thread | None = None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    # ------------------------------------------------------------------------------------ start

    def start(self, start_timeout: float) -> None:
        """Start the rank processes and wait until every one has joined the process group (RankFailure if one
        exits or the start takes longer than start_timeout)."""
        cfg, L = self.config, self.config.layout
        key = secrets.token_bytes(32)
        listener = Listener(("127.0.0.1", 0), authkey=key)
        env = dict(os.environ, POC_RANK_KEY=key.hex(), OMP_NUM_THREADS=str(cfg.threads),
                   PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
        addr = f"127.0.0.1:{listener.address[1]}"
        log.info("starting %d rank processes: %d replica(s) x pp=%d x tp=%d on %s", L.world, L.replicas, L.pp,
                 L.tp, cfg.device_type)
        deadline = time.monotonic() + start_timeout
        try:
            self.procs = [subprocess.Popen([sys.executable, "-m", "poc.engine.ranks", addr, str(r)], env=env,
                                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                          for r in range(L.world)]
            for c in self._accept(listener, deadline, start_timeout):
                msg = self._recv(c, deadline, start_timeout)
                self.conns[msg[1]] = c
            self.send(0, cfg)
            msg = self._recv(self.conns[0], deadline, start_timeout)
            if msg[0] != "store":
                raise RankFailure(f"rank 0 did not start: {msg}")
            for r in range(1, L.world):
                self.send(r, dataclasses.replace(cfg, store_port=msg[1]))
            for r in range(L.world):
                msg = self._recv(self.conns[r], deadline, start_timeout)
                if msg[0] != "ready":
                    raise RankFailure(f"rank {r} did not start: {msg[2] if msg[0] == 'error' else msg}")
        except BaseException:
            self.closing = True
            self.kill()
            self.close_conns()
            raise
        finally:
            listener.close()
        self.reader = threading.Thread(target=self.read, name="poc-ranks-reader", daemon=True)
        self.reader.start()

    def _accept(self, listener: Listener, deadline: float, start_timeout: float) -> list[Connection]:
        conns: list[Connection] = []

        def accept():
            with contextlib.suppress(OSError, EOFError):
                while len(conns) < len(self.procs):
                    conns.append(listener.accept())

        t = threading.Thread(target=accept, name="poc-ranks-accept", daemon=True)
        t.start()
        while len(conns) < len(self.procs):
            self._check_procs(deadline, start_timeout, "connect")
            time.sleep(0.02)
        t.join()
        return conns

    def _check_procs(self, deadline: float, start_timeout: float, what: str) -> None:
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                raise RankFailure(f"rank {r} exited with code {p.returncode} before it could {what}")
        if time.monotonic() > deadline:
            raise RankFailure(f"the rank processes did not {what} within {start_timeout:.0f} s")

    def _recv(self, c: Connection, deadline: float, start_timeout: float):
        while not c.poll(0.05):
            self._check_procs(deadline, start_timeout, "start")
        try:
            return c.recv()
        except (EOFError, OSError):
            self._check_procs(time.monotonic() + 5, start_timeout, "start")
            raise RankFailure("a rank closed its connection while starting") from None

    # ------------------------------------------------------------------------------------ talk

    def send(self, rank: int, msg) -> None:
        with self.locks[rank]:
            self.conns[rank].send(msg)

    def post(self, rank: int, msg) -> None:
        """send(), unless the group failed or ended: its ranks are gone (the results they sent before still come)."""
        if not self.closing:
            self.send(rank, msg)

    def read(self) -> None:
        """The reader thread: move every rank's messages into the inbox; a closed connection or an error report
        fails the group."""
        live = {c: r for r, c in self.conns.items()}
        while live and not self.closing:
            for c in wait(list(live), timeout=0.5):
                r = live[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del live[c]
                    if not self.closing:
                        code = None
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            code = self.procs[r].wait(timeout=2)
                        self.fail(f"rank {r} (pid {self.procs[r].pid}) exited"
                                  + (f" with code {code}" if code is not None else ""), drain=list(live))
                    continue
                if msg[0] == "error":
                    # a dead peer makes the survivors' collectives fail first ("connection reset"): name the
                    # rank that actually died when there is one, not the one that noticed
                    dead = self._dead_rank(wait_s=1.0, exclude=msg[1])
                    self.fail(f"rank {dead[0]} (pid {dead[1]}) exited with code {dead[2]}; rank {msg[1]} then "
                              f"failed: {msg[2]}" if dead else f"rank {msg[1]} failed: {msg[2]}", drain=list(live))
                else:
                    self.inbox.put(msg)

    def _dead_rank(self, wait_s: float, exclude: int) -> tuple[int, int, int] | None:
        """(rank, pid, exit code) of a rank other than `exclude` (the reporter, which may abort itself after
        reporting) that has exited, waiting up to wait_s for one."""
        end = time.monotonic() + wait_s
        while True:
            for r, p in enumerate(self.procs):
                code = None if r == exclude else p.poll()
                if code is not None:
                    return r, p.pid, code
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    def next(self, timeout: float):
        """The next message from the ranks, None after `timeout` s; RankFailure once the group failed. The messages
        the ranks sent before the failure come first (results reported before it are still emitted); fail() queues
        ("failed", reason) after them. A rank's ("memory", rank, free bytes) report goes to on_memory, not here."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                return None
            if msg[0] != "memory":
                break
            self.on_memory(msg[1], msg[2])
        if msg[0] == "failed":
            self.inbox.put(msg)  # every later call fails too
            raise RankFailure(msg[1])
        return msg

    def wait_all(self, kind: str, n: int, limit: float) -> list:
        """The payloads of the next n messages of `kind` (one a rank: "loaded"), the group failed when the ranks
        say nothing for `limit` s."""
        out, last = [], time.monotonic()
        while len(out) < n:
            msg = self.next(0.5)
            if msg is None:
                self.watchdog(last, limit)
            elif msg[0] == kind:
                out.append(msg[2])
                last = time.monotonic()
        return out

    def watchdog(self, last: float, limit: float) -> None:
        """Fail the group when the ranks have said nothing since `last` for `limit` s (a hang they did not catch)."""
        if time.monotonic() - last > limit:
            reason = f"no word from the ranks for {limit:.0f} s"
            self.fail(reason)
            raise RankFailure(reason)

    # ------------------------------------------------------------------------------------ end

    def fail(self, reason: str, drain: Sequence[Connection] = ()) -> None:
        """Kill every rank (no hang on a dead peer), tell the owner (on_fail) and wake whoever waits in next(): once,
        and not for a group already ended. The reader passes the ranks' connections as `drain`: what the ranks sent
        before they were stopped (results of other replicas still in the sockets) goes to the inbox ahead of the
        failure."""
        if self.closing:
            return
        self.closing = True
        log.error("engine broken: %s; stopping the other ranks", reason)
        self.kill()  # first: when the job sees the failure, no rank is left running
        for c in drain:  # the ranks have exited: each connection holds what was sent, then EOF
            with contextlib.suppress(EOFError, OSError):
                while c.poll(0):
                    msg = c.recv()
                    if msg[0] != "error":
                        self.inbox.put(msg)
        self.on_fail(reason)
        self.inbox.put(("failed", reason))

    def shutdown(self, graceful: bool) -> None:
        """End the group: a job still waiting ends now; `graceful`: each replica's leader is told to exit and the
        ranks get 10 s to do so; then every rank left is killed."""
        self.closing = True
        self.inbox.put(("failed", "the engine was closed"))
        if graceful:
            L = self.config.layout
            for r in range(L.replicas):
                with contextlib.suppress(OSError, KeyError):
                    self.send(L.leader(r), ("exit",))
            end = time.monotonic() + 10
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.1, end - time.monotonic()))
        self.kill()
        self.close_conns()
        if self.reader is not None:
            self.reader.join(timeout=5)

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
