"""The outbound-URL policy: where a request may make this server send HTTP (callbacks, orchestrators, warmup).

Checked twice. When the request arrives (`UrlPolicy.check`: a 400 naming the field): http(s) with a host, no
`user:pw@`, no query string or fragment and no dot segments or encoded `?#/.` in the path (any of them would let
the caller choose the path we append, e.g. `{url}/generated` into another server's /api/v1/pow/stop), no
integer, hex or octal IPv4 forms, and a host that is not refused (below). When connecting (`UrlPolicy.session`):
every address the name resolves to is checked and the connection goes to a checked address (the resolver hands
aiohttp only addresses it checked, so a DNS answer that changes between the two checks gains nothing), every
request (a literal address included) is checked again, and a redirect is an error, never followed.

Refused: link-local (169.254/16, fe80::/10: cloud metadata lives there), the other metadata addresses and names,
unspecified, multicast, reserved and broadcast addresses, IPv4-mapped forms of those, and this server's own
listening address. Private and loopback destinations are allowed (a node and its PoC server usually share a private
network) unless an allowlist (`POC_OUTBOUND_ALLOW`: host names and CIDR blocks) is configured, then only what it
names is reachable.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import urllib.parse
from typing import Awaitable, Callable, Iterable

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult

from poc.errors import InputError

METADATA_NAMES = {"metadata", "metadata.google.internal", "metadata.goog", "metadata.azure.com",
                  "instance-data", "instance-data.ec2.internal"}
METADATA_ADDRESSES = {ipaddress.ip_address(a) for a in ("100.100.100.200", "fd00:ec2::254", "192.0.0.192")}
LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
_NUMBER = re.compile(r"(0x[0-9a-f]*|[0-9]+)", re.I)
_BAD_PATH = re.compile(r"%(2f|3f|23|2e|5c)|\\|(^|/)\.\.?(/|$)", re.I)
REDIRECTS = (301, 302, 303, 307, 308)

Resolve = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP address strings


class UrlRefused(aiohttp.ClientConnectionError):
    """A destination the policy refuses, found while connecting (a ClientError, so callers treat it as any
    unreachable destination)."""


def _short(u: str) -> str:
    return repr(u) if len(u) <= 80 else f"{u[:60]!r}...({len(u)} characters)"


def _trim(host: str) -> str:
    return host.lower().rstrip(".")


class UrlPolicy:
    def __init__(self, allow: Iterable[str] = (), own: Iterable[tuple[str, int]] = (), resolve: Resolve | None = None):
        """`allow`: host names and CIDR blocks (empty: any destination not refused); `own`: (host, port) this server
        listens on; `resolve`: the name lookup (default: the system resolver on a thread; tests inject one)."""
        self.allow_names: set[str] = set()
        self.allow_nets: list = []
        for a in allow:
            a = a.strip()
            if not a:
                continue
            try:
                self.allow_nets.append(ipaddress.ip_network(a, strict=False))
            except ValueError:
                self.allow_names.add(_trim(a))
        self.own = [(_trim(h), p) for h, p in own]
        self._resolve = resolve or _system_resolve

    # ---------------------------------------------------------------------------- request time

    def check(self, url: str, field: str) -> str:
        """`url` if the policy allows it, else InputError(400) naming `field` and why (the value cut short)."""
        why = self.why_refused(url)
        if why:
            raise InputError(f"{field} {why}: {_short(url)}", field)
        return url

    def why_refused(self, url: str) -> str | None:
        if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in url):
            return "must not contain spaces or control characters"
        try:
            p = urllib.parse.urlsplit(url)
            port = p.port
        except ValueError:
            return "must be an http(s) URL with a valid port"
        if p.scheme not in ("http", "https") or not url.startswith(("http://", "https://")) or not p.hostname:
            return "must be an http(s) URL with a host"
        if "@" in p.netloc:
            return "must not carry credentials (user:pw@)"
        if "?" in url or "#" in url:
            return "must not have a query string or fragment (the path we append would be swallowed)"
        if _BAD_PATH.search(p.path):
            return "must not have dot segments or percent-encoded '/', '?', '#', '.' or '\\' in its path"
        return self.why_destination(p.hostname, port or (443 if p.scheme == "https" else 80))

    def why_destination(self, host: str, port: int) -> str | None:
        """Why a host (a name or a literal address) and port are refused, before any lookup (None: allowed)."""
        host = _trim(host)
        if "%" in host:
            return "must not name an IPv6 zone"
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
            if _NUMBER.fullmatch(host.rsplit(".", 1)[-1]):  # WHATWG parses these as IPv4: 2852039166, 0xa9fea9fe
                return "must write an IPv4 address as four decimal numbers"
        if ip is not None:
            return self.why_address(ip, port)
        if host in METADATA_NAMES or host.endswith(".internal") and host.startswith("metadata"):
            return "must not name a cloud metadata service"
        if self.allow_names and not self.allow_nets and host not in self.allow_names:
            return "is not on the outbound allowlist (POC_OUTBOUND_ALLOW)"
        if self._is_own(host, None, port):
            return "must not point at this server itself"
        return None

    def why_address(self, ip, port: int, host: str | None = None) -> str | None:
        """Why a destination address is refused (None: allowed). `host` is the name it was resolved from."""
        if getattr(ip, "ipv4_mapped", None) is not None:
            ip = ip.ipv4_mapped
        if ip in METADATA_ADDRESSES or ip.is_link_local:
            return "must not be a link-local or cloud metadata address"
        reserved = ip.version == 4 and ip.is_reserved  # 240/4 and broadcast (IPv6's "reserved" ::/8 holds ::1)
        if ip.is_unspecified or ip.is_multicast or reserved:
            return "must not be an unspecified, multicast, reserved or broadcast address"
        if self.allow_names or self.allow_nets:
            named = host is not None and host in self.allow_names
            if not named and not any(ip in n for n in self.allow_nets if n.version == ip.version):
                return "is not on the outbound allowlist (POC_OUTBOUND_ALLOW)"
        if self._is_own(str(ip), ip, port):
            return "must not point at this server itself"
        return None

    def _is_own(self, host: str, ip, port: int) -> bool:
        for h, p in self.own:
            if p != port:
                continue
            if host == h or host in LOOPBACK_NAMES or (ip is not None and ip.is_loopback):
                return True
            try:
                own_ip = ipaddress.ip_address(h)
            except ValueError:
                continue
            if own_ip.is_unspecified and ip is not None and (ip.is_private or ip.is_loopback):
                return True  # bound to every interface: any local-looking address on our port may be us
        return False

    # ---------------------------------------------------------------------------- connect time

    def session(self, timeout: float) -> aiohttp.ClientSession:
        """A ClientSession whose every connection obeys the policy (call it inside a running loop)."""
        connector = aiohttp.TCPConnector(resolver=_PolicyResolver(self), use_dns_cache=False)
        return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), connector=connector,
                                     middlewares=(self._middleware,), json_serialize=_strict_json)

    async def _middleware(self, req: aiohttp.ClientRequest, handler) -> aiohttp.ClientResponse:
        why = self.why_destination(req.url.raw_host or "", req.url.port or 0)
        if why:
            raise UrlRefused(f"destination refused by the outbound-URL policy: {why}")
        resp = await handler(req)
        if resp.status in REDIRECTS:  # never followed: the answer is an error, whatever it points to
            resp.release()
            raise UrlRefused(f"HTTP {resp.status} redirect not followed")
        return resp

    async def resolve_checked(self, host: str, port: int) -> list[str]:
        """The addresses of `host`, all checked; UrlRefused if any is refused."""
        addrs = await self._resolve(host, port)
        if not addrs:
            raise UrlRefused(f"{host} did not resolve")
        for a in addrs:
            why = self.why_address(ipaddress.ip_address(a.split("%", 1)[0]), port, _trim(host))
            if why:
                raise UrlRefused(f"{host} resolves to a refused address ({why})")
        return addrs


def _strict_json(obj) -> str:
    """Callback bodies never carry a bare NaN/Infinity (strict parsers reject them): non-finite floats become null."""
    import json
    import math

    def finite(o):
        if isinstance(o, float):
            return o if math.isfinite(o) else None
        if isinstance(o, dict):
            return {k: finite(v) for k, v in o.items()}
        if isinstance(o, (list, tuple)):
            return [finite(v) for v in o]
        return o

    try:
        return json.dumps(obj, allow_nan=False)
    except ValueError:
        return json.dumps(finite(obj))


async def _system_resolve(host: str, port: int) -> list[str]:
    import asyncio

    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(i[4][0] for i in infos))


class _PolicyResolver(AbstractResolver):
    """aiohttp connects to what this returns: only addresses the policy checked."""

    def __init__(self, policy: UrlPolicy):
        self.policy = policy

    async def resolve(self, host: str, port: int = 0, family: int = socket.AF_INET) -> list[ResolveResult]:
        out = []
        for a in await self.policy.resolve_checked(host, port):
            ip = ipaddress.ip_address(a.split("%", 1)[0])
            fam = socket.AF_INET6 if ip.version == 6 else socket.AF_INET
            if family not in (socket.AF_UNSPEC, fam):
                continue
            out.append(ResolveResult(hostname=host, host=str(ip), port=port, family=fam, proto=0,
                                     flags=socket.AI_NUMERICHOST))
        if not out:
            raise UrlRefused(f"{host} has no address of the family asked for")
        return out

    async def close(self) -> None:
        pass
