"""Slow, stalled and unwelcome clients (server/security.py, the stream's backpressure): body and header deadlines
answered 408 or closed within the configured bounds while /health stays ready, descriptors back to baseline, a cap on
requests in flight, a /generate reader that stops reading, authentication (bearer token and the node's secp256k1
signature), cross-site browsers. Every socket is on the loopback; bounds are configured short and asserted loosely."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import time

import pytest

from poc.server.app import create_app
from poc.server.security import SECP256K1_N, bind_warning

from .servers import POST, metric, raw, server_config, v1_request, wait_status


IDLE, TOTAL, HEADER = 0.5, 1.5, 1.0


def fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def read_all(r: asyncio.StreamReader, timeout: float) -> bytes:
    return await asyncio.wait_for(r.read(), timeout)


@pytest.fixture
async def client(aiohttp_client):
    cfg = server_config(body_idle_timeout=IDLE, body_timeout=TOTAL, header_timeout=HEADER, max_connections=3)
    c = await aiohttp_client(create_app(cfg))
    await wait_status(c)
    return c


async def test_stalled_bodies_get_408_within_the_bound_and_health_stays_ready(client):
    base = fds()
    t0 = time.monotonic()
    short = await raw(client, POST + b"Content-Length: 100\r\n\r\n{\"block_hash\"")  # 87 bytes never come
    silent = await raw(client, POST + b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n")  # then nothing
    drip = await raw(client, POST + b"Transfer-Encoding: chunked\r\n\r\n")  # a byte every 0.2 s, never ending

    async def dripping():
        w = drip[1]
        try:
            while True:
                w.write(b"1\r\n \r\n")
                await w.drain()
                await asyncio.sleep(0.2)
        except (ConnectionError, RuntimeError):
            return

    feeder = asyncio.create_task(dripping())
    h = await client.get("/health")  # answered meanwhile
    assert h.status == 200 and (await h.json())["state"] == "ready"
    answers = [await read_all(r, 10) for r, _ in (short, silent, drip)]
    elapsed = time.monotonic() - t0
    feeder.cancel()
    await asyncio.gather(feeder, return_exceptions=True)
    for a in answers:
        assert a.startswith(b"HTTP/1.1 408"), a[:200]
    assert b"stalled" in answers[0] and b"stalled" in answers[1] and b"within 1.5 s" in answers[2]
    assert elapsed < TOTAL + 2 * IDLE + 3  # the deadlines, plus generous slack for a loaded machine
    for _, w in (short, silent, drip):
        w.close()
    await asyncio.sleep(0.2)
    assert fds() <= base  # every connection is closed on both sides
    assert metric(await (await client.get("/metrics")).text(), 'poc_errors_total{kind="body_timeout"}') == 3


async def test_slow_headers_are_cut_after_the_header_timeout(client):
    base = fds()
    t0 = time.monotonic()
    r, w = await raw(client, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow:")
    assert await read_all(r, 10) == b""  # closed without an answer
    assert time.monotonic() - t0 < HEADER + 3
    w.close()
    await asyncio.sleep(0.2)
    assert fds() <= base


async def test_requests_in_flight_past_the_cap_get_503_and_health_still_answers(client):
    held = [await raw(client, POST + b"Content-Length: 10\r\n\r\n{") for _ in range(3)]  # three in flight
    await asyncio.sleep(0.1)
    r = await client.post("/generate", json=v1_request())
    assert r.status == 503 and "too many connections" in (await r.json())["error"]
    assert r.headers.get("Connection", "").lower() == "close"
    assert (await client.get("/health")).status == 200
    for _, w in held:
        w.close()
    await asyncio.sleep(0.3)
    r = await client.post("/generate", json=v1_request(max_nonces=4, batch_size=4))
    assert r.status == 200
    await r.read()


# --------------------------------------------------------------------------------------------------
# a /generate reader that stops reading


def dechunk(data: bytes) -> bytes:
    head, _, body = data.partition(b"\r\n\r\n")
    out = bytearray()
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            break
        out += rest[:n]
        body = rest[n + 2:]
    return bytes(out)


async def test_a_stalled_reader_pauses_the_device_and_the_job_ends_stalled(aiohttp_client):
    waiting, batch = 2, 64
    cfg = server_config(stream_max_waiting=waiting, stall_timeout=1.0, progress_interval=1000.0)
    client = await aiohttp_client(create_app(cfg))
    await wait_status(client)
    body = json.dumps(v1_request(batch_size=batch, max_nonces=5_000_000, max_duration=600, r_target=10.0)).encode()
    head = POST + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
    r, w = await raw(client, head, buffers=4096)  # and then read nothing
    t0 = time.monotonic()
    while True:  # the job ends by itself: reason stalled
        m = await (await client.get("/metrics")).text()
        if metric(m, 'poc_jobs_total{protocol="v1",reason="stalled"}') == 1:
            break
        assert time.monotonic() - t0 < 120, "the job never ended stalled"
        await asyncio.sleep(0.2)
    computed = metric(m, 'poc_nonces_computed_total{protocol="v1"}')
    await asyncio.sleep(1.0)
    m = await (await client.get("/metrics")).text()
    assert metric(m, 'poc_nonces_computed_total{protocol="v1"}') == computed  # the device stopped
    assert (await (await client.get("/health")).json())["state"] == "ready"
    data = dechunk(await read_all(r, 30))  # now read what was written, to the end
    w.close()
    lines = [json.loads(x) for x in data.splitlines()]
    done = lines[-1]
    assert done["status"] == "done" and done["reason"] == "stalled"
    got = [n for d in lines if "nonces" in d for n in d["nonces"]]
    assert got == list(range(done["next_nonce"]))  # every nonce before next_nonce was written, none after it
    assert done["computed"] == len(got)
    # what the device computed beyond what was written is bounded by the waiting batches (+ one per stage in flight)
    assert 0 <= computed - len(got) <= (waiting + 3) * batch, (computed, len(got))
    # resuming from next_nonce starts at the first nonce not written
    r2 = await client.post("/generate", json=v1_request(start_nonce=done["next_nonce"], max_nonces=batch,
                                                         batch_size=batch, r_target=10.0))
    first = json.loads((await r2.read()).splitlines()[0])
    assert first["nonces"][0] == done["next_nonce"]


# --------------------------------------------------------------------------------------------------
# who may call


def node_key():
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256K1())
    pub = key.public_key().public_bytes(serialization.Encoding.X962, serialization.PublicFormat.CompressedPoint)
    return key, base64.b64encode(pub).decode()


def node_sign(key, body: bytes) -> str:
    """As the node signs (a Cosmos secp256k1 key: ECDSA over SHA-256 of the message, 64 bytes r||s, low S)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature

    r, s = decode_dss_signature(key.sign(body, ec.ECDSA(hashes.SHA256())))
    n = 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFEBAAEDCE6AF48A03BBFD25E8CD0364141
    s = min(s, n - s)
    return base64.b64encode(r.to_bytes(32, "big") + s.to_bytes(32, "big")).decode()


