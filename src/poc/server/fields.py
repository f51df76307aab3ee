"""The JSON validation toolkit of the request schemas: a body read and unwrapped, each field typed and range-checked,
or InputError (400 with {"error", "field"}; 413 past a size limit) naming it before any work.

Every getter takes the object, the field's name and its bounds; an explicit null on an optional field means its
default. `check_keys` refuses missing fields (the reference's message) and, where the route is strict, unknown ones.
The request types of the APIs (/generate and /validate, /api/v1/pow, /pooled's params) are built from these in
schemas.py.
"""

from __future__ import annotations

import json
import math

from aiohttp import web

from poc.engine.jobs import Limits
from poc.errors import InputError
from poc.protocol.nonces import MAX_NONCE
from poc.server import bigjson
from poc.server.config import ServerConfig, config_key

MISSING = object()
MAX_INT64 = MAX_NONCE  # heights, node numbers: int64 on the chain
OFF_LOOP_BYTES = 64 << 10  # bodies larger than this are parsed on a thread, in steps (bigjson.py)


def json_limits(cfg: ServerConfig) -> tuple[int, int]:
    """(values, containers) a large body may hold, parsed in steps (bigjson.py): at most what the largest real one
    holds, v2 /generate's nonces and their validation artifacts ({nonce, vector_b64} each: 4 values and 1 object a
    nonce), plus the other fields."""
    return 4 * cfg.max_request_nonces + 4096, cfg.max_request_nonces + 1024


# --------------------------------------------------------------------------------------------------
# bodies


async def read_json(request: web.Request, max_bytes: int) -> dict:
    """The JSON object of the body; 413 over `max_bytes`, 400 for anything that is not a JSON object."""
    if request.content_length is not None and request.content_length > max_bytes:
        raise InputError(f"request body of {request.content_length} bytes is over the {max_bytes}-byte limit",
                         None, status=413)
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise InputError(f"request body is over the {max_bytes}-byte limit", None, status=413) from None
    try:
        if len(raw) > OFF_LOOP_BYTES:  # json's C parser would hold the GIL, and so the loop, for the whole body
            cfg = request.config_dict.get(config_key)
            obj = await bigjson.parse_off_loop(raw, _no_constant, *(json_limits(cfg) if cfg is not None else ()))
        else:  # at most 64 KiB: under 10 ms on the loop, whatever it holds
            obj = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"Invalid JSON: {e}", None) from None
    except RecursionError:
        raise InputError("Invalid JSON: nested too deeply", None) from None
    if not isinstance(obj, dict):
        raise InputError("the body must be a JSON object", None)
    return obj


def _no_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def unwrap(body: dict) -> dict:
    """The PyWorker envelope: {"auth_data": ..., "payload": {...}} carries the request in payload. As the reference,
    any body with a `payload` key is an envelope, whatever else it holds (no request has a field of that name)."""
    if "payload" in body:
        p = body["payload"]
        if not isinstance(p, dict):
            raise InputError("payload must be a JSON object", "payload")
        return p
    return body


# --------------------------------------------------------------------------------------------------
# fields


