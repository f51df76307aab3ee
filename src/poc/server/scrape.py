"""What GET /metrics reads from the app when it is scraped: queue depths and the build info.

    poc_pow_queue_jobs, poc_pow_queued_nonces    the /api/v1/pow/generate queue (queued + running)
    poc_build_info{version, torch, cuda, device}  1, the labels say what serves (a Prometheus "info" metric)

The pending callbacks are poc_callbacks_pending (metrics.py, kept by the sender as it goes).
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily
from prometheus_client.registry import Collector


class AppCollector(Collector):
    """Registered on the app's Metrics registry by create_app; reads the app only when scraped."""

    def __init__(self, app):
        self.app = app
        self._build: dict[str, str] | None = None

    def build_labels(self) -> dict[str, str]:
        if self._build is None:
            import torch

            from poc import __version__
            from poc.server.context import engine_key

            dev = self.app[engine_key].device
            name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
            self._build = {"version": __version__, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
                           "device": name}
        return self._build

    def collect(self):
        from poc.server.pow_service import pow_key

        pow_service = self.app.get(pow_key)
        jobs = GaugeMetricFamily("poc_pow_queue_jobs", "Jobs in the /api/v1/pow/generate queue, queued or running")
        nonces = GaugeMetricFamily("poc_pow_queued_nonces", "Nonces of the /api/v1/pow/generate queue (queued + "
                                   "running)")
        running = 1 if pow_service is not None and getattr(pow_service, "_running", None) is not None else 0
        jobs.add_metric([], (len(pow_service.queue) + running) if pow_service is not None else 0)
        nonces.add_metric([], pow_service.queued_nonces if pow_service is not None else 0)
        info = InfoMetricFamily("poc_build", "What serves: the package version, torch, its CUDA, the device name")
        info.add_metric([], self.build_labels())
        return [jobs, nonces, info]