async def test_signer_pubkey_admits_the_node_signature_only(aiohttp_client):
    key, pub = node_key()
    other, _ = node_key()
    c = await aiohttp_client(create_app(server_config(signer_pubkey=pub)))
    await wait_status(c)  # /health is open
    assert (await c.get("/metrics")).status == 200
    body = json.dumps(v1_request(max_nonces=4, batch_size=4)).encode()
    hdr = {"Content-Type": "application/json"}
    for sig in (None, node_sign(other, body), node_sign(key, body + b" "), "not base64!"):
        r = await c.post("/generate", data=body, headers={**hdr, **({"X-Signature": sig} if sig else {})})
        assert r.status == 401, sig
    assert (await c.get("/api/v1/pow/status")).status == 401
    r = await c.post("/generate", data=body, headers={**hdr, "X-Signature": node_sign(key, body)})
    assert r.status == 200
    assert json.loads((await r.read()).splitlines()[-1])["status"] == "done"
    r = await c.get("/api/v1/pow/status", headers={"X-Signature": node_sign(key, b"")})  # an empty body signed
    assert r.status == 200


async def test_api_token_admits_the_bearer_only(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(api_token="s3cret-token")))
    await wait_status(c)
    for h in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic s3cret-token"}):
        assert (await c.post("/generate", json=v1_request(), headers=h)).status == 401
    r = await c.post("/generate", json=v1_request(max_nonces=4, batch_size=4),
                     headers={"Authorization": "Bearer s3cret-token"})
    assert r.status == 200
    await r.read()


