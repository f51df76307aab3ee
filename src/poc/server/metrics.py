"""Prometheus metrics, on a CollectorRegistry of the app's own (not the global one: tests build many apps)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes
STATES = ["loading", "ready", "busy", "broken"]


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.nonces = Counter("poc_nonces_computed", "Nonces computed", ["protocol"], registry=r)
        self.valid = Counter("poc_nonces_valid", "v1: nonces with dist < r_target; v2: finite artifacts",
                             ["protocol"], registry=r)
        self.batches = Counter("poc_batches", "Batches computed", ["protocol"], registry=r)
        self.jobs = Counter("poc_jobs", "Jobs ended, by how they ended", ["protocol", "reason"], registry=r)
        self.errors = Counter("poc_errors", "Failures by kind (bad_input, busy, job, callback, internal, ...)",
                              ["kind"], registry=r)
        self.rate = Gauge("poc_nonces_per_second", "Throughput of the running job (0 when idle)", registry=r)
        self.state = Enum("poc_engine_state", "Engine state", states=STATES, registry=r)
        self.load_seconds = Gauge("poc_model_load_seconds", "Time to load the --model checkpoint", registry=r)
        self.callbacks = Counter("poc_callbacks", "Callback deliveries by outcome (sent, retried, dropped, dead_letter)",
                                 ["kind", "outcome"], registry=r)
        self.callbacks_dead_letter = Gauge("poc_callbacks_dead_letter_records", "Callback records in the spool's "
                                           "dead-letter file (refused for good or past their lifetime)", registry=r)
        self.callbacks_pending = Gauge("poc_callbacks_pending", "Callback payloads not yet delivered", registry=r)
        self.spool_ok = Gauge("poc_spool_ok", "1 while the result/callback spool accepts writes, 0 while records "
                              "are kept in memory only", registry=r)
        self.spool_ok.set(1)

    def batch(self, protocol: str, computed: int, valid: int, rate: float) -> None:
        self.nonces.labels(protocol).inc(computed)
        self.valid.labels(protocol).inc(valid)
        self.batches.labels(protocol).inc()
        self.rate.set(rate)

    def job_done(self, protocol: str, reason: str) -> None:
        self.jobs.labels(protocol, reason).inc()
        self.rate.set(0)

    def error(self, kind: str) -> None:
        self.errors.labels(kind).inc()

    def render(self, engine_state: str, load_seconds: float | None) -> bytes:
        self.state.state(engine_state if engine_state in STATES else "broken")
        if load_seconds is not None:
            self.load_seconds.set(load_seconds)
        return generate_latest(self.registry)
