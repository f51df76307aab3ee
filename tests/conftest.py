"""The fixtures several test modules share: an in-process server, a callback receiver, a fake orchestrator."""

import pytest

from poc.server.app import create_app

from .fakes import ROOT, FakeOrchestrator
from .servers import QWEN3, Sink, server_config, wait_status


@pytest.fixture(scope="session", autouse=True)
def checkout_stays_clean():
    """No test writes into the checkout: a server started without --spool-dir spools to ./spool (its default),
    which a fresh clone's run would leave behind."""
    spool = ROOT / "spool"
    before = spool.exists()
    yield
    assert before or not spool.exists(), f"a test created {spool}: give its server a --spool-dir under tmp_path"


@pytest.fixture
async def client(aiohttp_client):
    """An app serving v2 for the tiny qwen3 checkpoint, and v1 (a pow queue of at most 40 nonces)."""
    c = await aiohttp_client(create_app(server_config(model=QWEN3, max_queued_nonces=40)))
    await wait_status(c)
    return c


@pytest.fixture
async def sink(aiohttp_server):
    """A callback receiver at sink.url (POST {url}/generated, {url}/validated)."""
    s = Sink()
    srv = await aiohttp_server(s.app)
    s.url = str(srv.make_url("/cb"))
    return s


@pytest.fixture
async def orch():
    """A fake orchestrator (tests/fakes.py) on 127.0.0.1."""
    o = FakeOrchestrator()
    await o.start()
    yield o
    await o.stop()
