"""The request types of the APIs: JSON bodies -> job dataclasses, or InputError (400 with {"error", "field"}) before
any work. The root routes' (/generate, /validate), /api/v1/pow's (v2: spec-v2 §e; v1: spec-v1 §4.5) and the params
/pooled reads; the model a request may name (ServedModel, ParamsMismatch).

Every field is typed and range-checked by the toolkit in fields.py; params have no silent defaults (spec-v1 §6 F10).
The root routes are strict about unknown fields. The /api/v1/pow routes ignore unknown top-level fields, as the
reference does (the MLNode's client struct is the contract there), but their params are strict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from poc import dtypes
from poc.engine.jobs import Limits, V1Job, V2Job
from poc.errors import InputError
from poc.protocol import v1, v2
from poc.protocol.nonces import MAX_INT32, MAX_NONCE, stride_nonces, upto_max_nonce, worker_nonces
from poc.server.config import ServerConfig
from poc.server.fields import (MAX_INT64, check_keys, finite, get_any_int64_nonces, get_batch_size, get_bool,
                               get_header, get_int, get_limits, get_node, get_nonces, get_number, get_str, get_url,
                               short, url_policy_of)

V1_DTYPES = dtypes.NAMES


class ParamsMismatch(InputError):
    """409: params.model is not the model this server serves (the reference's check_params_match)."""

    def __init__(self, requested: dict, served: "ServedModel | None"):
        names = served.names if served else []
        why = (f"params.model {short(requested.get('model'))} is not served here (serving {', '.join(names)})" if names
               else "no PoC v2 model is loaded: start the server with --model, or POST /api/v1/inference/up")
        super().__init__(why, "params.model", status=409)
        self.requested, self.deployed = requested, {"model": names, "seq_len": None, "k_dim": None}

    def to_json(self) -> dict:
        return {"error": "params mismatch", "field": self.field, "detail": self.message,
                "requested": self.requested, "deployed": self.deployed}


@dataclass(frozen=True)
class ServedModel:
    names: list[str]  # what params.model may say: the served names, the directory's basename, the path as given,
    # its absolute path, and the Hub repo id of a Hugging Face cache snapshot
    max_seq_len: int  # the model's max_position_embeddings
    hidden: int
    ids: tuple[str, ...] = ()  # the model ids an OpenAI /v1/models list shows, as vLLM would: the served names,
    # else the Hub repo id of a cache snapshot, else the model as given

    @classmethod
    def of(cls, model_arg: str, cfg, served_names=()) -> "ServedModel":
        p = Path(model_arg)
        names = [*served_names, p.name, model_arg, str(p.resolve())]
        repo = hub_repo_id(p)
        if repo:
            names.append(repo)
        ids = tuple(dict.fromkeys(served_names)) or (repo or model_arg,)
        return cls(list(dict.fromkeys(names)), cfg.max_seq_len, cfg.dim, ids)


def hub_repo_id(path: Path) -> str | None:
    """"Org/Name" for a Hugging Face cache snapshot (.../models--Org--Name/snapshots/<rev>), else None.

    vLLM serves a Hub model under its repo id, which is what the MLNode puts in params.model."""
    for part in (path, *path.parents):
        if part.name.startswith("models--"):
            return part.name.removeprefix("models--").replace("--", "/")
    return None


# --------------------------------------------------------------------------------------------------
# params


def protocol_of(params) -> str:
    """{"model", "seq_len", "k_dim"} is v2; {"dim", ...} is v1."""
    if not isinstance(params, dict):
        raise InputError("params must be a JSON object", "params")
    if "model" in params:
        return "v2"
    if "dim" in params:
        return "v1"
    raise InputError("params must be PoC v1 ({\"dim\", \"n_layers\", ...}) or PoC v2 "
                     "({\"model\", \"seq_len\", \"k_dim\"})", "params")


def parse_v2_params(params, served: ServedModel | None) -> tuple[int, int]:
    """(seq_len, k_dim) checked against the served model; 409 when params.model is not served here."""
    if not isinstance(params, dict):
        raise InputError("params must be a JSON object", "params")
    check_keys(params, {"model", "seq_len"}, {"k_dim"}, prefix="params")
    model = get_str(params, "model", prefix="params")
    seq_len = get_int(params, "seq_len", prefix="params", lo=1)
    k_dim = get_int(params, "k_dim", prefix="params", default=v2.DEFAULT_K_DIM, lo=1)
    if served is None or model not in served.names:
        raise ParamsMismatch({"model": model, "seq_len": seq_len, "k_dim": k_dim}, served)
    if seq_len > served.max_seq_len:
        raise InputError(f"params.seq_len must be <= {served.max_seq_len} (the model's max_position_embeddings), "
                         f"got {seq_len}", "params.seq_len")
    if k_dim > served.hidden:
        raise InputError(f"params.k_dim must be in [1, {served.hidden}] (the model's hidden size), got {k_dim}",
                         "params.k_dim")
    return seq_len, k_dim


def parse_v1_params(params) -> v1.V1Params:
    return v1.V1Params.from_json(params, "params")


def get_dtype(obj: dict) -> str:
    d = get_str(obj, "dtype", default="float16")
    if d not in V1_DTYPES:
        raise InputError(f"dtype must be one of {', '.join(V1_DTYPES)}, got {short(d)}", "dtype")
    return d


# --------------------------------------------------------------------------------------------------
# root routes


V1_GENERATE_FIELDS = ("block_hash", "block_height", "public_key", "r_target", "batch_size", "start_nonce", "params")


def parse_v1_generate(body: dict, cfg: ServerConfig) -> V1Job:
    check_keys(body, V1_GENERATE_FIELDS, {"max_nonces", "max_duration", "dtype"})
    bh, height, pk = get_header(body)
    params = parse_v1_params(body["params"])
    r_target = get_number(body, "r_target", lo=0, lo_open=True)
    start = get_int(body, "start_nonce", lo=0, hi=MAX_NONCE)
    return V1Job(block_hash=bh, public_key=pk, block_height=height, params=params, r_target=r_target,
                 nonces=upto_max_nonce(worker_nonces(start, 0, 1)), batch_size=get_batch_size(body, cfg),
                 dtype=get_dtype(body), limits=get_limits(body, cfg))


@dataclass
class V2Stream:
    job: V2Job
    node_id: int


def parse_v2_generate(body: dict, cfg: ServerConfig, served: ServedModel | None) -> V2Stream:
    check_keys(body, {"block_hash", "block_height", "public_key", "node_id", "node_count", "batch_size", "params"},
               {"start_nonce", "poc_stronger_rng", "group_id", "n_groups", "max_nonces", "max_duration"})
    seq_len, k_dim = parse_v2_params(body["params"], served)
    bh, height, pk = get_header(body)
    node_id, node_count, group_id, n_groups = get_node(body)
    start = get_int(body, "start_nonce", default=0, lo=0, hi=MAX_NONCE)
    job = V2Job(block_hash=bh, public_key=pk, block_height=height, seq_len=seq_len, k_dim=k_dim,
                nonces=stride_nonces(start, node_id, node_count, group_id, n_groups),
                batch_size=get_batch_size(body, cfg), stronger_rng=get_bool(body, "poc_stronger_rng", default=False),
                limits=get_limits(body, cfg))
    return V2Stream(job, node_id)


@dataclass
class V1Validate:
    batch: v1.ProofBatch
    params: v1.V1Params
    r_target: float
    fraud_threshold: float
    dtype: str


def parse_proof_batch(body: dict, cfg: ServerConfig, as_reference: bool = False) -> v1.ProofBatch:
    """A v1 ProofBatch. With `as_reference` (the MLNode's /api/v1/pow/validate) the nonces may be empty, repeated or
    negative, as the reference's pydantic model takes them and scores them: the validator still gets a verdict on a
    node's odd on-chain batch instead of a 400."""
    bh, height, pk = get_header(body)
    nonces = get_any_int64_nonces(body, cfg.max_request_nonces) if as_reference else \
        get_nonces(body, "nonces", cfg.max_request_nonces)
    dist = body.get("dist")
    if not isinstance(dist, list) or len(dist) != len(nonces):
        raise InputError(f"dist must be a list of {len(nonces)} numbers (one per nonce)", "dist")
    for d in dist:
        if isinstance(d, bool) or not isinstance(d, (int, float)) or not finite(d):
            raise InputError(f"dist must hold finite numbers, got {short(d)}", "dist")
    node_id = get_int(body, "node_id", lo=-MAX_INT64 - 1, hi=MAX_INT64)
    return v1.ProofBatch(public_key=pk, block_hash=bh, block_height=height, nonces=nonces,
                         dist=[float(d) for d in dist], node_id=node_id)


def parse_v1_validate(body: dict, cfg: ServerConfig) -> V1Validate:
    check_keys(body, {"public_key", "block_hash", "block_height", "nonces", "dist", "node_id", "params", "r_target",
                      "fraud_threshold"}, {"dtype"})
    params = parse_v1_params(body["params"])
    batch = parse_proof_batch(body, cfg)
    return V1Validate(batch, params, get_number(body, "r_target", lo=0, lo_open=True),
                      get_number(body, "fraud_threshold", lo=0, lo_open=True, hi=1.0), get_dtype(body))


# --------------------------------------------------------------------------------------------------
# /api/v1/pow (v2: spec-v2 §e; v1: spec-v1 §4.5)


@dataclass
class PowV2Init:
    block_hash: str
    block_height: int
    public_key: str
    node_id: int
    node_count: int
    group_id: int
    n_groups: int
    batch_size: int  # the request's, else the served model's default (default_batch)
    seq_len: int
    k_dim: int
    url: str | None
    stronger_rng: bool

    def job(self) -> V2Job:
        """Until /stop, or the last nonce inside int32 (the node stores nonces as int32: past it they would wrap)."""
        return V2Job(block_hash=self.block_hash, public_key=self.public_key, block_height=self.block_height,
                     seq_len=self.seq_len, k_dim=self.k_dim,
                     nonces=stride_nonces(0, self.node_id, self.node_count, self.group_id, self.n_groups,
                                          end=MAX_INT32),
                     batch_size=self.batch_size, stronger_rng=self.stronger_rng,
                     limits=Limits(max_nonces=None, max_duration=None))

    def status_config(self) -> dict:
        return {"block_hash": self.block_hash, "block_height": self.block_height, "public_key": self.public_key,
                "node_id": self.node_id, "node_count": self.node_count, "group_id": self.group_id,
                "n_groups": self.n_groups, "seq_len": self.seq_len, "k_dim": self.k_dim}


def _protocol_default(seq_len: int) -> int:
    """The batch a v2 request without one gets where no engine says otherwise (the server passes the engine's rule
    for the served model, context.default_v2_batch: a Gonka node sends none)."""
    return v2.DEFAULT_BATCH_SIZE


def parse_pow_v2_init(body: dict, cfg: ServerConfig, served: ServedModel | None,
                      default_batch: Callable[[int], int] = _protocol_default) -> PowV2Init:
    """/init/generate's v2 body; a batch_size it does not give is default_batch(seq_len)."""
    check_keys(body, {"block_hash", "block_height", "public_key", "node_id", "node_count", "params"}, strict=False)
    seq_len, k_dim = parse_v2_params(body["params"], served)
    bh, height, pk = get_header(body)
    node_id, node_count, group_id, n_groups = get_node(body, bounded=False)
    first = node_id + group_id * node_count
    if first > MAX_INT32:  # the node would store every nonce of this lattice wrapped (int32): refuse it now
        raise InputError(f"the first nonce of this node, node_id + group_id*node_count = {first}, is past the int32 "
                         f"range (max {MAX_INT32}) the Gonka node stores PoC v2 nonces in", "node_id")
    batch_size = get_batch_size(body, cfg, default=None)
    url, stronger = get_url(body, policy=url_policy_of(cfg)), get_bool(body, "poc_stronger_rng", default=False)
    if batch_size is None:  # asked last: the body is valid, so the default is for a request that runs
        batch_size = default_batch(seq_len)
    return PowV2Init(bh, height, pk, node_id, node_count, group_id, n_groups, batch_size, seq_len, k_dim, url,
                     stronger)


@dataclass
class PowV2Generate:
    block_hash: str
    block_height: int
    public_key: str
    node_id: int
    node_count: int
    nonces: list[int]
    seq_len: int
    k_dim: int
    batch_size: int  # the request's, else the served model's default (default_batch)
    wait: bool
    url: str | None
    stronger_rng: bool
    received: dict[int, str] | None = None  # validation.artifacts by nonce
    stat: v2.StatTest = field(default_factory=v2.StatTest)

    def job(self) -> V2Job:
        return V2Job(block_hash=self.block_hash, public_key=self.public_key, block_height=self.block_height,
                     seq_len=self.seq_len, k_dim=self.k_dim, nonces=iter(self.nonces), batch_size=self.batch_size,
                     stronger_rng=self.stronger_rng, limits=Limits(max_nonces=None, max_duration=None))


def parse_pow_v2_generate(body: dict, cfg: ServerConfig, served: ServedModel | None,
                          default_batch: Callable[[int], int] = _protocol_default) -> PowV2Generate:
    """/api/v1/pow/generate's body; a batch_size it does not give is default_batch(seq_len)."""
    check_keys(body, {"block_hash", "block_height", "public_key", "node_id", "node_count", "nonces", "params"},
               strict=False)
    seq_len, k_dim = parse_v2_params(body["params"], served)
    bh, height, pk = get_header(body)
    node_id = get_int(body, "node_id", lo=0, hi=MAX_INT64)
    node_count = get_int(body, "node_count", lo=1, hi=MAX_INT64)
    nonces = get_nonces(body, "nonces", cfg.max_request_nonces)
    batch_size = get_batch_size(body, cfg, default=None)
    wait, url = get_bool(body, "wait", default=False), get_url(body, policy=url_policy_of(cfg))
    req = PowV2Generate(bh, height, pk, node_id, node_count, nonces, seq_len, k_dim, batch_size, wait, url,
                        get_bool(body, "poc_stronger_rng", default=False))
    val = body.get("validation")
    if val is not None:
        req.received = _parse_validation(val, nonces)
    st = body.get("stat_test")
    if st is not None:
        if not isinstance(st, dict):
            raise InputError("stat_test must be a JSON object", "stat_test")
        # a plain object in the reference: unknown keys are ignored and 0 is a valid bound (dist_threshold 0: any
        # difference is a mismatch; p_mismatch 0: any mismatch is fraud; fraud_threshold 0: never fraud)
        d = v2.StatTest()
        req.stat = v2.StatTest(
            dist_threshold=get_number(st, "dist_threshold", prefix="stat_test", default=d.dist_threshold, lo=0),
            p_mismatch=get_number(st, "p_mismatch", prefix="stat_test", default=d.p_mismatch, lo=0, hi=1.0),
            fraud_threshold=get_number(st, "fraud_threshold", prefix="stat_test", default=d.fraud_threshold, lo=0,
                                       hi=1.0))
    if req.batch_size is None:  # asked last: the body is valid, so the default is for a request that runs
        req.batch_size = default_batch(seq_len)
    return req


def _parse_validation(val, nonces: list[int]) -> dict[int, str]:
    """validation.artifacts: one {nonce, vector_b64} per requested nonce. A vector that does not decode is a
    mismatch (scored later), not a 400; a nonce set that differs from `nonces`, or repeats, is a 400."""
    f = "validation.artifacts"
    if not isinstance(val, dict) or not isinstance(val.get("artifacts"), list):
        raise InputError("validation must be {\"artifacts\": [{\"nonce\", \"vector_b64\"}, ...]}", f)
    received: dict[int, str] = {}
    for a in val["artifacts"]:
        if not isinstance(a, dict) or "nonce" not in a:
            raise InputError(f"{f} items must be objects with nonce and vector_b64", f)
        n, b = a["nonce"], a.get("vector_b64", "")
        if isinstance(n, bool) or not isinstance(n, int):
            raise InputError(f"{f}: nonce must be an integer, got {short(n)}", f)
        if b is not None and not isinstance(b, str):
            raise InputError(f"{f}: vector_b64 must be a string, got {short(b)}", f)
        if n in received:
            raise InputError(f"{f} holds nonce {n} more than once", f)
        received[n] = b or ""
    if set(received) != set(nonces):
        raise InputError("validation.artifacts nonces must match nonces field", f)
    return received


@dataclass
class PowV1Init:
    node_id: int
    node_count: int
    block_hash: str
    block_height: int
    public_key: str
    batch_size: int
    r_target: float
    fraud_threshold: float
    params: v1.V1Params
    url: str | None

    def job(self) -> V1Job:
        return V1Job(block_hash=self.block_hash, public_key=self.public_key, block_height=self.block_height,
                     params=self.params, r_target=self.r_target,
                     nonces=stride_nonces(0, self.node_id, self.node_count, 0, 1), batch_size=self.batch_size,
                     limits=Limits(max_nonces=None, max_duration=None))  # until /stop or /phase/validate

    def status_config(self) -> dict:
        return {"block_hash": self.block_hash, "block_height": self.block_height, "public_key": self.public_key,
                "node_id": self.node_id, "node_count": self.node_count, "r_target": self.r_target,
                "fraud_threshold": self.fraud_threshold, "params": self.params.to_json()}


def parse_pow_v1_init(body: dict, cfg: ServerConfig, need_node: bool) -> PowV1Init:
    """The pow init body; node_id/node_count may be -1 (unset) except where generation needs them."""
    check_keys(body, {"block_hash", "block_height", "public_key", "params"}, strict=False)
    params = parse_v1_params(body["params"])
    bh, height, pk = get_header(body)
    node_count = get_int(body, "node_count", default=-1, lo=-1, hi=MAX_INT64)
    node_id = get_int(body, "node_id", default=-1, lo=-1, hi=MAX_INT64)
    if need_node or node_id != -1 or node_count != -1:
        # unbounded above, as the reference (and the v2 init): an MLNode's node numbers may have gaps
        if node_count < 1:
            raise InputError(f"node_count must be >= 1, got {node_count}", "node_count")
        if node_id < 0:
            raise InputError(f"node_id must be >= 0, got {node_id}", "node_id")
    return PowV1Init(node_id, node_count, bh, height, pk,
                     get_batch_size(body, cfg, default=100),  # gonka's chain default
                     get_number(body, "r_target", default=v1.DEFAULT_R_TARGET, lo=0, lo_open=True),
                     get_number(body, "fraud_threshold", default=v1.DEFAULT_FRAUD_THRESHOLD, lo=0, lo_open=True,
                                hi=1.0),
                     params, get_url(body, policy=url_policy_of(cfg)))
