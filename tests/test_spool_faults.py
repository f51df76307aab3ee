"""The spool when its disk fails at runtime: ENOSPC/EIO on an append (write or fsync), on a segment rotation, on
an ack; the directory deleted while running; an unreadable segment at start. Faults are injected by
monkeypatching (os.write/os.fsync/os.open as the spool module sees them, or its helpers); all offline, on the CPU.

What must hold: no later record is written where the spool does not think it is (a failed append used to shift
every later offset: the next record read back another record's payload); no write to a closed descriptor; the
sender keeps a record it could not spool in memory, says so once, shows it in /health and /metrics, and puts it
back on disk when the disk works again.
"""

import asyncio
import errno
import logging
import os
import shutil

import pytest

from poc.clients import spool as spool_mod
from poc.clients.callbacks import CallbackSender
from poc.clients.spool import Spool
from poc.server.app import create_app
from poc.server.context import sender_key

from .servers import pooled_config, wait_status


def _fail(err):
    def f(*a, **kw):
        raise OSError(err, os.strerror(err))
    return f


def test_a_failed_append_does_not_shift_later_records(tmp_path, monkeypatch):
    """fsync EIO after a full write, then ENOSPC after a partial write: each append raises, and the records
    appended afterwards read back as themselves, now and after a restart."""
    s = Spool(tmp_path)
    s.open()
    a = s.append("a", "results", "u", {"i": 1})
    with monkeypatch.context() as m:
        m.setattr(spool_mod.os, "fsync", _fail(errno.EIO))
        with pytest.raises(OSError):  # an append whose fsync failed must raise
            s.append("b", "results", "u", {"i": 2})
    c = s.append("c", "results", "u", {"i": 3})
    assert s.read(c) == {"i": 3}  # was {"i": 2}: c's offset pointed at b's line

    real_write = os.write

    def partial(fd, data):  # 10 bytes go out, then the disk is full
        m2.setattr(spool_mod.os, "write", _fail(errno.ENOSPC))
        return real_write(fd, bytes(data[:10]))

    with monkeypatch.context() as m2:
        m2.setattr(spool_mod.os, "write", partial)
        with pytest.raises(OSError):  # a torn append must raise
            s.append("d", "results", "u", {"i": 4})
    e = s.append("e", "results", "u", {"i": 5})
    assert s.read(e) == {"i": 5} and s.read(a) == {"i": 1} and s.read(c) == {"i": 3}
    s.close()
    s2 = Spool(tmp_path)
    pending = s2.open()
    assert [x.id for x in pending] == ["a", "c", "e"]  # e was lost: glued to d's torn bytes
    assert [s2.read(x)["i"] for x in pending] == [1, 3, 5]
    s2.close()


def test_a_failed_rotation_never_writes_through_a_closed_descriptor(tmp_path, monkeypatch):
    s = Spool(tmp_path / "sp", segment_records=1)
    s.open()
    s.append("a", "results", "u", {"i": 1})
    real_open = os.open

    def no_new_segment(path, flags, *a):
        if str(path).endswith(".jsonl") and flags & os.O_CREAT:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, flags, *a)

    with monkeypatch.context() as m:
        m.setattr(spool_mod.os, "open", no_new_segment)
        with pytest.raises(OSError):  # a failed rotation must raise
            s.append("b", "results", "u", {"i": 2})
    other = tmp_path / "other.txt"
    fd = os.open(other, os.O_WRONLY | os.O_CREAT)  # likely the number the old segment's descriptor had
    try:
        c = s.append("c", "results", "u", {"i": 3})
    finally:
        os.close(fd)
    assert other.read_bytes() == b""  # the record went to a segment, not into someone else's file
    assert s.read(c) == {"i": 3}
    s.close()
    s2 = Spool(tmp_path / "sp", segment_records=1)
    assert [x.id for x in s2.open()] == ["a", "c"]
    s2.close()


