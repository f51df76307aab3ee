"""Prometheus metrics, on a CollectorRegistry of the app's own (not the global one: tests build many apps), with
the default process, platform and GC collectors on it as well; what is read from the app at scrape time (queue
depths, build info) is poc.server.scrape."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, generate_latest
from prometheus_client.gc_collector import GCCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes
STATES = ["loading", "ready", "busy", "broken"]
# a batch: ~1 ms (tiny v1 on a CPU) to minutes (a 235B model's batch over 4 GPUs)
BATCH_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# a callback record from its creation to its acknowledgement: retries back off up to 30 s each, for as long as needed
DELIVERY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0, 3600.0)


class Metrics:
    def __init__(self):
        self.registry = r = CollectorRegistry()
        ProcessCollector(registry=r)  # as on the global registry: process_cpu_seconds_total, process_resident_memory_bytes, open fds, ...
        PlatformCollector(registry=r)  # python_info
        GCCollector(registry=r)  # python_gc_*
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
        self.batch_seconds = Histogram("poc_batch_seconds", "One batch, from its launch on the device to its results "
                                       "on the host", ["protocol"], buckets=BATCH_BUCKETS, registry=r)
        self.callback_post_seconds = Histogram("poc_callback_post_seconds", "One callback POST (a delivery attempt), "
                                               "by kind", ["kind"], registry=r)
        self.callback_delivery_seconds = Histogram("poc_callback_delivery_seconds", "A callback record from its "
                                                   "creation to its acknowledgement (retries included), by kind",
                                                   ["kind"], buckets=DELIVERY_BUCKETS, registry=r)

    def batch(self, protocol: str, computed: int, valid: int, rate: float, seconds: float | None = None) -> None:
        if seconds is not None:
            self.batch_seconds.labels(protocol).observe(seconds)
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