async def test_cross_site_browser_requests_are_403(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(allowed_origins=("https://ops.example",))))
    await wait_status(c)
    r = await c.post("/api/v1/pow/stop", data="{}", headers={"Origin": "https://evil.example",
                                                             "Content-Type": "text/plain"})
    assert r.status == 403 and (await r.json())["field"] == "Origin"
    r = await c.post("/api/v1/pow/stop", headers={"Sec-Fetch-Site": "cross-site"})
    assert r.status == 403
    r = await c.get("/health", headers={"Host": "rebound.evil.example"})  # DNS rebinding onto a loopback bind
    assert r.status == 403
    assert (await c.post("/api/v1/pow/stop", headers={"Origin": "https://ops.example"})).status == 200
    assert (await c.post("/api/v1/pow/stop")).status == 200  # no Origin: not a browser


def test_a_public_bind_without_auth_is_warned_about_at_start_and_a_bad_key_refused(caplog):
    from poc.errors import InputError

    create_app(server_config(host="0.0.0.0"))
    assert [r for r in caplog.records if r.levelname == "WARNING" and "without authentication" in r.getMessage()]
    with pytest.raises(InputError, match="SIGNER_PUBKEY"):
        create_app(server_config(signer_pubkey="bm90IGEga2V5"))
    assert bind_warning(server_config(host="0.0.0.0")) and "POC_API_TOKEN" in bind_warning(server_config(host="::"))
    assert bind_warning(server_config(host="127.0.0.1")) is None
    assert bind_warning(server_config(host="0.0.0.0", api_token="t")) is None
    assert bind_warning(server_config(host="0.0.0.0", signer_pubkey=node_key()[1])) is None


def test_the_signature_check_is_over_sha256_of_the_body():
    from poc.server.security import SignatureKey

    key, pub = node_key()
    body = b'{"model": "test", "action": "init"}'
    k = SignatureKey(pub)
    assert k.verify(body, node_sign(key, body)) and not k.verify(body[:-1], node_sign(key, body))
    # the MLNode's reference verifier's reading (SHA-256 hashed once more) passes too
    assert k.verify(body, node_sign(key, hashlib.sha256(body).digest()))


def high_s_twin(sig_b64: str) -> str:
    """The same signature with s replaced by n - s: valid ECDSA too, a form the node's signer never produces."""
    raw = base64.b64decode(sig_b64)
    r, s = raw[:32], int.from_bytes(raw[32:], "big")
    return base64.b64encode(r + (SECP256K1_N - s).to_bytes(32, "big")).decode()


def der_form(sig_b64: str) -> str:
    from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

    raw = base64.b64decode(sig_b64)
    return base64.b64encode(encode_dss_signature(int.from_bytes(raw[:32], "big"),
                                                 int.from_bytes(raw[32:], "big"))).decode()


def test_only_the_form_the_node_signs_in_passes():
    """cosmos-sdk's secp256k1 Sign gives 64 bytes r||s with a low s; the high-s twin and a DER encoding of the same
    signature verify as ECDSA but are refused."""
    from poc.server.security import SignatureKey, signature_form

    key, pub = node_key()
    body = b'{"action": "stop"}'
    sig = node_sign(key, body)
    k = SignatureKey(pub)
    assert k.verify(body, sig) and signature_form(sig) is not None
    for other in (high_s_twin(sig), der_form(sig), base64.b64encode(bytes(64)).decode(), sig[:-4], sig + "AAAA"):
        assert signature_form(other) is None and not k.verify(body, other), other


# --------------------------------------------------------------------------------------------------
# decided from the head: a body nobody authorised is never read


GEN = b"POST /api/v1/pow/generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
SIXTEEN_MIB = b"Content-Length: 16777216\r\n"


async def answer_to_head(client, head: bytes) -> bytes:
    """The whole answer to a request head sent alone (not one byte of its body follows), up to the server's close.
    The server waits 60 s for a body byte (body_idle_timeout): an answer within 30 s was decided from the head."""
    r, w = await raw(client, head + b"\r\n")
    try:
        return await read_all(r, 30)
    finally:
        w.close()


