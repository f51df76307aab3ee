"""What a /pooled session computes next, from its orchestrator's answers: the pure half of pooled.py (no I/O, no
asyncio). PooledSession owns one PooledPlan, feeds it every config it gets (register, ready, the polls) and acts on
what it says; the orchestrator calls, the device, the jobs and the stream stay in the session.

- merge: the config's known keys into the session's view of it (7.0 taken as 7; a key in a plain config is dropped
  once computing: only "switch_job" and "compute" move the public key, as the reference);
- reassign: the checked Assignment (None while something is missing, an InputError kept in bad_config), and what
  changed, announced as status lines: "switched_public_key" (switch_job: the range restarts, counters reset),
  "public_key_set" (compute: the range goes on), "new_range", "new_job", "r_target_default";
- the range bookkeeping: the nonces computed per work (sorted [lo, hi] spans), the works whose range is exhausted,
  the nonces a job still has to compute (uncomputed), and the batch counters of the current work;
- one result body per run of consecutive nonces (split_runs), with its deterministic idempotency_id (result_id).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Callable, Iterator

from poc.engine.jobs import BatchResult, Limits, V1Job, V2Job
from poc.errors import InputError
from poc.protocol import v1, v2
from poc.protocol.nonces import MAX_NONCE
from poc.server import fields, schemas
from poc.server.config import ServerConfig
from poc.server.results import v1_hits
from poc.server.stream import add_spans

MERGE_KEYS = ("block_hash", "block_height", "r_target", "params", "public_key", "nonce_range_start",
              "nonce_range_end", "batch_size", "poc_stronger_rng")
DEFAULTS = {"block_hash": "", "block_height": 0, "r_target": 0.0, "params": {}, "public_key": "",
            "nonce_range_start": 0, "nonce_range_end": 0}
INT_KEYS = ("block_height", "nonce_range_start", "nonce_range_end", "batch_size")  # 7.0 is taken as 7
KEY_COMMANDS = ("switch_job", "compute")  # the config commands that move the public key once computing


@dataclass(frozen=True)
class Assignment:
    """What the orchestrator asks for now, checked."""

    protocol: str
    block_hash: str
    block_height: int
    public_key: str
    r_target: float
    params: object  # V1Params, or (seq_len, k_dim)
    params_key: str  # canonical JSON, for comparisons and ids
    range_start: int
    range_end: int
    batch_size: int
    stronger_rng: bool

    @property
    def work(self) -> tuple:
        """The computation without the key: a key change alone continues the same work."""
        return (self.protocol, self.block_hash, self.block_height, self.params_key, self.r_target, self.range_start,
                self.range_end, self.stronger_rng)


class PooledPlan:
    """The orchestrator's config as merged so far, the assignment it makes, and what of it is done."""

    def __init__(self, cfg: ServerConfig, batch_size: int | None, dtype: str, *,
                 model: Callable[[], object] = lambda: None,
                 check_memory: Callable[[str, object, int], None] | None = None):
        self.cfg, self.req_batch_size, self.dtype = cfg, batch_size, dtype  # the request's batch_size and v1 dtype
        self.model = model  # the served model now (v2 params name it): POST /api/v1/inference/up may change it
        self.check_memory = check_memory  # (protocol, params, batch_size) -> None, or InputError: it does not fit
        self.conf = dict(DEFAULTS)
        self.range_given = False
        self.assignment: Assignment | None = None
        self.bad_config: InputError | None = None
        self.announce: list[dict] = []  # status lines of applied changes, written before the next job starts
        self.computed: dict[tuple, list[list[int]]] = {}  # work -> the nonces computed, as sorted [lo, hi] spans
        self.epoch = 0  # bumped by switch_job: a batch of the job it stopped must not count as computed any more
        self.finished: set[tuple] = set()  # works whose range is exhausted
        self.counters_for: tuple | None = None
        self.batch_number = self.total_computed = self.total_valid = 0
        self.r_target_warned = False
        self._conf_seen = ""

    # ------------------------------------------------------------------------------------ config

    def merge(self, data) -> None:
        if not data or not isinstance(data, dict):
            return  # {} or null: nothing to merge (as the reference)
        for k in MERGE_KEYS:
            if k in data and data[k] is not None:
                v = data[k]
                if k in INT_KEYS and isinstance(v, float) and v.is_integer():
                    v = int(v)  # a Python orchestrator's division (as params' integer fields already are)
                self.conf[k] = v
        if "nonce_range_start" in data or "nonce_range_end" in data:
            self.range_given = True

    def apply(self, data) -> str | None:
        """One polled config: merged, then its command or what changed acted on. "shutdown" for that command,
        "changed" when the job in flight must stop and the session look again (as reassign), else None."""
        if not data or not isinstance(data, dict):
            return None
        typ = data.get("type")
        if self.assignment is not None and typ not in KEY_COMMANDS and "public_key" in data:
            # as the reference: a key in a plain config is merged but never applied while computing (only the
            # commands move the key), so an orchestrator that keeps serving the first key after a switch_job
            # does not switch the worker back
            data = {k: v for k, v in data.items() if k != "public_key"}
        self.merge(data)
        if typ == "shutdown":
            return "shutdown"
        return "changed" if self.reassign(typ) else None

    def reassign(self, typ) -> bool:
        """Act on the config merged so far (typ: the command that came with it): True when the job in flight must
        stop and the session look again (a new assignment, or bad_config)."""
        seen = json.dumps([self.conf, self.range_given], sort_keys=True, default=str)
        if seen == self._conf_seen:
            return False  # nothing changed since the last poll (a repeated command is a no-op)
        self._conf_seen = seen
        try:
            new = self.check()
        except InputError as e:
            self.bad_config = e
            return True
        cur = self.assignment
        if new is None or new == cur:
            return False
        if cur is None:
            pass
        elif new.work == cur.work:  # only the key changed
            if typ == "switch_job":  # restart the range under the new key, counters reset (§4.3)
                self.computed.pop(new.work, None)
                self.epoch += 1
                self.finished.discard(new.work)
                self.counters_for = None
                self.announce.append({"status": "switched_public_key", "public_key": new.public_key[:16]})
            else:  # "compute": go on with the range under the new key
                self.announce.append({"status": "public_key_set", "public_key": new.public_key[:16]})
        elif (new.block_hash, new.params_key) == (cur.block_hash, cur.params_key) and new.r_target == cur.r_target:
            self.announce.append({"status": "new_range", "range_start": new.range_start, "range_end": new.range_end})
        else:
            self.announce.append({"status": "new_job", "block_hash": new.block_hash[:16], "block_height":
                                  new.block_height, "range_start": new.range_start, "range_end": new.range_end})
        self.assignment = new
        return True

    def batch_size(self) -> int:
        if self.req_batch_size is not None:
            return self.req_batch_size
        bs = self.conf.get("batch_size")
        if bs is not None:
            return fields.get_batch_size({"batch_size": bs}, self.cfg)
        return self.cfg.pooled_batch_size

    def check(self) -> Assignment | None:
        """The checked assignment, None while something is missing; InputError for a value that is wrong."""
        c = self.conf
        if not c["block_hash"] or not c["public_key"] or not self.range_given:
            return None
        bh, height, pk = fields.get_header(c)
        params = c["params"]
        proto = schemas.protocol_of(params)
        if proto == "v1":
            p = schemas.parse_v1_params(params)
            r = c["r_target"]
            if r in (None, 0, 0.0):  # never given: the chain default, not 0 (which keeps every result empty: F7)
                r = v1.DEFAULT_R_TARGET
                if not self.r_target_warned:
                    self.r_target_warned = True
                    self.announce.append({"status": "r_target_default", "r_target": r})
            r_target = fields.get_number({"r_target": r}, "r_target", lo=0, lo_open=True)
        else:
            p = schemas.parse_v2_params(params, self.model())
            r_target = 0.0
        start = fields.get_int(c, "nonce_range_start", lo=0, hi=MAX_NONCE)
        # both ends are inclusive; an end below the start is an empty range (the reference's iterator yields
        # nothing and the session goes on): reported as complete at once, and the session waits for another
        end = fields.get_int(c, "nonce_range_end", hi=MAX_NONCE)
        bs = self.batch_size()
        if self.check_memory is not None:
            self.check_memory(proto, p, bs)
        stronger = fields.get_bool(c, "poc_stronger_rng", default=False)
        return Assignment(proto, bh, height, pk, r_target, p, json.dumps(params, sort_keys=True), start, end, bs,
                          stronger)

    # ------------------------------------------------------------------------------------ ranges

    def idle(self, a: Assignment | None) -> bool:
        """Nothing to compute until the orchestrator says more: no assignment, or its range is exhausted."""
        return a is None or a.work in self.finished

    def begin(self, a: Assignment) -> tuple[int, V1Job | V2Job]:
        """A job of `a` starts: the counters reset for a new work; its first nonce (range_end + 1 when none is left)
        and the engine job of the nonces not yet computed."""
        if self.counters_for != a.work:
            self.counters_for = a.work
            self.batch_number = self.total_computed = self.total_valid = 0
        spans = self.computed.get(a.work, [])
        start = next(uncomputed(spans, a.range_start, a.range_end), a.range_end + 1)
        nonces = uncomputed(spans, a.range_start, a.range_end)
        lim = Limits(max_nonces=None, max_duration=None)  # the session keeps time
        if a.protocol == "v1":
            job = V1Job(block_hash=a.block_hash, public_key=a.public_key, block_height=a.block_height, params=a.params,
                        r_target=a.r_target, nonces=nonces, batch_size=a.batch_size, dtype=self.dtype, limits=lim)
        else:
            seq_len, k_dim = a.params
            job = V2Job(block_hash=a.block_hash, public_key=a.public_key, block_height=a.block_height,
                        seq_len=seq_len, k_dim=k_dim, nonces=nonces, batch_size=a.batch_size,
                        stronger_rng=a.stronger_rng, limits=lim)
        return start, job

    def record(self, a: Assignment, nonces: list[int]) -> None:
        """The batch's nonces are computed (and each goes out as a result)."""
        add_spans(self.computed.setdefault(a.work, []), nonces)

    def complete(self, a: Assignment) -> None:
        """The range of `a` is exhausted."""
        self.finished.add(a.work)

    def result_body(self, a: Assignment, b: BatchResult) -> dict:
        """The result of one run of consecutive nonces (the reference's keys and order, then first_nonce/last_nonce
        and idempotency_id), counted."""
        self.batch_number += 1
        self.total_computed += len(b.nonces)
        head = {"worker_id": 0, "public_key": a.public_key, "block_hash": a.block_hash, "block_height": a.block_height}
        if a.protocol == "v1":
            nonces, dist = v1_hits(b, a.r_target)
            self.total_valid += len(nonces)
            body = {**head, "nonces": nonces, "dist": dist, "node_id": 0, "batch_number": self.batch_number,
                    "batch_computed": len(b.nonces), "batch_valid": len(nonces)}
        else:
            arts = b.artifacts or []
            self.total_valid += len(arts)
            body = {**head, "artifacts": arts, "encoding": v2.encoding(a.params[1]), "node_id": 0,
                    "batch_number": self.batch_number, "batch_computed": len(b.nonces), "batch_valid": len(arts)}
            if b.dropped:
                body["dropped_nonces"] = b.dropped
        body.update(total_computed=self.total_computed, total_valid=self.total_valid,
                    elapsed_seconds=int(b.elapsed), first_nonce=b.nonces[0], last_nonce=b.nonces[-1])
        body["idempotency_id"] = result_id(a, b.nonces[0], b.nonces[-1], len(b.nonces))
        return body