def _path(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def check_keys(obj: dict, required, optional: set[str] = frozenset(), prefix: str = "",
               strict: bool = True) -> None:
    """Missing fields first (the reference's message, in the order `required` lists them), then unknown ones."""
    missing = [_path(prefix, m) for m in (required if isinstance(required, (list, tuple)) else sorted(required))
               if m not in obj]
    if missing:
        raise InputError(f"Missing required fields: {missing}", missing[0])
    required = set(required)
    extra = sorted(set(obj) - required - optional)
    if strict and extra:
        raise InputError(f"unknown field(s): {', '.join(_path(prefix, e) for e in extra)} (allowed: "
                         f"{', '.join(sorted(required | optional))})", _path(prefix, extra[0]))


def _get(obj: dict, name: str, default):
    v = obj.get(name, MISSING)
    if v is None and default is not MISSING:
        v = MISSING  # an explicit null on an optional field means "the default"
    if v is MISSING:
        if default is MISSING:
            raise InputError(f"missing required field: {name}", name)
        return MISSING
    return v


def get_int(obj: dict, name: str, *, prefix: str = "", default=MISSING, lo: int | None = None,
            hi: int | None = None, what: str = "") -> int:
    f = _path(prefix, name)
    v = _get(obj, name, default)
    if v is MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise InputError(f"{f} must be an integer, got {short(v)}", f)
    if lo is not None and v < lo:
        raise InputError(f"{f} must be >= {lo}{what}, got {short(v)}", f)
    if hi is not None and v > hi:
        raise InputError(f"{f} must be <= {hi}{what}, got {short(v)}", f)
    return v


def get_number(obj: dict, name: str, *, prefix: str = "", default=MISSING, lo: float | None = None,
               hi: float | None = None, lo_open: bool = False) -> float:
    f = _path(prefix, name)
    v = _get(obj, name, default)
    if v is MISSING:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not finite(v):
        raise InputError(f"{f} must be a finite number, got {short(v)}", f)
    v = float(v)
    if lo is not None and (v <= lo if lo_open else v < lo):
        raise InputError(f"{f} must be {'>' if lo_open else '>='} {lo}, got {v}", f)
    if hi is not None and v > hi:
        raise InputError(f"{f} must be <= {hi}, got {v}", f)
    return v


def finite(v: int | float) -> bool:
    """math.isfinite, False for an int too large for a float (10**400 is valid JSON)."""
    try:
        return math.isfinite(v)
    except OverflowError:
        return False


def short(v) -> str:
    """repr(v), cut to 40 characters for an error message (a client's value may be huge)."""
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:20]}...({len(r)} characters)"


def _get_typed(obj: dict, name: str, prefix: str, default, kind: type, what: str):
    """(field path, value): the value is MISSING when absent (or null) and optional, else an instance of kind."""
    f = _path(prefix, name)
    v = _get(obj, name, default)
    if v is not MISSING and not isinstance(v, kind):
        raise InputError(f"{f} must be {what}, got {short(v)}", f)
    return f, v


def get_str(obj: dict, name: str, *, prefix: str = "", default=MISSING, nonempty: bool = True) -> str:
    f, v = _get_typed(obj, name, prefix, default, str, "a string")
    if v is MISSING:
        return default
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800"): valid JSON, but no UTF-8 string can carry it
        raise InputError(f"{f} holds a character that cannot be encoded (a lone UTF-16 surrogate)", f) from None
    if nonempty and not v:
        raise InputError(f"{f} must not be empty", f)
    return v


def get_bool(obj: dict, name: str, *, prefix: str = "", default=MISSING) -> bool:
    _f, v = _get_typed(obj, name, prefix, default, bool, "true or false")
    return default if v is MISSING else v


async def read_url_body(request, max_bytes: int, url_field: str, optional: set[str],
                        policy=None) -> tuple[dict, str]:
    """A JSON body that names an outbound URL (required, checked against the outbound-URL policy) and some optional
    keys: (body, the URL without a trailing slash)."""
    body = unwrap(await read_json(request, max_bytes))
    if not body.get(url_field):
        raise InputError(f"{url_field} is required", url_field)
    check_keys(body, {url_field}, optional)
    return body, get_url(body, url_field, policy).rstrip("/")


def get_url(obj: dict, name: str = "url", policy=None) -> str | None:
    """A URL the server may call (clients/urlpolicy.py: http(s) with a host, no credentials, no query or fragment, no
    refused address): anything else fails here, not later in a background sender or a stream already answered 200."""
    from poc.clients.urlpolicy import UrlPolicy

    u = get_str(obj, name, default=None)
    if u is None:
        return None
    return (policy or UrlPolicy()).check(u, name)


