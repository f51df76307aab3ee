"""The pure half of /pooled (poc.server.pooled_plan), without a server or an orchestrator: the config merged into
a checked Assignment, what each change announces and does to the range bookkeeping, the nonces a job still has to
compute, and the result bodies with their deterministic ids. v1 set A params."""

import numpy as np

from poc.engine.jobs import BatchResult
from poc.errors import InputError
from poc.protocol import v1
from poc.server.config import ServerConfig
from poc.server.pooled_plan import PooledPlan, result_id, split_runs, uncomputed
from poc.server.stream import add_spans

from .golden import V1_GOLDEN as G1
from .servers import PARAMS_A

BH = G1["block_hash"]
JOB = {"block_hash": BH, "block_height": 7, "params": PARAMS_A, "r_target": 1.5, "public_key": "key-A",
       "nonce_range_start": 0, "nonce_range_end": 99}


def computing(batch_size=10, **conf) -> PooledPlan:
    plan = PooledPlan(ServerConfig(), batch_size, "float32")
    assert plan.apply({"type": "config", **JOB, **conf}) == "changed" and plan.assignment is not None
    return plan


def test_the_assignment_waits_for_a_block_hash_a_key_and_a_range():
    plan = PooledPlan(ServerConfig(), None, "float32")
    plan.merge({"block_hash": BH, "block_height": 7.0, "params": PARAMS_A})
    assert plan.reassign(None) is False and plan.assignment is None
    plan.merge({"public_key": "key-A", "nonce_range_start": 0.0, "nonce_range_end": 49.0, "batch_size": 8.0})
    assert plan.reassign(None) is True
    a = plan.assignment
    assert (a.protocol, a.block_height, a.range_start, a.range_end, a.batch_size) == ("v1", 7, 0, 49, 8)
    assert a.r_target == v1.DEFAULT_R_TARGET  # none given: the chain default, announced once
    assert plan.announce == [{"status": "r_target_default", "r_target": v1.DEFAULT_R_TARGET}]
    assert plan.reassign(None) is False  # nothing changed: a no-op
    assert plan.apply({}) is None and plan.apply(None) is None


def test_each_change_is_announced_and_moves_the_bookkeeping():
    plan = computing()
    a = plan.assignment
    plan.record(a, list(range(0, 30)))
    plan.complete(a)
    # a key in a plain config is dropped once computing
    assert plan.apply({"type": "config", "public_key": "key-B"}) is None and plan.conf["public_key"] == "key-A"
    # compute: the same work goes on under the new key
    assert plan.apply({"type": "compute", "public_key": "key-B"}) == "changed"
    assert plan.announce[-1] == {"status": "public_key_set", "public_key": "key-B"}
    assert plan.computed[a.work] == [[0, 29]] and plan.idle(plan.assignment)
    # switch_job: the range restarts under the new key
    epoch = plan.epoch
    assert plan.apply({"type": "switch_job", "public_key": "key-C"}) == "changed"
    assert plan.announce[-1] == {"status": "switched_public_key", "public_key": "key-C"}
    assert plan.epoch == epoch + 1 and a.work not in plan.computed and not plan.idle(plan.assignment)
    assert plan.apply({"type": "config", "nonce_range_start": 100, "nonce_range_end": 199}) == "changed"
    assert plan.announce[-1] == {"status": "new_range", "range_start": 100, "range_end": 199}
    assert plan.apply({"type": "config", "block_height": 8, "block_hash": "ab" * 32}) == "changed"
    assert plan.announce[-1]["status"] == "new_job"
    assert plan.apply({"type": "shutdown"}) == "shutdown"


def test_a_config_the_worker_cannot_compute_is_kept_as_bad_config():
    plan = computing()
    assert plan.apply({"type": "config", "nonce_range_start": -5}) == "changed"
    assert isinstance(plan.bad_config, InputError) and plan.bad_config.field == "nonce_range_start"
    checked = []
    plan = PooledPlan(ServerConfig(), 10, "float32", check_memory=lambda *args: checked.append(args))
    plan.apply({"type": "config", **JOB})
    assert checked == [("v1", plan.assignment.params, 10)]


def test_a_job_resumes_the_nonces_left_and_counts_its_results():
    plan = computing()
    a = plan.assignment
    start, job = plan.begin(a)
    assert start == 0 and job.batch_size == 10 and job.dtype == "float32"
    b = BatchResult(index=0, nonces=list(range(10)), elapsed=2.5, batch_seconds=0.1, dist=np.full(10, 1.0))
    plan.record(a, b.nonces)
    body = plan.result_body(a, b)
    assert (body["batch_number"], body["total_computed"], body["first_nonce"], body["last_nonce"]) == (1, 10, 0, 9)
    assert body["nonces"] == b.nonces and body["total_valid"] == 10  # every dist under r_target 1.5
    assert body["idempotency_id"] == result_id(a, 0, 9, 10) != result_id(a, 0, 9, 9)
    start, job = plan.begin(a)  # the same work again: counters go on, the nonces computed are skipped
    assert start == 10 and next(iter(job.nonces)) == 10 and plan.batch_number == 1
    plan.apply({"type": "config", "nonce_range_start": 100, "nonce_range_end": 109})
    plan.begin(plan.assignment)
    assert plan.batch_number == plan.total_computed == 0  # a new work: counters reset


def test_computed_spans_gaps_and_a_batch_straddling_them():
    spans = []
    for batch in ([20, 21, 22], [0, 1, 2], [5, 6], [3, 4], [30, 31]):  # out of order, some adjacent
        add_spans(spans, batch)
    assert spans == [[0, 6], [20, 22], [30, 31]]
    it = uncomputed(spans, 0, 33)
    add_spans(spans, [7, 8])  # a later batch of the running job: the iterator keeps its snapshot
    assert list(it) == [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 23, 24, 25, 26, 27, 28, 29, 32, 33]
    assert list(uncomputed([[0, 9]], 0, 9)) == [] and list(uncomputed([], 5, 7)) == [5, 6, 7]
    b = BatchResult(index=3, nonces=[18, 19, 23, 24], elapsed=1.0, batch_seconds=0.1, dist=np.arange(4.0))
    parts = split_runs(b)
    assert [p.nonces for p in parts] == [[18, 19], [23, 24]]
    assert [list(p.dist) for p in parts] == [[0.0, 1.0], [2.0, 3.0]]
    v2b = BatchResult(index=1, nonces=[1, 2, 9], elapsed=0, batch_seconds=0,
                      artifacts=[{"nonce": 1}, {"nonce": 9}], dropped=[2])
    assert [(p.artifacts, p.dropped) for p in split_runs(v2b)] == [([{"nonce": 1}], [2]), ([{"nonce": 9}], [])]
    assert split_runs(b)[0] is not b and split_runs(parts[0]) == [parts[0]]
