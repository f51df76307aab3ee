"""The MLNode's GPU routes, in its shapes (mlnode/packages/api/src/api/gpu): the node's background manager reads the
devices to report the host's hardware to the chain (decentralized-api/mlnodeclient/gpu.go decodes them).

    GET /api/v1/gpu/devices   {"devices": [{"index", "name", "total_memory_mb", "free_memory_mb", "used_memory_mb",
                                            "utilization_percent", "temperature_c", "is_available",
                                            "error_message"}], "count"}
    GET /api/v1/gpu/driver    {"driver_version", "cuda_driver_version", "nvml_version"}; 503 without NVML

Read from NVML (pynvml, from the nvidia-ml-py package, when installed), as the MLNode does; without it, from torch
(name and total memory; the rest null, and no CUDA context is made on any device); on a machine without a GPU an
empty list. Both run on a thread: NVML calls block.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from poc.errors import InputError

log = logging.getLogger("poc.gpu")
MIB = 1 << 20


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    app.add_routes(routes)


def _nvml():
    """The pynvml module, initialised; None when it is not installed or NVML does not start (no driver)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        log.debug("NVML did not start: %s", e)
        return None
    return pynvml


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def devices() -> list[dict]:
    """One entry per GPU the host has (the MLNode's GPUDevice), in index order."""
    nv = _nvml()
    if nv is None:
        return _torch_devices()
    try:
        try:
            n = nv.nvmlDeviceGetCount()
        except Exception as e:  # the MLNode's answer then: no devices
            log.warning("NVML cannot count the GPUs: %s", e)
            return []
        out = []
        for i in range(n):
            d = {"index": i, "name": "Unknown", "total_memory_mb": None, "free_memory_mb": None,
                 "used_memory_mb": None, "utilization_percent": None, "temperature_c": None, "is_available": True,
                 "error_message": None}
            try:
                h = nv.nvmlDeviceGetHandleByIndex(i)
                d["name"] = _text(nv.nvmlDeviceGetName(h))
            except Exception as e:  # the device cannot be queried: listed, unavailable, with the reason
                d.update(is_available=False, error_message=str(e))
                out.append(d)
                continue
            # one metric that cannot be read leaves the others (the MLNode's rule)
            try:
                m = nv.nvmlDeviceGetMemoryInfo(h)
                d.update(total_memory_mb=int(m.total) // MIB, free_memory_mb=int(m.free) // MIB,
                         used_memory_mb=int(m.used) // MIB)
            except Exception as e:
                log.debug("GPU %d: memory unavailable: %s", i, e)
            try:
                d["utilization_percent"] = int(nv.nvmlDeviceGetUtilizationRates(h).gpu)
            except Exception as e:
                log.debug("GPU %d: utilization unavailable: %s", i, e)
            try:
                d["temperature_c"] = int(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            except Exception as e:
                log.debug("GPU %d: temperature unavailable: %s", i, e)
            out.append(d)
        return out
    finally:
        nv.nvmlShutdown()


def _torch_devices() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)  # no context on device i (mem_get_info would make one)
        out.append({"index": i, "name": p.name, "total_memory_mb": p.total_memory // MIB, "free_memory_mb": None,
                    "used_memory_mb": None, "utilization_percent": None, "temperature_c": None, "is_available": True,
                    "error_message": None})
    return out


def driver() -> dict:
    """The MLNode's DriverInfo; InputError 503 when NVML is not there (as the MLNode answers then)."""
    nv = _nvml()
    if nv is None:
        raise InputError("NVML is not available here (no NVIDIA driver, or the nvidia-ml-py package is not "
                         "installed): no driver information", None, status=503)
    try:
        cuda = int(nv.nvmlSystemGetCudaDriverVersion())  # e.g. 12020 -> "12.2"
        return {"driver_version": _text(nv.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}",
                "nvml_version": _text(nv.nvmlSystemGetNVMLVersion())}
    except Exception as e:
        raise InputError(f"the driver information could not be read: {e}", None, status=503) from None
    finally:
        nv.nvmlShutdown()


@routes.get("/api/v1/gpu/devices")
async def get_devices(request: web.Request) -> web.Response:
    ds = await asyncio.to_thread(devices)
    return web.json_response({"devices": ds, "count": len(ds)})


@routes.get("/api/v1/gpu/driver")
async def get_driver(request: web.Request) -> web.Response:
    return web.json_response(await asyncio.to_thread(driver))