def test_spool_directory_deleted_while_running(tmp_path):
    """An append into a file that was unlinked is not durable: it raises, and the next one recreates the
    directory. Records pending in the deleted segment stay readable (to be sent) from the held descriptor."""
    d = tmp_path / "sp"
    s = Spool(d)
    s.open()
    a = s.append("a", "results", "u", {"i": 1})
    shutil.rmtree(d)
    with pytest.raises(OSError):  # an append into a deleted segment must raise (it would be lost on a crash)
        s.append("b", "results", "u", {"i": 2})
    c = s.append("c", "results", "u", {"i": 3})
    assert d.is_dir() and s.read(c) == {"i": 3} and s.read(a) == {"i": 1}
    s.close()
    s2 = Spool(d)
    assert [x.id for x in s2.open()] == ["c"]
    s2.close()


def test_a_failed_ack_write_still_frees_a_finished_segment(tmp_path, monkeypatch):
    s = Spool(tmp_path, segment_records=1)
    s.open()
    a = s.append("a", "results", "u", {"i": 1})
    b = s.append("b", "results", "u", {"i": 2})  # segment 1 is closed now
    with monkeypatch.context() as m:
        m.setattr(s, "_write_acks", _fail(errno.ENOSPC))
        with pytest.raises(OSError):  # the failed ack write is reported
            s.ack([a, b])
    assert 1 not in s.segments() and not (tmp_path / "seg-00000001.jsonl").exists()  # deleting needs no space
    s.close()


def test_an_unreadable_segment_at_start_is_logged_left_in_place_and_the_rest_replayed(tmp_path, monkeypatch, caplog):
    s = Spool(tmp_path, segment_records=1)
    s.open()
    s.append("a", "results", "u", {"i": 1})
    s.append("b", "results", "u", {"i": 2})
    s.close()
    real_scan = Spool._scan

    def scan(self, n):
        if n == 1:
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_scan(self, n)

    monkeypatch.setattr(Spool, "_scan", scan)
    s2 = Spool(tmp_path, segment_records=1)
    with caplog.at_level(logging.ERROR, "poc.spool"):
        pending = s2.open()
    assert [x.id for x in pending] == ["b"]
    assert (tmp_path / "seg-00000001.jsonl").exists()  # never deleted: an operator may recover it
    assert any("seg-00000001.jsonl cannot be read" in r.message for r in caplog.records)
    assert s2.append("c", "results", "u", {"i": 3}).seg == 3  # a fresh number
    s2.close()


async def test_sender_keeps_records_in_memory_while_the_disk_fails_says_so_once_and_respools(
        aiohttp_client, tmp_path, orch, monkeypatch, caplog):
    client = await aiohttp_client(create_app(pooled_config(tmp_path)))
    await wait_status(client)
    sender: CallbackSender = client.server.app[sender_key]
    url = f"{orch.url}/api/workers/w1"
    orch.reject_results = True
    with monkeypatch.context() as m, caplog.at_level(logging.INFO, "poc.callbacks"):
        m.setattr(spool_mod, "_write_all", _fail(errno.ENOSPC))
        for i in range(5):
            assert await sender.put("results", url, {"idempotency_id": f"r{i}"}, f"r{i}")  # taken, in memory
        h = await (await client.get("/health")).json()
        assert h["status"] == "healthy" and h["spool"]["ok"] is False and h["spool"]["memory_only"] == 5
        assert "ENOSPC" in h["spool"]["error"] or "No space" in h["spool"]["error"]
        text = await (await client.get("/metrics")).text()
        assert "poc_spool_ok 0.0" in text and 'poc_errors_total{kind="spool_write"} 5.0' in text
    warns = [r for r in caplog.records if r.name == "poc.callbacks" and "kept in memory" in r.message]
    assert len(warns) == 1  # one line for the outage, not one per record
    with caplog.at_level(logging.INFO, "poc.callbacks"):
        assert await sender.put("results", url, {"idempotency_id": "r5"}, "r5")  # the disk is back
        for _ in range(200):
            if sender.memory_only == 0:
                break
            await asyncio.sleep(0.01)
    assert sender.memory_only == 0 and sender.spool_error is None
    assert any("works again" in r.message for r in caplog.records)
    h = await (await client.get("/health")).json()
    assert h["spool"] == {"ok": True, "error": None, "memory_only": 0, "pending": 6}
    assert "poc_spool_ok 1.0" in await (await client.get("/metrics")).text()
    await client.close()  # nothing acknowledged: all six must be on disk now
    s = Spool(tmp_path / "spool")
    assert sorted(e.id for e in s.open()) == [f"r{i}" for i in range(6)]
    s.close()
