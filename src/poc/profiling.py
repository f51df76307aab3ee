"""Where the device time goes: kernel time by kind from a torch.profiler run, against wall time.

Used by `python -m poc.bench --profile` (one GPU) and by the rank processes of a multi-GPU engine
(`POC_RANK_PROFILE=DIR`: each rank profiles a few steady-state batches and writes DIR/rank<N>.json).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

log = logging.getLogger("poc.profiling")

KINDS = ("gemm", "attention", "collective (nccl)", "compiled elementwise (triton)", "other")


def kind_of(name: str) -> str:
    """The kind of one kernel, by its name (cuDNN attention kernels carry "sm90" too: attention is tested first)."""
    k = name.lower()
    if "nccl" in k:
        return "collective (nccl)"
    if any(x in k for x in ("flash", "fmha", "sdpa", "attention", "attn")):
        return "attention"
    if any(x in k for x in ("gemm", "nvjet", "cutlass", "xmma", "sm90", "cublas")):
        return "gemm"
    if k.startswith("triton"):
        return "compiled elementwise (triton)"
    return "other"


def breakdown(prof, wall_s: float, top_n: int = 12, cpu: bool = False) -> dict:
    """Device time by kind (seconds), the busy fraction of the wall time and the longest kernels of `prof`.
    cpu: a CPU-only profile, whose ops have no device time: their self CPU time stands in for it."""
    kinds = dict.fromkeys(KINDS, 0.0)
    top = []
    for e in prof.key_averages():
        if cpu:
            t = e.self_cpu_time_total
        else:
            t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if not t or e.key.startswith("ProfilerStep"):
            continue
        kinds[kind_of(e.key)] += t / 1e6
        top.append((t / 1e6, e.key[:90]))
    top.sort(reverse=True)
    busy = sum(kinds.values())
    return {"wall_s": wall_s, "gpu_kernel_s": busy, "gpu_busy_pct": 100 * busy / wall_s if wall_s else None,
            "by_kind_s": kinds, "top_kernels": top[:top_n]}


class StepProfiler:
    """Profile the device work of batches [skip, skip + active) of a rank; write the breakdown when done.

    `step()` is called after each batch is launched. The wall time is from the launch of batch `skip` to the
    launch of batch `skip + active`, i.e. `active` steady-state batch periods; the kernels counted are those that
    ran in between (the device runs a little behind the host, so the window is approximate at its edges)."""

    def __init__(self, out_dir: str, name: str, device: torch.device, skip: int = 4, active: int = 4):
        from torch.profiler import ProfilerActivity, profile

        self.path = Path(out_dir) / f"{name}.json"
        self.skip, self.active, self.n, self.t0 = skip, active, 0, None
        activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
        self.device = device
        self.prof = profile(activities=[activity])
        self.done = False

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> None:
        if self.done:
            return
        self.n += 1
        if self.n == self.skip:
            self.prof.__enter__()
            self.t0 = time.perf_counter()
        elif self.n == self.skip + self.active:
            wall = time.perf_counter() - self.t0
            self._sync()
            self.prof.__exit__(None, None, None)
            self.done = True
            out = {"batches": self.active, "device": str(self.device),
                   **breakdown(self.prof, wall, cpu=self.device.type != "cuda")}
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.write_text(json.dumps(out, indent=1))
            log.warning("profile of %d batches written to %s: %s", self.active, self.path,
                        {k: round(v, 3) for k, v in out["by_kind_s"].items()}, extra={"every_rank": True})

    def close(self) -> None:
        """A job that ended inside the window: stop the profiler without writing anything."""
        if self.t0 is not None and not self.done:
            self.prof.__exit__(None, None, None)
        self.done = True