def uncomputed(spans: list[list[int]], start: int, end: int) -> Iterator[int]:
    """The nonces of [start, end] outside `spans`, in order. The spans are copied here, on the loop: the engine
    thread iterates while the loop adds this job's batches to them."""
    snapshot = [(lo, hi) for lo, hi in spans]

    def gen():
        n = start
        for lo, hi in snapshot:
            if lo > n:
                yield from range(n, min(lo, end + 1))
            n = max(n, hi + 1)
            if n > end:
                return
        yield from range(n, end + 1)

    return gen()


def split_runs(b: BatchResult) -> list[BatchResult]:
    """The batch as one BatchResult per run of consecutive nonces (itself when it is one run)."""
    cuts = [i for i in range(1, len(b.nonces)) if b.nonces[i] != b.nonces[i - 1] + 1]
    if not cuts:
        return [b]
    out = []
    for i, j in zip([0, *cuts], [*cuts, len(b.nonces)]):
        ns = b.nonces[i:j]
        lo, hi = ns[0], ns[-1]
        arts = None if b.artifacts is None else [x for x in b.artifacts if lo <= x["nonce"] <= hi]
        out.append(BatchResult(index=b.index, nonces=ns, elapsed=b.elapsed, batch_seconds=b.batch_seconds,
                               dist=None if b.dist is None else b.dist[i:j], artifacts=arts,
                               dropped=[n for n in b.dropped if lo <= n <= hi]))
    return out


def result_id(a: Assignment, first: int, last: int, count: int) -> str:
    """Deterministic: the same batch computed again (a switch back, a replay) has the same id, so the
    orchestrator keeps it once."""
    ident = f"results|{a.protocol}|{a.block_hash}|{a.public_key}|{a.params_key}|{a.r_target!r}|{a.stronger_rng}|" \
            f"{first}|{last}|{count}"
    return hashlib.sha256(ident.encode()).hexdigest()[:32]