def url_policy_of(cfg: ServerConfig):
    """The outbound-URL policy of a config: its allowlist, and its own listening address refused."""
    from poc.clients.urlpolicy import UrlPolicy

    return UrlPolicy(cfg.outbound_allow, [(cfg.host, cfg.port)])


def get_nonces(obj: dict, name: str, max_len: int, *, prefix: str = "") -> list[int]:
    """A non-empty list of distinct non-negative integers."""
    f = _path(prefix, name)
    v = _get(obj, name, MISSING)
    if not isinstance(v, list):
        raise InputError(f"{f} must be a list of integers", f)
    if not v:
        raise InputError(f"{f} must not be empty", f)
    if len(v) > max_len:
        raise InputError(f"{f} has {len(v)} nonces, more than the limit of {max_len}", f, status=413)
    for n in v:
        if isinstance(n, bool) or not isinstance(n, int):
            raise InputError(f"{f} must hold integers only, got {short(n)}", f)
        if n < 0:
            raise InputError(f"{f} must hold non-negative integers, got {n}", f)
        if n > MAX_NONCE:
            raise InputError(f"{f}: {n} is over the int64 range", f)
    seen: set[int] = set()
    for n in v:
        if n in seen:
            raise InputError(f"{f} holds {n} more than once", f)
        seen.add(n)
    return v


def get_any_int64_nonces(obj: dict, max_len: int) -> list[int]:
    """`nonces`: a list of int64 integers, possibly empty, repeated or negative (the reference's ProofBatch)."""
    v = _get(obj, "nonces", MISSING)
    if not isinstance(v, list):
        raise InputError("nonces must be a list of integers", "nonces")
    if len(v) > max_len:
        raise InputError(f"nonces has {len(v)} nonces, more than the limit of {max_len}", "nonces", status=413)
    for n in v:
        if isinstance(n, bool) or not isinstance(n, int):
            raise InputError(f"nonces must hold integers only, got {short(n)}", "nonces")
        if not -MAX_NONCE - 1 <= n <= MAX_NONCE:
            raise InputError(f"nonces: {n} is outside the int64 range", "nonces")
    return v


def get_batch_size(obj: dict, cfg: ServerConfig, default=MISSING) -> int:
    return get_int(obj, "batch_size", default=default, lo=1, hi=cfg.max_batch_size)


def get_limits(obj: dict, cfg: ServerConfig) -> Limits:
    return Limits(max_nonces=get_int(obj, "max_nonces", default=None, lo=1, hi=MAX_NONCE),
                  max_duration=get_number(obj, "max_duration", default=cfg.default_max_duration, lo=0,
                                          lo_open=True, hi=cfg.max_duration_limit))


def get_header(obj: dict) -> tuple[str, int, str]:
    """(block_hash, block_height, public_key)"""
    return get_str(obj, "block_hash"), get_int(obj, "block_height", lo=0, hi=MAX_INT64), get_str(obj, "public_key")


def get_node(obj: dict, *, groups: bool = True, bounded: bool = True) -> tuple[int, int, int, int]:
    """(node_id, node_count, group_id, n_groups), with node_id < node_count and group_id < n_groups when `bounded`.

    /api/v1/pow/init/generate is not bounded: the reference takes any node_id >= 0 (an MLNode's node numbers may
    have gaps) and the lattice formula is defined for it."""
    node_count = get_int(obj, "node_count", lo=1, hi=MAX_INT64)
    node_id = get_int(obj, "node_id", lo=0, hi=node_count - 1 if bounded else MAX_INT64,
                      what=" (node_count - 1)" if bounded else "")
    n_groups = get_int(obj, "n_groups", default=1, lo=1, hi=MAX_INT64) if groups else 1
    group_id = get_int(obj, "group_id", default=0, lo=0, hi=n_groups - 1 if bounded else MAX_INT64,
                       what=" (n_groups - 1)" if bounded else "") if groups else 0
    return node_id, node_count, group_id, n_groups
