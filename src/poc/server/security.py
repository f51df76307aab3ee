"""Who may call us, and how long a client may hold a connection: the guard middleware and its settings.

In order, for every request:
1. A cap on requests in flight (`max_connections`): past it, 503 with `Connection: close` at once. /health and
   /metrics are not counted, so they answer while the cap is reached.
2. Browsers: an `Origin` header that `allowed_origins` does not list, or `Sec-Fetch-Site: cross-site`, is a 403 (a web
   page on the host cannot drive the API: CSRF); with a loopback bind, a `Host` that is not a loopback name is a 403
   too (DNS rebinding).
3. The body is read here, under two deadlines: `body_idle_timeout` without a byte, `body_timeout` in all; past
   either, 408 and the connection is closed (a short Content-Length or an endless chunked body cannot hold it).
   Header reading is bounded by the handler's keep-alive timer (`header_timeout`, see `handler_args`).
4. Authentication, when configured (/health and /metrics stay open): `Authorization: Bearer $POC_API_TOKEN`, or the
   Gonka node's signature: `X-Signature`, base64 of a secp256k1 ECDSA signature (64 bytes r||s, or DER) over the
   SHA-256 of the body, checked against `SIGNER_PUBKEY` (base64 of a compressed, uncompressed or raw public key),
   as the MLNode's pow service does. Anything else is a 401.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass, field

from aiohttp import web

from poc.clients.urlpolicy import UrlPolicy  # noqa: F401 (the type of Security.policy)
from poc.errors import InputError
from poc.server.stream import stall_key

log = logging.getLogger("poc.server")

OPEN_PATHS = ("/health", "/metrics")  # no auth, no cap: a supervisor must always be able to ask
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
LOOPBACK_HOSTS = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}


class SignatureKey:
    """A secp256k1 public key that checks the node's request signatures (`cryptography`'s ECDSA)."""

    def __init__(self, pubkey_b64: str):
        from cryptography.hazmat.primitives.asymmetric import ec

        try:
            raw = base64.b64decode(pubkey_b64, validate=True)
            if len(raw) == 64:  # bare X||Y
                raw = b"\x04" + raw
            self.key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256K1(), raw)
        except ValueError as e:
            raise InputError(f"SIGNER_PUBKEY is not a base64 secp256k1 public key ({e})", "signer_pubkey") from None

    def verify(self, body: bytes, signature_b64: str) -> bool:
        """True when the signature covers SHA-256(body). The node's key (Cosmos secp256k1) signs SHA-256 of the
        message; the MLNode's reference verifier hashes the body's SHA-256 once more, so that digest passes too."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, encode_dss_signature

        try:
            sig = base64.b64decode(signature_b64, validate=True)
        except ValueError:
            return False
        if len(sig) == 64:
            sig = encode_dss_signature(int.from_bytes(sig[:32], "big"), int.from_bytes(sig[32:], "big"))
        digest = hashlib.sha256(body).digest()
        for d in (digest, hashlib.sha256(digest).digest()):
            try:
                self.key.verify(sig, d, ec.ECDSA(Prehashed(hashes.SHA256())))
                return True
            except (InvalidSignature, ValueError):
                continue
        return False


@dataclass
class Security:
    policy: UrlPolicy
    api_token: str | None = None
    signer: SignatureKey | None = None
    allowed_origins: frozenset[str] = frozenset()
    loopback_only: bool = False  # bound to a loopback address: Host must name the loopback
    max_connections: int = 256
    max_body: int = 16 << 20
    body_idle_timeout: float = 10.0
    body_timeout: float = 60.0
    in_flight: int = 0
    refused: dict = field(default_factory=dict)  # why -> count (logged, and for tests)

    @property
    def auth(self) -> bool:
        return bool(self.api_token or self.signer)


security_key = web.AppKey("security", Security)


