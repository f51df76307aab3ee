"""POST /warmup: a warm worker parked until a controller has params for it (spec-v1 §4.2).

    POST /warmup {"callback_url": "http://controller", ["job_id": "..."]}

Streams {"status": "warmup_ready"}, then polls GET {callback_url}/warmup/params?job_id= every warmup_poll_interval
(one status line per poll: "warmup_waiting", or "warmup_callback_unreachable" with the error when the controller
cannot be reached or answers more than 64 KiB (clients/answers.py): never a silent stall) for up to
warmup_max_duration ("warmup_timeout"). On {"status": "ready",
"params": {...}} (params = a complete /generate request, v1 or v2) it runs the /generate logic and streams each
line as it is produced (spec-v1 §6 F3: the reference buffered them all), then POSTs {callback_url}/warmup/complete
{job_id, total_batches, total_computed, total_valid} through the durable sender (spooled, re-sent until
acknowledged) and says whether it was acknowledged. The device is claimed only once params arrive, so /health
stays "ready" while the worker waits; while another job holds the device the controller is not asked (its params
would only meet a busy refusal): the poll line says "device busy". (The model is built when the params arrive: a
v1 model depends on the block hash, which only the params carry; a v2 checkpoint was loaded at start.)
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

import aiohttp
from aiohttp import web

from poc.clients import answers
from poc.errors import InputError
from poc.logs import describe
from poc.server import fields
from poc.server.context import config_key, engine_key, new_runner, sender_key, track_streams
from poc.server.security import url_policy
from poc.server.stream import NdjsonWriter, pump
from poc.server.jobs import admit_job, parse_generate

log = logging.getLogger("poc.warmup")
UNREACHABLE = "callback unreachable"  # what the stream says of any failure: the detail is only logged

COMPLETED = ("max_nonces", "max_duration", "exhausted")  # the normal ends, after which /warmup/complete is sent


routes = web.RouteTableDef()


def setup(app: web.Application) -> None:
    track_streams(app, warmups_key, WarmupStop.end)
    app.add_routes(routes)


class WarmupStop(asyncio.Event):
    """Set by a stop (/api/v1/stop and the others: "stopped") or by shutdown ("shutdown"), with the reason."""

    reason = "shutdown"

    def end(self, reason: str) -> None:
        self.reason = reason
        self.set()


@routes.post("/warmup")
async def warmup(request: web.Request) -> web.StreamResponse:
    app = request.app
    cfg = app[config_key]
    body, cb = await fields.read_url_body(request, cfg.max_body_bytes, "callback_url", {"job_id"}, url_policy(app))
    job_id = body.get("job_id")
    if job_id is None:
        job_id = "unknown"
    elif isinstance(job_id, bool) or not isinstance(job_id, (str, int)):  # as the reference: echoed as given
        raise InputError(f"job_id must be a string or an integer, got {fields.short(job_id)}", "job_id")
    stop = WarmupStop()
    app[warmups_key].add(stop)
    w = NdjsonWriter(request)
    try:
        await w.open()
        await w.write({"status": "warmup_ready", "job_id": job_id})
        params = await _wait_params(app, w, cb, job_id, stop)
        if params is not None:
            await _generate(app, w, cb, job_id, params)
    finally:
        app[warmups_key].discard(stop)
    await w.close()
    return w.resp


async def _wait_params(app: web.Application, w: NdjsonWriter, cb: str, job_id: str | int, stop: WarmupStop):
    """The /generate request once the controller has it; None after a timeout, a shutdown or a gone client."""
    cfg = app[config_key]
    t0 = time.monotonic()
    polls = 0
    async with url_policy(app).session(cfg.callback_timeout) as http:
        while True:
            elapsed = time.monotonic() - t0
            if stop.is_set():  # a stop that came while the controller was being asked
                await w.write({"status": stop.reason, "elapsed": round(elapsed, 3)})
                return None
            if elapsed >= cfg.warmup_max_duration:
                await w.write({"status": "warmup_timeout", "elapsed": round(elapsed, 3)})
                return None
            polls += 1
            line = {"status": "warmup_waiting", "poll_count": polls, "elapsed": 0.0}  # the reference's keys first
            if app[engine_key].busy:  # another job holds the device: the params are not taken (a refusal after
                line["detail"] = "device busy"  # taking them would lose the controller's job), asked again later
            else:
                try:
                    async with http.get(f"{cb}/warmup/params", params={"job_id": job_id}) as r:
                        if r.status >= 300:  # the status is logged, not streamed: no probing through us
                            line = {"status": "warmup_callback_unreachable", "poll_count": polls, "elapsed": 0.0,
                                    "error": UNREACHABLE}
                            if polls == 1 or polls % 10 == 0:
                                log.info("warmup %s: callback %s answered HTTP %d", job_id, cb, r.status)
                        else:
                            raw = await answers.read_capped(r, answers.PARAMS_CAP)  # a longer one: unreachable
                            try:
                                data = answers.parse(raw)
                            except ValueError:
                                data = None
                                line["detail"] = "the answer is not JSON"
                            if isinstance(data, dict) and data.get("status") == "ready":
                                if isinstance(data.get("params"), dict):
                                    if not await w.write({"status": "warmup_params_received",
                                                          "elapsed": round(time.monotonic() - t0, 3)}):
                                        # no job for nobody: its model build and batches would all be lost
                                        log.warning("warmup %s: the client went away before the params arrived; no "
                                                    "job is started (the controller handed them out: give them to "
                                                    "another worker)", job_id)
                                        return None
                                    return data["params"]
                                line["detail"] = "status ready without a params object"
                except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                    line = {"status": "warmup_callback_unreachable", "poll_count": polls, "elapsed": 0.0,
                            "error": UNREACHABLE}
                    if polls == 1 or polls % 10 == 0:
                        log.info("warmup %s: callback %s unreachable %s", job_id, cb, describe(e))
            line["elapsed"] = round(time.monotonic() - t0, 3)
            if not await w.write(line):
                log.info("warmup %s: the client went away while waiting", job_id)
                return None
            left = cfg.warmup_max_duration - (time.monotonic() - t0)
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, min(cfg.warmup_poll_interval, left)))
                await w.write({"status": stop.reason, "elapsed": round(time.monotonic() - t0, 3)})
                return None
            except asyncio.TimeoutError:
                pass


async def _generate(app: web.Application, w: NdjsonWriter, cb: str, job_id: str | int, body: dict) -> None:
    """The /generate logic on the stream that is already open: failures are lines."""
    cfg = app[config_key]
    try:
        body = fields.unwrap(body)
        job, lines, label = parse_generate(app, body, f"/warmup {job_id}")
        claim = admit_job(app, job, "/warmup")
    except InputError as e:
        log.info("warmup %s: params refused (%d): %s", job_id, e.status, e.message)
        await w.write({"error": e.message, "error_type": "InputError", "field": e.field, "http_status": e.status})
        return
    runner = new_runner(app, job, claim, label)
    try:
        await pump(w, runner, lines.line)
    except Exception as e:  # pump ended the job as an error
        log.warning("warmup %s stream failed %s", job_id, describe(e))
        await w.write({"error": str(e), "error_type": type(e).__name__})
        return
    finally:
        runner.close()
    s, summary = runner.stats, runner.summary
    if summary is None or summary.reason not in COMPLETED:
        return
    payload = {"job_id": job_id, "total_batches": s.batches, "total_computed": s.computed, "total_valid": s.valid}
    rid = f"warmup-complete-{uuid.uuid4().hex}"
    sender = app[sender_key]
    if not await sender.put("warmup/complete", cb, payload, rid):
        await w.write({"status": "warmup_complete_failed", "job_id": job_id, "error": "the callback queue is full"})
        return
    if await sender.wait_acked(cb, rid, cfg.callback_timeout):
        await w.write({"status": "warmup_complete_sent", "job_id": job_id})
    else:  # still in the spool: re-sent with backoff until the controller acknowledges it
        log.info("warmup %s: completion pending (%s)", job_id, sender.last_error(cb, rid))
        await w.write({"status": "warmup_complete_pending", "job_id": job_id, "error": UNREACHABLE})


warmups_key = web.AppKey("warmups", set)