async def test_credentials_route_and_size_are_decided_before_the_body(aiohttp_client):
    key, pub = node_key()
    c = await aiohttp_client(create_app(server_config(api_token="s3cret-token", signer_pubkey=pub,
                                                      body_idle_timeout=60.0, body_timeout=120.0)))
    await wait_status(c)
    sig = node_sign(key, b"{}")
    for extra in (b"", b"Authorization: Bearer wrong\r\n", b"X-Signature: not base64!\r\n",
                  f"X-Signature: {high_s_twin(sig)}\r\n".encode(), f"X-Signature: {der_form(sig)}\r\n".encode()):
        a = await answer_to_head(c, GEN + SIXTEEN_MIB + extra)
        assert a.startswith(b"HTTP/1.1 401") and b"Connection: close" in a, (extra, a[:300])
    # authorised from the head: the route's own limit (256 KiB in the tests) is a 413, still without the body
    for extra in (b"Authorization: Bearer s3cret-token\r\n", f"X-Signature: {sig}\r\n".encode()):
        a = await answer_to_head(c, GEN + SIXTEEN_MIB + extra)
        assert a.startswith(b"HTTP/1.1 413") and b"262144-byte limit" in a, (extra, a[:300])
    a = await answer_to_head(c, GEN.replace(b"/api/v1/pow/generate", b"/no/such/route") + SIXTEEN_MIB +
                             b"Authorization: Bearer s3cret-token\r\n")
    assert a.startswith(b"HTTP/1.1 404"), a[:300]
    # a small route's limit is its own: 64 KiB, where /api/v1/pow/generate takes nonce lists
    a = await answer_to_head(c, POST + b"Content-Length: 70000\r\nAuthorization: Bearer s3cret-token\r\n")
    assert a.startswith(b"HTTP/1.1 413") and b"65536-byte limit of /generate" in a, a[:300]
    assert (await c.get("/health")).status == 200