def _is_loopback(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def setup(app: web.Application, config) -> Security:
    """The guard for `config` (ServerConfig); InputError for an unusable SIGNER_PUBKEY."""
    from poc.server.schemas import url_policy_of

    sec = Security(policy=url_policy_of(config), api_token=config.api_token or None,
                   signer=SignatureKey(config.signer_pubkey) if config.signer_pubkey else None,
                   allowed_origins=frozenset(o.rstrip("/").lower() for o in config.allowed_origins),
                   loopback_only=_is_loopback(config.host), max_connections=config.max_connections,
                   max_body=config.max_body_bytes, body_idle_timeout=config.body_idle_timeout,
                   body_timeout=config.body_timeout)
    app[security_key] = sec
    warning = bind_warning(config)
    if warning:
        log.warning(warning)
    app[stall_key] = config.stall_timeout
    app.middlewares.append(guard)
    return sec


def handler_args(config) -> dict:
    """RequestHandler settings: a connection that has not sent a whole request head within `header_timeout` (from
    connecting, or from its last response) is closed; an unread body is not lingered over (the connection closes)."""
    return {"keepalive_timeout": config.header_timeout, "lingering_time": 0}


def bind_warning(config) -> str | None:
    """The start-up warning for a non-loopback bind without any authentication, else None."""
    if _is_loopback(config.host) or config.api_token or config.signer_pubkey:
        return None
    return (f"listening on {config.host} without authentication: anyone who can reach it can start and stop jobs "
            f"and make it call URLs; set POC_API_TOKEN or SIGNER_PUBKEY, or bind to 127.0.0.1")


def url_policy(app: web.Application) -> UrlPolicy:
    return app[security_key].policy


# --------------------------------------------------------------------------------------------------


def _refuse(sec: Security, status: int, why: str, field_: str | None = None) -> InputError:
    sec.refused[why] = sec.refused.get(why, 0) + 1
    return InputError(why, field_, status=status)


@web.middleware
async def guard(request: web.Request, handler):
    sec = request.app[security_key]
    open_path = request.path in OPEN_PATHS
    if open_path:
        return await _checked(request, handler, sec, open_path)
    if sec.in_flight >= sec.max_connections:
        sec.refused["cap"] = sec.refused.get("cap", 0) + 1
        resp = web.json_response({"error": f"too many connections (the cap is {sec.max_connections}): retry later",
                                  "field": None}, status=503, headers={"Retry-After": "1"})
        resp.force_close()
        return resp
    sec.in_flight += 1
    try:
        return await _checked(request, handler, sec, open_path)
    finally:
        sec.in_flight -= 1


async def _checked(request: web.Request, handler, sec: Security, open_path: bool):
    origin = request.headers.get("Origin")
    if origin is not None and origin.rstrip("/").lower() not in sec.allowed_origins:
        raise _refuse(sec, 403, f"cross-site request refused (Origin {origin[:100]!r} is not allowed)", "Origin")
    if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        raise _refuse(sec, 403, "cross-site request refused (Sec-Fetch-Site: cross-site)", "Origin")
    if sec.loopback_only and not _is_loopback(request.url.host or ""):
        raise _refuse(sec, 403, "this server answers loopback host names only (Host header)", "Host")
    body = b""
    if request.method in BODY_METHODS and request.body_exists:
        body = await read_body(request, sec)
    if sec.auth and not open_path and not _authorized(request, body, sec):
        err = _refuse(sec, 401, "unauthorized: send Authorization: Bearer <POC_API_TOKEN> or the node's X-Signature")
        raise err
    return await handler(request)


def _authorized(request: web.Request, body: bytes, sec: Security) -> bool:
    auth = request.headers.get("Authorization", "")
    if sec.api_token and auth.startswith("Bearer "):
        if hmac.compare_digest(auth[7:].strip().encode(), sec.api_token.encode()):
            return True
    sig = request.headers.get("X-Signature")
    return bool(sec.signer and sig and sec.signer.verify(body, sig))


async def read_body(request: web.Request, sec: Security) -> bytes:
    """The whole body (aiohttp keeps it: the handler's request.read() gets it back), within the deadlines; 408."""
    if request.content_length is not None and request.content_length > sec.max_body:
        raise _refuse(sec, 413, f"request body of {request.content_length} bytes is over the {sec.max_body}-byte limit")
    read = asyncio.ensure_future(request.read())
    loop = asyncio.get_running_loop()
    end = loop.time() + sec.body_timeout
    seen = request.content.total_bytes
    try:
        while True:
            left = end - loop.time()
            done, _ = await asyncio.wait({read}, timeout=max(0.0, min(sec.body_idle_timeout, left)))
            if done:
                try:
                    return read.result()
                except web.HTTPRequestEntityTooLarge:
                    raise _refuse(sec, 413, f"request body is over the {sec.max_body}-byte limit") from None
            n = request.content.total_bytes
            if loop.time() >= end:
                raise _refuse(sec, 408, f"request body not received within {sec.body_timeout:g} s")
            if n == seen:
                raise _refuse(sec, 408, f"request body stalled: no data for {sec.body_idle_timeout:g} s")
            seen = n
    finally:
        if not read.done():
            read.cancel()
            await asyncio.gather(read, return_exceptions=True)
