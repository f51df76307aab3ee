"""The outbound-URL policy (clients/urlpolicy.py): refused at request time with a 400 naming the field (a loopback
listener records no connection), refused again at connect time after resolving (an injected resolver stands in for
DNS), redirects never followed, no connection detail in the streams. URLs that point off the machine are handed to
the server only inside a network namespace with nothing but the loopback (test_off_host_urls_refused_in_a_netns)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest
from aiohttp import web

from poc.clients.urlpolicy import UrlPolicy, UrlRefused
from poc.server.app import create_app
from poc.server.security import security_key

from .fakes import ROOT, LoopbackApp, Lines, status
from .servers import PARAMS_A, server_config, wait_status

OWN_PORT = 18555  # the config's own listening port (the test client listens elsewhere; the check is by config)


class Recorder(LoopbackApp):
    """A loopback listener that records every request it gets (and answers 404, or a redirect)."""

    def __init__(self, redirect_to: str | None = None):
        self.seen: list[str] = []
        self.redirect_to = redirect_to
        super().__init__(self._build())

    def _build(self) -> web.Application:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        return app

    _rebuild = _build

    async def _any(self, request: web.Request) -> web.Response:
        self.seen.append(f"{request.method} {request.path_qs}")
        if self.redirect_to:
            raise web.HTTPFound(self.redirect_to)
        return web.json_response({"status": "waiting"}, status=404)


def refused_forms(port: int) -> list[str]:
    """URL forms the policy refuses that would all reach the loopback listener on `port` if it did not."""
    return [
        f"http://user:pw@127.0.0.1:{port}/",
        f"http://127.0.0.1:{port}/api/v1/pow/stop?x=",  # the deputy path: our "/generated" would land in the query
        f"http://127.0.0.1:{port}/api/v1/pow/stop#",
        f"http://127.0.0.1:{port}/api/v1/pow/stop/%3F",
        f"http://127.0.0.1:{port}/a/../api/v1/pow/stop",
        f"http://2130706433:{port}/",  # 127.0.0.1 as one integer
        f"http://0x7f000001:{port}/",
        f"http://0177.0.0.1:{port}/",
        f"http://127.1:{port}/",
        f"http://127.0.0.1:{OWN_PORT}/",  # this server's own listening address
        f"http://localhost:{OWN_PORT}/",
        f"ftp://127.0.0.1:{port}/",
    ]


OFF_HOST_FORMS = ["http://169.254.169.254/latest/meta-data", "http://metadata.google.internal/computeMetadata/v1",
                  "http://[::ffff:169.254.169.254]/", "http://[fe80::1]/", "http://0.0.0.0:8080/",
                  "http://224.0.0.1/", "http://255.255.255.255/", "http://[::]/", "http://100.100.100.200/",
                  "http://metadata/"]


def test_policy_refuses_each_form_and_allows_plain_ones():
    p = UrlPolicy(own=[("127.0.0.1", OWN_PORT)])
    for u in refused_forms(9999) + OFF_HOST_FORMS:
        assert p.why_refused(u), u
    for u in ("http://127.0.0.1:9999", "http://10.1.2.3:9200/v1/poc", "https://node.example.com/api/",
              "http://[::1]:8080/x", f"http://127.0.0.1:{OWN_PORT + 1}/", "http://cafe.be/"):
        assert p.why_refused(u) is None, u
    allow = UrlPolicy(allow=["10.0.0.0/8", "node.internal.example"])
    assert allow.why_refused("http://10.1.2.3/") is None
    assert allow.why_refused("http://192.168.1.1/") and allow.why_refused("http://127.0.0.1/")
    assert allow.why_refused("http://node.internal.example/") is None


async def _post_every_form(client, urls: list[str]) -> list[tuple[str, int, dict]]:
    """Each URL on each route that takes one: (url, status, answer)."""
    await wait_status(client)
    out = []
    pow_init = {"block_hash": "bh", "block_height": 1, "public_key": "pk", "node_id": 0, "node_count": 1,
                "params": dict(PARAMS_A)}
    for u in urls:
        for path, body, field in (("/warmup", {"callback_url": u}, "callback_url"),
                                  ("/pooled", {"orchestrator_url": u}, "orchestrator_url"),
                                  ("/api/v1/pow/init/generate", {**pow_init, "url": u}, "url")):
            r = await client.post(path, json=body)
            out.append((u, r.status, await r.json(), field))
    return out


async def test_every_refused_form_is_a_400_naming_the_field_before_any_connection(aiohttp_client):
    rec = await Recorder().start()
    try:
        client = await aiohttp_client(create_app(server_config(port=OWN_PORT)))
        answers = await _post_every_form(client, refused_forms(rec.port))
        await asyncio.sleep(0.3)  # anything a missing refusal started would have connected by now
    finally:
        await rec.stop()
    for u, st, body, field in answers:
        assert st == 400 and body["field"] == field, (u, st, body)
        assert len(body["error"]) < 300
    assert rec.seen == []
    h = await (await client.get("/health")).json()
    assert h["state"] == "ready"  # nothing was started


def test_off_host_urls_refused_in_a_netns():
    """169.254.169.254, metadata names, unspecified/multicast/broadcast: answered 400 by a server in a network
    namespace with only the loopback up, so nothing could leave the machine even if a refusal were missing."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("ip"):
        pytest.fail("this test needs root, unshare and ip to build a loopback-only network namespace")
    code = "import asyncio, tests.test_urlpolicy as t; asyncio.run(t.netns_probe())"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    r = subprocess.run(["unshare", "-n", "sh", "-c", f"ip link set lo up && {sys.executable} -c '{code}'"],
                       capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    answers = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(answers) == 3 * len(OFF_HOST_FORMS)
    for u, st, body, field in answers:
        assert st == 400 and body["field"] == field, (u, st, body)


async def netns_probe() -> None:
    """Run inside the namespace: confirm it is sealed, then post every off-host form (prints the answers)."""
    import aiohttp
    from aiohttp.test_utils import TestClient, TestServer

    try:
        await asyncio.wait_for(asyncio.open_connection("169.254.169.254", 80), 2)
        raise SystemExit("the namespace reaches 169.254.169.254: refusing to run")
    except (OSError, asyncio.TimeoutError):
        pass
    assert aiohttp  # imported for the client side
    client = TestClient(TestServer(create_app(server_config(port=OWN_PORT))))
    await client.start_server()
    try:
        print(json.dumps(await _post_every_form(client, OFF_HOST_FORMS)))
    finally:
        await client.close()


def fake_dns(table: dict[str, list[str]]):
    async def resolve(host: str, port: int) -> list[str]:
        return table[host]

    return resolve


async def test_a_name_resolving_to_a_refused_address_is_refused_at_connect_time():
    rec = await Recorder().start()
    try:
        p = UrlPolicy(resolve=fake_dns({"evil.test": ["169.254.169.254"], "mixed.test": ["127.0.0.1", "0.0.0.0"],
                                        "good.test": ["127.0.0.1"]}))
        assert p.why_refused(f"http://evil.test:{rec.port}/") is None  # a name passes the request-time check
        async with p.session(5.0) as http:
            for name in ("evil.test", "mixed.test"):
                with pytest.raises(UrlRefused):
                    async with http.get(f"http://{name}:{rec.port}/x"):
                        pass
            assert rec.seen == []
            async with http.get(f"http://good.test:{rec.port}/x") as r:  # connects to the address it checked
                assert r.status == 404
        assert rec.seen == ["GET /x"]
    finally:
        await rec.stop()


async def test_no_redirect_is_followed():
    target = await Recorder().start()
    hop = await Recorder(redirect_to=f"{target.url}/api/v1/pow/stop").start()
    try:
        async with UrlPolicy().session(5.0) as http:
            with pytest.raises(UrlRefused):
                async with http.post(f"{hop.url}/generated", json={}):
                    pass
        assert hop.seen == ["POST /generated"] and target.seen == []
    finally:
        await hop.stop()
        await target.stop()


async def test_warmup_stream_says_unreachable_alike_for_refused_redirected_and_404(aiohttp_client):
    """A resolved-to-metadata name, a redirect and a 404 read the same on the stream: no port-scan oracle."""
    target = await Recorder().start()
    hop = await Recorder(redirect_to=f"{target.url}/").start()
    try:
        client = await aiohttp_client(create_app(server_config(warmup_poll_interval=0.05, warmup_max_duration=30.0)))
        client.app[security_key].policy._resolve = fake_dns({"evil.test": ["169.254.169.254"]})
        lines = []
        for cb in (f"http://evil.test:{target.port}", hop.url, target.url):
            r = await client.post("/warmup", json={"callback_url": cb})
            out = Lines(r)
            _, line, _ = await out.wait(status("warmup_callback_unreachable"))
            r.close()
            lines.append({k: v for k, v in line.items() if k not in ("poll_count", "elapsed")})
        assert lines[0] == lines[1] == lines[2] == {"status": "warmup_callback_unreachable",
                                                    "error": "callback unreachable"}
        assert all(s.startswith("GET /warmup/params") for s in target.seen)  # only the plain 404 case reached it
        assert not any("evil" in s for s in target.seen) and hop.seen
    finally:
        await hop.stop()
        await target.stop()
