"""What the route modules share about a job, so that no route module imports another: a /generate-shaped request
parsed and admitted (/generate and /warmup), a PoC v1 ProofBatch recomputed and scored (/validate and the
/api/v1/pow queue). The runner, its backpressure and the NDJSON writer are stream.py; the gate before a job
(ready, fits, device claimed) is context.admit.
"""

from __future__ import annotations

from aiohttp import web

from poc.engine.jobs import Limits, V1Job
from poc.errors import InputError
from poc.protocol import v1
from poc.server import schemas
from poc.server.context import admit, config_key, new_runner, require_ready, served_model
from poc.server.results import V1Lines, V2Lines
from poc.server.stream import collect

VALIDATE_BATCH_SIZE = 100  # gonka's chain default batch size


def parse_generate(app: web.Application, body: dict, route: str):
    """A /generate-shaped request (v1 or v2 by its params) -> (job, its line format, a log label): the schema and
    readiness checks; admit_job() then checks its memory estimate and claims the device. Used by /generate and
    /warmup."""
    cfg = app[config_key]
    if "params" not in body:  # v1 or v2 is told by params; the message names every v1 field missing, as the reference
        missing = [k for k in schemas.V1_GENERATE_FIELDS if k not in body]
        raise InputError(f"Missing required fields: {missing}", "params")
    proto = schemas.protocol_of(body["params"])
    require_ready(app)
    if proto == "v1":
        job = schemas.parse_v1_generate(body, cfg)
        return job, V1Lines(job), \
            f"v1 {route} dim={job.params.dim} layers={job.params.n_layers} batch={job.batch_size}"
    st = schemas.parse_v2_generate(body, cfg, served_model(app))
    job = st.job
    return job, V2Lines(job, st.node_id), f"v2 {route} seq_len={job.seq_len} k_dim={job.k_dim} batch={job.batch_size}"


def admit_job(app: web.Application, job, owner: str):
    """admit() for a parsed /generate job: readiness, its memory estimate, the device."""
    if isinstance(job, V1Job):
        return admit(app, owner, v1=(job.params, job.batch_size, job.dtype))
    return admit(app, owner, v2=(job.batch_size, job.seq_len))


async def validate_v1(app: web.Application, batch: v1.ProofBatch, params: v1.V1Params, r_target: float,
                      fraud_threshold: float, dtype: str, claim, on_runner=None) -> v1.ValidatedBatch:
    """Recompute a v1 ProofBatch's nonces under `claim` (released at the end) and score it; `on_runner(runner)`
    lets a caller stop the job."""
    unique = list(dict.fromkeys(batch.nonces))  # a repeated nonce is computed once and scored at each place
    if not unique:
        claim.release()
        return v1.validate_batch(batch, [], r_target, fraud_threshold)
    job = V1Job(block_hash=batch.block_hash, public_key=batch.public_key, block_height=batch.block_height,
                params=params, r_target=r_target, nonces=iter(unique),
                batch_size=min(len(unique), VALIDATE_BATCH_SIZE), dtype=dtype,
                limits=Limits(max_nonces=None, max_duration=None))
    runner = new_runner(app, job, claim, f"v1 validation of {len(unique)} nonces")
    if on_runner is not None:
        on_runner(runner)  # lets /stop reach it
    results, _summary = await collect(runner)
    # batches arrive in completion order (replicas): each distance goes back to its own nonce
    by_nonce = {n: float(d) for b in results for n, d in zip(b.nonces, b.dist)}
    return v1.validate_batch(batch, [by_nonce[n] for n in batch.nonces], r_target, fraud_threshold)
