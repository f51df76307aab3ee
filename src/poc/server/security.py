"""Who may call us, and how long a client may hold a connection: the guard middleware and its settings.

Everything the request head decides is decided before a byte of the body is read, in this order:
1. A cap on requests in flight (`max_connections`): past it, 503 with `Connection: close` at once. /health and
   /metrics are not counted, so they answer while the cap is reached. They take no body: one announced over
   `OPEN_BODY_BYTES` (or chunked) is a 413 at once, a smaller one is never read, so they always answer at once.
2. Browsers: an `Origin` header that `allowed_origins` does not list, or `Sec-Fetch-Site: cross-site`, is a 403 (a web
   page on the host cannot drive the API: CSRF); with a loopback bind, a `Host` that is not a loopback name is a 403
   too (DNS rebinding).
3. The client's address (`allowed_clients`, POC_ALLOWED_CLIENTS): when set, a source address it does not cover is a
   403 on every route but /health and /metrics.
4. Authentication, when configured (/health and /metrics stay open): `Authorization: Bearer $POC_API_TOKEN` is
   checked here; otherwise an `X-Signature` must be present and of the form the Gonka node's signer produces
   (base64 of 64 bytes r||s with a low s: cosmos-sdk's secp256k1 `Sign`); anything else is a 401.
5. The route: 404 / 405 for none; a Content-Length over the route's own limit (`route_limit`) is a 413.
Then the body is read, up to that limit, under two deadlines: `body_idle_timeout` without a byte, `body_timeout` in
all; past either, 408 and the connection is closed (a short Content-Length or an endless chunked body cannot hold
it). Only now is an `X-Signature` checked: ECDSA over the SHA-256 of the body against `SIGNER_PUBKEY` (base64 of a
compressed, uncompressed or raw public key); a bad one is a 401. The signature covers the body alone (not the
method, route, time or any nonce), so it cannot stop a replay: README "Hostile clients and networks".
Header reading is bounded by the handler's keep-alive timer (`header_timeout`, see `handler_args`). A body refused or
abandoned is never buffered past the socket's own buffers; one read is accumulated in one growing block (large
blocks are mmap'd, so freeing it returns the memory to the system).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import ipaddress
import logging
import socket
from dataclasses import dataclass, field

from aiohttp import web

from poc.clients.urlpolicy import UrlPolicy  # noqa: F401 (the type of Security.policy)
from poc.errors import InputError

log = logging.getLogger("poc.server")

OPEN_PATHS = ("/health", "/metrics")  # no auth, no cap, no body: a supervisor must always be able to ask
OPEN_BODY_BYTES = 4 << 10  # what /health and /metrics tolerate being announced (the PyWorker posts {} to /health)
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")
# the routes whose bodies carry nonce lists (explicit nonces, ProofBatches, validation artifacts): they may take
# max_body_bytes; every other route takes at most max_small_body_bytes
BULK_PATHS = frozenset({"/validate", "/api/v1/pow/validate", "/api/v1/pow/generate", "/api/v1/inference/pow/generate"})
LOOPBACK_HOSTS = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
TRIM_AFTER_BYTES = 1 << 20  # a body this large read (or abandoned): the heap is trimmed a second later
SECP256K1_N = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141  # the group order


def signature_form(signature_b64: str) -> tuple[int, int] | None:
    """(r, s) when the header is what the node's signer produces: base64 of 64 bytes r||s, 0 < r < n, 0 < s <= n/2
    (cosmos-sdk's secp256k1 `Sign` gives the low s, and its own verifier refuses the high-s twin); else None."""
    try:
        raw = base64.b64decode(signature_b64, validate=True)
    except ValueError:
        return None
    if len(raw) != 64:
        return None
    r, s = int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big")
    if not (0 < r < SECP256K1_N and 0 < s <= SECP256K1_N // 2):
        return None
    return r, s


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
        """True when the signature, in the node's form (signature_form), covers SHA-256(body). The node's key (Cosmos
        secp256k1) signs SHA-256 of the message; the MLNode's reference verifier hashes the body's SHA-256 once more,
        so that digest passes too."""
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.hazmat.primitives.asymmetric.utils import Prehashed, encode_dss_signature

        rs = signature_form(signature_b64)
        if rs is None:
            return False
        sig = encode_dss_signature(*rs)
        digest = hashlib.sha256(body).digest()
        for d in (digest, hashlib.sha256(digest).digest()):
            try:
                self.key.verify(sig, d, ec.ECDSA(Prehashed(hashes.SHA256())))
                return True
            except (InvalidSignature, ValueError):
                continue
        return False


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass
class Security:
    policy: UrlPolicy
    api_token: str | None = None
    signer: SignatureKey | None = None
    allowed_origins: frozenset[str] = frozenset()
    allowed_clients: tuple[Network, ...] = ()  # empty: any source address
    loopback_only: bool = False  # bound to a loopback address: Host must name the loopback
    max_connections: int = 256
    max_body: int = 16 << 20  # BULK_PATHS
    max_small_body: int = 64 << 10  # every other route
    body_idle_timeout: float = 10.0
    body_timeout: float = 60.0
    in_flight: int = 0
    refused: dict = field(default_factory=dict)  # status -> requests refused here (each is also logged)
    trim_pending: bool = False

    @property
    def auth(self) -> bool:
        return bool(self.api_token or self.signer)

    def route_limit(self, path: str) -> int:
        """The most body bytes this route takes."""
        if path in OPEN_PATHS:
            return OPEN_BODY_BYTES
        return self.max_body if path in BULK_PATHS else self.max_small_body

    def client_allowed(self, remote: str | None) -> bool:
        if not self.allowed_clients:
            return True
        if not remote:
            return False
        try:
            ip = ipaddress.ip_address(remote.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:  # a dual-stack socket's IPv4 peer
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.allowed_clients)


security_key = web.AppKey("security", Security)


def _is_loopback(host: str) -> bool:
    host = host.lower().rstrip(".")
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def client_networks(entries, resolve=socket.getaddrinfo) -> tuple[Network, ...]:
    """POC_ALLOWED_CLIENTS: CIDR blocks, addresses and host names (each name resolved now, every address it has);
    InputError naming the entry that is none of these."""
    nets: list[Network] = []
    for e in entries:
        e = e.strip()
        if not e:
            continue
        try:
            nets.append(ipaddress.ip_network(e.strip("[]"), strict=False))
            continue
        except ValueError:
            pass
        try:
            infos = resolve(e, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError) as err:
            raise InputError(f"POC_ALLOWED_CLIENTS: {e!r} is not a CIDR block or address, and does not resolve "
                             f"({err})", "allowed_clients") from None
        for info in infos:
            addr = info[4][0].split("%", 1)[0]
            nets.append(ipaddress.ip_network(addr))
    return tuple(dict.fromkeys(nets))


def setup(app: web.Application, config) -> Security:
    """The guard for `config` (ServerConfig); InputError for an unusable SIGNER_PUBKEY or POC_ALLOWED_CLIENTS."""
    from poc.server.fields import url_policy_of

    sec = Security(policy=url_policy_of(config), api_token=config.api_token or None,
                   signer=SignatureKey(config.signer_pubkey) if config.signer_pubkey else None,
                   allowed_origins=frozenset(o.rstrip("/").lower() for o in config.allowed_origins),
                   allowed_clients=client_networks(config.allowed_clients),
                   loopback_only=_is_loopback(config.host), max_connections=config.max_connections,
                   max_body=config.max_body_bytes, max_small_body=config.max_small_body_bytes,
                   body_idle_timeout=config.body_idle_timeout, body_timeout=config.body_timeout)
    if config.allowed_clients:
        log.info("only these clients may call (POC_ALLOWED_CLIENTS): %s",
                 ", ".join(str(n) for n in sec.allowed_clients))
    app[security_key] = sec
    warning = bind_warning(config)
    if warning:
        log.warning(warning)
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
    sec.refused[status] = sec.refused.get(status, 0) + 1
    return InputError(why, field_, status=status)


@web.middleware
async def guard(request: web.Request, handler):
    sec = request.app[security_key]
    if request.path in OPEN_PATHS:
        _browser_checks(request, sec)
        if request.body_exists and (request.content_length is None
                                    or request.content_length > OPEN_BODY_BYTES):
            raise _refuse(sec, 413, f"{request.path} takes no body (at most {OPEN_BODY_BYTES} bytes, never read)")
        return await handler(request)  # a small body is left unread: the answer does not wait for it
    if sec.in_flight >= sec.max_connections:
        sec.refused[503] = sec.refused.get(503, 0) + 1
        resp = web.json_response({"error": f"too many connections (the cap is {sec.max_connections}): retry later",
                                  "field": None}, status=503, headers={"Retry-After": "1"})
        resp.force_close()
        return resp
    sec.in_flight += 1
    try:
        return await _checked(request, handler, sec)
    finally:
        sec.in_flight -= 1


def _browser_checks(request: web.Request, sec: Security) -> None:
    origin = request.headers.get("Origin")
    if origin is not None and origin.rstrip("/").lower() not in sec.allowed_origins:
        raise _refuse(sec, 403, f"cross-site request refused (Origin {origin[:100]!r} is not allowed)", "Origin")
    if request.headers.get("Sec-Fetch-Site", "").lower() == "cross-site":
        raise _refuse(sec, 403, "cross-site request refused (Sec-Fetch-Site: cross-site)", "Origin")
    if sec.loopback_only and not _is_loopback(request.url.host or ""):
        raise _refuse(sec, 403, "this server answers loopback host names only (Host header)", "Host")


async def _checked(request: web.Request, handler, sec: Security):
    _browser_checks(request, sec)
    if not sec.client_allowed(request.remote):
        raise _refuse(sec, 403, f"client address {request.remote} is not allowed (POC_ALLOWED_CLIENTS)", "client")
    signature = None
    if sec.auth:
        signature = _head_auth(request, sec)  # None: the bearer token passed
    route_error = request.match_info.http_exception
    if route_error is not None:  # no such route or method: answered before any body
        raise route_error
    body_expected = request.method in BODY_METHODS and request.body_exists
    body = b""
    if body_expected:
        body = await read_body(request, sec, sec.route_limit(request.path))
    if signature is not None and not sec.signer.verify(body, signature):
        raise _refuse(sec, 401, "unauthorized: X-Signature does not match the body")
    return await handler(request)


def _head_auth(request: web.Request, sec: Security) -> str | None:
    """What the head says about the caller: None when its bearer token is right; the X-Signature to check against the
    body when it carries one in the node's form; else a 401 (the body is never read)."""
    auth = request.headers.get("Authorization", "")
    if sec.api_token and auth.startswith("Bearer "):
        # aiohttp keeps undecodable header bytes as lone surrogates: encode them back, never raise on them
        given = auth[7:].strip().encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, sec.api_token.encode("utf-8", "surrogateescape")):
            return None
    sig = request.headers.get("X-Signature")
    if sec.signer and sig and signature_form(sig) is not None:
        return sig
    why = ("unauthorized: X-Signature must be base64 of 64 bytes r||s with a low s (as the node signs)" if sig and
           sec.signer else "unauthorized: send Authorization: Bearer <POC_API_TOKEN> or the node's X-Signature")
    raise _refuse(sec, 401, why)


async def read_body(request: web.Request, sec: Security, limit: int) -> bytes:
    """The whole body, at most `limit` bytes, within the deadlines (413, 408). It is kept where aiohttp keeps a read
    body (`request._read_bytes`), so the handler's request.read() gets it back without reading the socket again.
    Chunks are copied into one growing block as they arrive: the stream never buffers more than its usual high-water
    mark (aiohttp's own request.read() raises that to the whole limit)."""
    if request.content_length is not None and request.content_length > limit:
        raise _refuse(sec, 413, f"request body of {request.content_length} bytes is over the {limit}-byte limit of "
                                f"{request.path}")
    loop = asyncio.get_running_loop()
    end = loop.time() + sec.body_timeout
    body = bytearray()
    stream = request.content
    try:
        while True:
            left = end - loop.time()
            if left <= 0:
                raise _refuse(sec, 408, f"request body not received within {sec.body_timeout:g} s")
            try:
                async with asyncio.timeout(min(sec.body_idle_timeout, left)):
                    chunk = await stream.readany()
            except TimeoutError:
                if loop.time() >= end:
                    raise _refuse(sec, 408, f"request body not received within {sec.body_timeout:g} s") from None
                raise _refuse(sec, 408, f"request body stalled: no data for {sec.body_idle_timeout:g} s") from None
            except ConnectionResetError:  # the client went away mid-body: nobody reads the answer, but log no trace
                raise _refuse(sec, 400, "request body aborted: the client closed the connection") from None
            if not chunk:
                break
            if len(body) + len(chunk) > limit:
                raise _refuse(sec, 413, f"request body is over the {limit}-byte limit of {request.path}")
            body += chunk
        data = bytes(body)
    finally:
        # freed now, not whenever the garbage collector breaks the cycle an error leaves: the stream keeps its
        # exception, whose traceback holds this frame, which holds the stream (measured: 48 aborted bodies stayed
        # resident, +420 MB, until a full collection)
        if len(body) >= TRIM_AFTER_BYTES:
            _trim_soon(sec)
        body.clear()
    request._read_bytes = data  # aiohttp's cache of a read body (BaseRequest.read returns it)
    return data


def _trim_soon(sec: Security) -> None:
    """One heap trim a second after large bodies (memory.trim_heap), however many arrive meanwhile."""
    if sec.trim_pending:
        return
    sec.trim_pending = True

    def trim() -> None:
        from poc.engine import memory

        sec.trim_pending = False
        memory.trim_heap()

    asyncio.get_running_loop().call_later(1.0, trim)
