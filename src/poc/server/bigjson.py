"""json.loads for large request bodies, in steps that never hold the interpreter lock for long.

A thread does not keep a large parse off the event loop: json's C decoder holds the GIL for the whole document
(16 MiB of `[0, 1, ...]` took 0.5 s, of `[[], [], ...]` 2.3 s, and GET /health waited that long). Here the
containers are walked in Python, so the thread yields the GIL at the interpreter's switch interval (5 ms), and only
the leaves (numbers, strings, literals) and object keys go to the C scanner, one bounded call each. The result equals
json.loads(raw) (same errors as ValueError, NaN/Infinity refused through `parse_constant`); it is several times
slower (16 MiB of small integers: 7 s against 0.5 s), which only the routes that take large bodies pay, on a thread;
`max_values` bounds that work (every number, string, literal, object and array counts one), so a body of millions of
tiny values is refused after the number a real request can hold, and `max_containers` bounds the objects and arrays.

The garbage collector is the other stall: a full collection walks every tracked object (343,000 in a server with torch
imported: 0.21 s with the GIL held), and a parse that makes containers by the hundred thousand set off one after
another (`[[], [], ...]`: the loop stalled 0.14-0.23 s again and again). A JSON tree holds no reference cycle, so the
collector is paused while the parsing thread builds one; the server freezes what it holds at start (app.py), so a
later full collection walks only what came after.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from json.decoder import JSONDecodeError, scanstring
from json.scanner import make_scanner

WS = re.compile(r"[ \t\n\r]*")
MAX_DEPTH = 1000  # json.loads' own bound (the interpreter's recursion limit): deeper is a RecursionError
_executor: ThreadPoolExecutor | None = None
_executor_lock = threading.Lock()


async def parse_off_loop(raw: bytes, parse_constant=None, max_values: int | None = None,
                         max_containers: int | None = None):
    """loads() on the one parsing thread, the garbage collector paused meanwhile. One thread, not one per body: every
    thread that wants the GIL takes turns with the event loop, so eight parses at once left the loop one turn in nine
    (GET /health waited over a second)."""
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = ThreadPoolExecutor(1, thread_name_prefix="poc-json")
    return await asyncio.get_running_loop().run_in_executor(_executor, _loads_without_gc, raw, parse_constant,
                                                            max_values, max_containers)


def _loads_without_gc(raw, parse_constant, max_values, max_containers):
    enabled = gc.isenabled()  # only this thread pauses it, one parse at a time
    gc.disable()
    try:
        return loads(raw, parse_constant, max_values, max_containers)
    except (ValueError, RecursionError) as e:
        failure = (RecursionError if isinstance(e, RecursionError) else ValueError, str(e))
    finally:
        if enabled:
            gc.enable()
    # raised afresh, without the parse's traceback: its frames (the decoded text, a partial tree of up to max_values
    # objects) are freed here, not on the event loop where the error is handled (that took 50-170 ms)
    raise failure[0](failure[1])


def _scanner(parse_constant):
    return make_scanner(json.JSONDecoder(parse_constant=parse_constant))


def _key(s: str, pos: int) -> tuple[str, int]:
    """An object key and the position after its ':' (and whitespace)."""
    if s[pos:pos + 1] != '"':
        raise JSONDecodeError("Expecting property name enclosed in double quotes", s, pos)
    key, pos = scanstring(s, pos + 1, True)
    pos = WS.match(s, pos).end()
    if s[pos:pos + 1] != ":":
        raise JSONDecodeError("Expecting ':' delimiter", s, pos)
    return key, WS.match(s, pos + 1).end()


def loads(raw: bytes | str, parse_constant=None, max_values: int | None = None, max_containers: int | None = None):
    """The JSON value of `raw` (bytes in any encoding json.loads detects, or str)."""
    s = raw if isinstance(raw, str) else bytes(raw).decode(json.detect_encoding(raw), "surrogatepass")
    scan = _scanner(parse_constant)
    n = len(s)
    stack: list[list] = []  # [container, pending key] of each open object or array
    values = containers = 0
    limit = max_values if max_values is not None else n + 1  # a value takes at least one character
    climit = max_containers if max_containers is not None else n + 1
    pos = WS.match(s, 0).end()
    while True:
        # a value starts at pos
        values += 1
        if values > limit:
            raise ValueError(f"more than {max_values} JSON values (numbers, strings, objects, arrays)")
        c = s[pos:pos + 1]
        if c == "{" or c == "[":
            containers += 1
            if containers > climit:
                raise ValueError(f"more than {max_containers} JSON objects and arrays")
            if len(stack) >= MAX_DEPTH:
                raise RecursionError("JSON nested too deeply")
            value = {} if c == "{" else []
            pos = WS.match(s, pos + 1).end()
            if s[pos:pos + 1] != ("}" if c == "{" else "]"):
                stack.append([value, None])
                if c == "{":
                    stack[-1][1], pos = _key(s, pos)
                continue  # its first member
            pos += 1  # empty
        else:
            try:
                value, pos = scan(s, pos)
            except StopIteration as e:
                raise JSONDecodeError("Expecting value", s, e.value) from None
        # attach the value; close every container that ends here
        while True:
            if not stack:
                end = WS.match(s, pos).end()
                if end != n:
                    raise JSONDecodeError("Extra data", s, end)
                return value
            top = stack[-1]
            parent = top[0]
            if type(parent) is dict:
                parent[top[1]] = value
            else:
                parent.append(value)
            pos = WS.match(s, pos).end()
            c = s[pos:pos + 1]
            if c == ",":
                pos = WS.match(s, pos + 1).end()
                if type(parent) is dict:
                    top[1], pos = _key(s, pos)
                break  # the next member
            if c == ("}" if type(parent) is dict else "]"):
                stack.pop()
                value, pos = parent, pos + 1
                continue
            raise JSONDecodeError("Expecting ',' delimiter", s, pos)