async def test_health_and_metrics_take_no_body_and_answer_at_once(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(body_idle_timeout=60.0, body_timeout=120.0)))
    await wait_status(c)
    a = await answer_to_head(c, b"POST /health HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n")
    assert a.startswith(b"HTTP/1.1 200") and b'"state": "ready"' in a, a[:300]  # its 100 bytes never came
    for path in (b"/health", b"/metrics"):
        a = await answer_to_head(c, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n" + SIXTEEN_MIB)
        assert a.startswith(b"HTTP/1.1 413"), a[:300]
        a = await answer_to_head(c, b"POST " + path + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n")
        assert a.startswith(b"HTTP/1.1 413"), a[:300]
    r = await c.post("/health", json={})  # the PyWorker's own POST /health
    assert r.status == 200 and (await r.json())["state"] == "ready"


async def test_a_bearer_token_that_is_not_utf8_is_401(aiohttp_client):
    c = await aiohttp_client(create_app(server_config(api_token="s3cret-token")))
    await wait_status(c)
    for token in (b"\xff\xfe\x80", b"s3cret-token\xff", "s3cret-t\u00f6ken".encode("latin-1")):
        r, w = await raw(c, b"GET /api/v1/pow/status HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + token +
                         b"\r\nConnection: close\r\n\r\n")
        a = await read_all(r, 10)
        w.close()
        assert a.startswith(b"HTTP/1.1 401"), (token, a[:300])
    assert (await c.get("/api/v1/pow/status", headers={"Authorization": "Bearer s3cret-token"})).status == 200
    assert metric(await (await c.get("/metrics")).text(), 'poc_errors_total{kind="internal"}') == 0


# --------------------------------------------------------------------------------------------------
# POC_ALLOWED_CLIENTS: the node's signature signs a body, not a request


async def test_allowed_clients_refuse_an_unlisted_loopback_client_and_admit_a_listed_one(aiohttp_client):
    import aiohttp

    key, pub = node_key()
    c = await aiohttp_client(create_app(server_config(signer_pubkey=pub, allowed_clients=("127.0.0.2",))))
    await wait_status(c)  # /health and /metrics stay open to anyone
    assert (await c.get("/metrics")).status == 200
    empty = {"X-Signature": node_sign(key, b"")}  # what every signed GET of the node carries
    r = await c.post("/api/v1/stop", headers=empty)  # from 127.0.0.1: not listed
    assert r.status == 403 and (await r.json())["field"] == "client"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as listed:
        url = f"http://127.0.0.1:{c.port}"
        async with listed.get(url + "/api/v1/state", headers=empty) as r:
            assert r.status == 200
        # the scheme authenticates a body, not a request: the same empty-body signature is good for POST /stop too
        # (README: it cannot stop a replay), which is why the client's address is worth checking
        async with listed.post(url + "/api/v1/stop", headers=empty) as r:
            assert r.status == 200
        async with listed.post(url + "/api/v1/stop") as r:  # a listed address still needs the signature
            assert r.status == 401
    c2 = await aiohttp_client(create_app(server_config(allowed_clients=("localhost",))))  # names are resolved
    assert (await c2.post("/api/v1/pow/stop")).status == 200


def test_allowed_clients_entries_are_cidrs_addresses_or_resolved_names():
    from poc.errors import InputError
    from poc.server.config import parse_args
    from poc.server.security import Security, client_networks

    def resolve(host, *_a, **_k):
        if host == "node.internal":
            return [(2, 1, 6, "", ("10.1.2.3", 0)), (10, 1, 6, "", ("fd00::7", 0, 0, 0))]
        raise OSError("Name or service not known")

    nets = client_networks(["10.9.0.0/16", "192.168.1.5", "node.internal", "::1"], resolve)
    assert [str(n) for n in nets] == ["10.9.0.0/16", "192.168.1.5/32", "10.1.2.3/32", "fd00::7/128", "::1/128"]
    sec = Security(policy=None, allowed_clients=nets)
    assert sec.client_allowed("10.9.200.1") and sec.client_allowed("::ffff:10.1.2.3") and sec.client_allowed("::1")
    assert not sec.client_allowed("10.10.0.1") and not sec.client_allowed("127.0.0.1") and not sec.client_allowed(None)
    with pytest.raises(InputError, match="POC_ALLOWED_CLIENTS: 'nowhere.internal'"):
        client_networks(["nowhere.internal"], resolve)
    assert parse_args([], {"POC_ALLOWED_CLIENTS": "10.0.0.0/8, node"}).allowed_clients == ("10.0.0.0/8", "node")


# --------------------------------------------------------------------------------------------------
# memory of refused and abandoned bodies


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


async def abandon(port: int, n: int, mib: int, headers: bytes = b"") -> None:
    """`n` connections that announce a `mib` MiB body, send half of it, and close."""
    async def one():
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(GEN + headers + f"Content-Length: {mib << 20}\r\n\r\n".encode())
        part = b"[" + b"0," * ((1 << 19) - 1)
        try:
            for _ in range(mib // 2):
                w.write(part)
                await asyncio.wait_for(w.drain(), 30)
        except ConnectionError:
            pass  # refused from the head: the server closed
        w.close()

    await asyncio.gather(*(one() for _ in range(n)))


async def test_rss_returns_to_the_idle_baseline_after_48_aborted_16_mib_bodies(tmp_path):
    """A real server process: 48 bodies of 16 MiB abandoned half-way without credentials (refused from the head),
    then 48 with them (read, then abandoned). What they took goes back: RSS within 10% of the idle baseline."""
    from .fakes import ServerProcess

    s = ServerProcess(tmp_path / "server.log", "--spool-dir", str(tmp_path / "spool"),
                      env={"POC_API_TOKEN": "s3cret-token"})
    try:
        await s.wait_ready()
        await asyncio.sleep(1.0)
        base = rss(s.proc.pid)
        await abandon(s.port, 48, 16)
        await abandon(s.port, 48, 16, b"Authorization: Bearer s3cret-token\r\n")
        deadline = time.monotonic() + 20
        while rss(s.proc.pid) > 1.1 * base and time.monotonic() < deadline:  # a bound on memory, not on time
            await asyncio.sleep(0.25)
        after = rss(s.proc.pid)
        import urllib.request

        m = urllib.request.urlopen(s.url + "/metrics", timeout=10).read().decode()
    finally:
        assert s.terminate() == 0, s.text()[-3000:]
    assert metric(m, 'poc_errors_total{kind="unauthorized"}') == 48  # never read
    assert metric(m, 'poc_errors_total{kind="bad_input"}') == 48  # read, then aborted ("request body aborted")
    assert after <= 1.1 * base, (base, after)
    assert "Traceback" not in s.text()
