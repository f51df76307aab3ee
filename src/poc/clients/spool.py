"""An append-only on-disk spool: what the server owes a consumer survives a crash and is re-sent until acknowledged.

One directory (--spool-dir, env POC_SPOOL_DIR):

    seg-00000001.jsonl   records, one JSON line each: {"id", "kind", "url", "payload", "created"}, plus "merge" for
                         a record that goes out merged with the others of its key (callbacks.py)
    seg-00000001.acks    that segment's acknowledged records, one per line: "@<byte offset>" of the record
                         (an older spool's lines hold an id: every record of the segment with that id)
    dead-letter.jsonl    records a consumer refused for good (callbacks.py's refusal policy): never replayed

A record is identified by (url, id): the same idempotency id addressed to two destinations is two records, and
is acknowledged by position, so one destination's ack never covers the other's. `append()` writes a record and
fsyncs it before the caller may send it; `ack()` appends the positions to the segment's ack file once the
consumer answered (no fsync: a lost ack costs one repeat, which the idempotency id absorbs, and
plain writes survive a kill -9 of the process). `open()` reads every segment and returns its records minus its
acks: they are replayed. Appends go to a fresh segment that is rotated every `segment_records` records; a closed
segment whose records are all acknowledged is deleted with its ack file, so the disk holds the pending records
plus at most one segment. Memory holds, per pending record, its id, kind, url and where it lies on disk (never
the payload: `read()` fetches it when it is sent). A torn last line (a crash mid-write) is skipped.

Disk faults: an append that fails (ENOSPC, EIO on write or fsync, the segment unlinked under us) raises, and the
segment is retired: its torn or unsynced tail is truncated away where possible and the next append starts a
fresh segment (recreating a deleted directory), so no later record is written at an offset the spool does not
know. An ack that cannot be written still counts in memory (a closed segment with nothing pending is deleted all
the same; otherwise a restart re-sends the record once). A segment file that cannot be read at start is logged
and left in place, untouched; a directory where no segment can be created at start leaves the spool open for
reading, and every later append tries again. Pending records stay readable from descriptors held open, also
after their file was deleted.

Not thread-safe by design: the CallbackSender's outbox (outbox.py) calls it from one I/O thread only.

    python -m poc.clients.spool dead-letter [--spool-dir DIR] [--payload]

lists dead-letter.jsonl: one JSON line per record (id, kind, url, status, reason, dead_at, and the payload's size,
or the payload itself with --payload), then a count on stderr. The server need not be running.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("poc.spool")

_SEG = re.compile(r"^seg-(\d{8})\.jsonl$")
DEAD_LETTER = "dead-letter.jsonl"  # records a consumer refused for good (never replayed; kept for an operator)


@dataclass
class Entry:
    """Where one pending record lies: enough to send it (after `read`) and to acknowledge it."""

    id: str
    kind: str
    url: str
    seg: int
    offset: int
    length: int
    created: float
    merge: str | None = None


@dataclass
class _Segment:
    n: int
    records: int = 0
    unacked: set[int] = field(default_factory=set)  # offsets of the records not yet acknowledged
    closed: bool = False


class Spool:
    def __init__(self, directory: str | os.PathLike, segment_records: int = 1000):
        if segment_records < 1:
            raise ValueError(f"segment_records must be >= 1, got {segment_records}")
        self.dir = Path(directory)
        self.segment_records = segment_records
        self._segs: dict[int, _Segment] = {}
        self._cur: _Segment | None = None
        self._fd: int | None = None  # the current segment, O_APPEND
        self._offset = 0
        self._read_fds: dict[int, int] = {}  # segment -> a descriptor for read() (the current one's is self._fd)
        self._next = 1  # the next segment number
        self._opened = False

    # ------------------------------------------------------------------------------------------ paths

    def _rec_path(self, n: int) -> Path:
        return self.dir / f"seg-{n:08d}.jsonl"

    def _ack_path(self, n: int) -> Path:
        return self.dir / f"seg-{n:08d}.acks"

    # ------------------------------------------------------------------------------------------- open

    def open(self) -> list[Entry]:
        """Create the directory, read what an earlier process left, and return its unacknowledged records.
        Raises OSError only when the directory itself cannot be listed; an unreadable segment is skipped (logged)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        pending: list[Entry] = []
        seen: set[tuple[str, str]] = set()
        numbers = sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _SEG.match(p.name)))
        self._next = (numbers[-1] + 1) if numbers else 1
        self._opened = True
        for n in numbers:
            try:
                entries = self._scan(n)
                acked_ids, acked_at = self._read_acks(n)
            except OSError as e:  # EACCES, EIO: leave it for an operator; never delete what we could not read
                log.error("spool %s cannot be read (%s: %s): left in place, its records are not replayed",
                          self._rec_path(n).name, type(e).__name__, e)
                continue
            seg = _Segment(n, closed=True)
            self._segs[n] = seg
            dup: list[int] = []
            for e in entries:
                seg.records += 1
                if e.offset in acked_at or e.id in acked_ids:
                    continue
                if (e.url, e.id) in seen:  # the same record spooled twice: one copy is enough
                    dup.append(e.offset)
                else:
                    seen.add((e.url, e.id))
                    seg.unacked.add(e.offset)
                    pending.append(e)
            if dup:
                try:
                    self._write_acks(n, dup)
                except OSError:
                    pass  # the duplicate is replayed once more next time; the idempotency id absorbs it
            if seg.unacked:
                try:  # hold it open: its pending records stay readable even if the file is deleted meanwhile
                    self._read_fds[n] = os.open(self._rec_path(n), os.O_RDONLY)
                except OSError:
                    pass
            self._maybe_delete(seg)
        try:
            self._new_segment(self._next)
        except OSError as e:  # a read-only or full disk: replay what is there; append() tries again
            log.error("spool %s: no new segment can be created (%s: %s)", self.dir, type(e).__name__, e)
        return pending

    def _scan(self, n: int) -> list[Entry]:
        out = []
        with open(self._rec_path(n), "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            end = data.find(b"\n", pos)
            if end < 0:
                log.warning("spool %s: skipping a torn last record (%d bytes)", self._rec_path(n).name, len(data) - pos)
                break
            line = data[pos:end]
            try:
                rec = json.loads(line)
                out.append(Entry(rec["id"], rec["kind"], rec["url"], n, pos, end - pos, float(rec.get("created", 0)),
                                 rec.get("merge")))
            except (ValueError, KeyError, TypeError):
                log.warning("spool %s: skipping an unreadable record at byte %d", self._rec_path(n).name, pos)
            pos = end + 1
        return out

    def _read_acks(self, n: int) -> tuple[set[str], set[int]]:
        """The segment's acknowledgements: legacy ids, and record offsets ("@123")."""
        ids, offsets = set(), set()
        try:
            lines = self._ack_path(n).read_text(errors="replace").split("\n")
        except FileNotFoundError:
            return ids, offsets
        for s in lines:
            if s.startswith("@") and s[1:].isdigit():
                offsets.add(int(s[1:]))
            elif s and not s.startswith("@"):
                ids.add(s)
        return ids, offsets

    def _new_segment(self, n: int) -> None:
        """Retire the current segment and start segment n (at least): raises OSError, the old one retired, when
        the file cannot be created (the next append tries again with a higher number)."""
        self._retire()
        n = max(n, self._next)
        self._next = n + 1  # a failed attempt burns its number: a half-created file is never appended to blindly
        self.dir.mkdir(parents=True, exist_ok=True)  # deleted while we ran: recreate it
        fd = os.open(self._rec_path(n), os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            offset = os.fstat(fd).st_size
        except OSError:
            os.close(fd)
            raise
        self._cur = self._segs[n] = _Segment(n)
        self._fd, self._offset = fd, offset
        self._read_fds[n] = fd  # the same descriptor serves read(): pending records survive an unlink
        _fsync_dir(self.dir)  # the new file's name is durable too

    def _retire(self) -> None:
        """Stop appending to the current segment (its descriptor stays open for reads while records are pending)."""
        if self._fd is None:
            return
        self._fd = None
        self._cur.closed = True
        self._maybe_delete(self._cur)

    # --------------------------------------------------------------------------------------- records

    def append(self, id: str, kind: str, url: str, payload, merge: str | None = None) -> Entry:
        """Write one record and fsync it; the caller sends only after this returned."""
        if not self._opened:
            raise RuntimeError("spool is not open")
        if self._fd is None or self._cur.records >= self.segment_records:
            self._new_segment(self._next)
        created = time.time()
        rec = {"id": id, "kind": kind, "url": url, "payload": payload, "created": created}
        if merge is not None:
            rec["merge"] = merge
        line = json.dumps(rec, separators=(",", ":")).encode() + b"\n"
        off = self._offset
        try:
            _write_all(self._fd, line)
            os.fsync(self._fd)
            if os.fstat(self._fd).st_nlink == 0:
                raise FileNotFoundError(errno.ENOENT, "the spool segment was deleted while in use",
                                        str(self._rec_path(self._cur.n)))
        except OSError:
            # A partial line, or one whose fsync failed, must not stay in front of the next record: cut it off
            # where we can, and append nothing more to this segment (a tail we could not cut is its last line).
            try:
                os.ftruncate(self._fd, off)
            except OSError:
                pass
            self._retire()
            raise
        self._offset += len(line)
        self._cur.records += 1
        self._cur.unacked.add(off)
        return Entry(id, kind, url, self._cur.n, off, len(line) - 1, created, merge)

    def read(self, e: Entry) -> dict:
        """The record's payload, from disk."""
        fd = self._read_fds.get(e.seg)
        if fd is None:
            fd = self._read_fds[e.seg] = os.open(self._rec_path(e.seg), os.O_RDONLY)
        return json.loads(os.pread(fd, e.length, e.offset))["payload"]

    def ack(self, entries: list[Entry]) -> None:
        """Mark records delivered; deletes every closed segment that has nothing left to send."""
        by_seg: dict[int, list[int]] = {}
        for e in entries:
            by_seg.setdefault(e.seg, []).append(e.offset)
        error: OSError | None = None
        for n, offsets in by_seg.items():
            seg = self._segs.get(n)
            if seg is None:
                continue  # already deleted (acknowledged twice)
            try:
                self._write_acks(n, offsets)
            except OSError as e:  # delivered all the same: count it here; deleting the segment needs no space
                error = error or e
            seg.unacked.difference_update(offsets)
            self._maybe_delete(seg)
        if error is not None:
            raise error

    @property
    def dead_letter_path(self) -> Path:
        return self.dir / DEAD_LETTER

    def dead_letter(self, records: list[tuple], status: int | None, reason: str) -> None:
        """Append (kind, url, id, payload[, reason]) records to dead-letter.jsonl, fsynced: refused for good by
        their consumer, or past their lifetime (the reason says which; status is the last HTTP status, or null)."""
        now = time.time()
        data = b"".join(json.dumps({"id": r[2], "kind": r[0], "url": r[1], "status": status,
                                    "reason": r[4] if len(r) > 4 else reason, "dead_at": now, "payload": r[3]},
                                   separators=(",", ":")).encode() + b"\n"
                        for r in records)
        fd = os.open(self.dead_letter_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def dead_letter_count(self) -> int:
        """Records in dead-letter.jsonl (0 when there is none)."""
        try:
            with open(self.dead_letter_path, "rb") as f:
                return sum(1 for line in f if line.strip())
        except FileNotFoundError:
            return 0

    def _write_acks(self, n: int, offsets: list[int]) -> None:
        fd = os.open(self._ack_path(n), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            _write_all(fd, "".join(f"@{o}\n" for o in offsets).encode())
        finally:
            os.close(fd)

    def _maybe_delete(self, seg: _Segment) -> None:
        if not seg.closed or seg.unacked:
            return
        fd = self._read_fds.pop(seg.n, None)
        if fd is not None:
            os.close(fd)
        for p in (self._rec_path(seg.n), self._ack_path(seg.n)):
            try:
                p.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:  # a read-only directory: a restart reads it again (its acks, if written, hold)
                log.warning("spool %s could not be deleted (%s: %s)", p.name, type(e).__name__, e)
        self._segs.pop(seg.n, None)

    # --------------------------------------------------------------------------------------- status

    def segments(self) -> list[int]:
        """The segment numbers on disk (for tests and logs)."""
        return sorted(self._segs)

    def close(self) -> None:
        self._fd = None  # also in _read_fds
        self._opened = False
        for fd in self._read_fds.values():
            os.close(fd)
        self._read_fds.clear()


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def read_dead_letter(directory: str | os.PathLike) -> list[dict]:
    """The dead-letter records of a spool directory, oldest first (a torn or unreadable line becomes
    {"unreadable": <its text>}, so it is still listed)."""
    path = Path(directory) / DEAD_LETTER
    try:
        lines = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            out.append({"unreadable": line})
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m poc.clients.spool",
                                 description="List the callbacks a consumer refused for good or that outlived "
                                             "their lifetime (the spool's dead-letter.jsonl).")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("dead-letter")
    p.add_argument("--spool-dir", default=os.environ.get("POC_SPOOL_DIR") or "spool",
                   help="the server's --spool-dir (env POC_SPOOL_DIR; default ./spool)")
    p.add_argument("--payload", action="store_true", help="print each record's payload too")
    a = ap.parse_args(argv)
    if not Path(a.spool_dir).is_dir():
        print(f"poc: bad input: --spool-dir {a.spool_dir} is not a directory", file=sys.stderr)
        return 2
    records = read_dead_letter(a.spool_dir)
    for r in records:
        if not a.payload and "payload" in r:
            size = len(json.dumps(r["payload"], separators=(",", ":")))
            r = {k: v for k, v in r.items() if k != "payload"}
            r["payload_bytes"] = size
        print(json.dumps(r, separators=(",", ":")))
    print(f"{len(records)} dead-letter record(s) in {Path(a.spool_dir) / DEAD_LETTER}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
