"""The control API's routes for the programs' data (docs/api.md, "Data"): ``POST /v1/data`` (a
data file, streamed in), ``POST /v1/programs/{name}/write?offset=N`` (bytes into a running
program's data).

**Why a stream, not a file descriptor.** The daemon's API is HTTP on a Unix socket, which could
carry the client's open descriptor (SCM_RIGHTS) beside a request: the cheapest way, and the daemon
would read only what the caller opened.  But aiohttp reads the socket with ``recv``, which drops
ancillary data, so a descriptor would need a second socket and protocol of our own beside HTTP,
and neither ``curl --unix-socket`` nor the fleet's agents (whose data comes out of Ray's object
store, as memory, not as a file) could use it.  A body streamed over the socket keeps the one
protocol, works from any HTTP client, and keeps permissions right the same way: the bytes are
those the client read, as itself; the daemon opens no path a request names.  It is written to the
state directory a chunk at a time, hashed as it goes (programs/datastore.py), so that the daemon
never holds the file: its RSS during a 1 GiB upload stays within a few MiB of idle (the bench's
row (m)).  A body is read within ``Deadlines.http_body`` of each chunk, not of the whole: a large
file takes as long as it takes.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import anyio
from aiohttp import web

from meshd_mps.base.deadlines import Deadlines
from meshd_mps.base.names import check_name
from meshd_mps.programs import Programs
from meshd_mps.serving.status import BadBody, RequestTimeout

#: The largest data file a ``POST /v1/data`` takes (1 TiB: more than any GPU's memory, so that a
#: load, not the upload, says that a file does not fit).
MAX_DATA = 1 << 40
#: What is gathered from the socket before it is written to disk (off the loop).
GATHER = 4 << 20
_OFFSET = re.compile(r"[0-9]{1,20}")

Answer = Callable[[int, dict[str, Any]], web.Response]


class DataRoutes:
    def __init__(self, programs: Programs, deadlines: Deadlines, answer: Answer):
        self.ps = programs
        self.deadlines = deadlines
        self.answer = answer

    async def post_data(self, request: web.Request) -> web.Response:
        """A data file, the body (``application/octet-stream``), kept by its SHA-256: ``{"data": key,
        "bytes": n}``, the key a load's or upgrade's ``data`` names."""
        n = request.content_length
        if not n:
            raise BadBody("body: the data file's bytes expected, with a Content-Length; got an empty body")
        within = self.deadlines.http_body
        inc = await anyio.to_thread.run_sync(self.ps.reg.data.incoming)
        buf = bytearray()
        try:
            while True:
                try:
                    with anyio.fail_after(within):
                        chunk = await request.content.readany()
                except TimeoutError as e:
                    raise RequestTimeout(f"data: nothing of the body received in {within:g}s (after {inc.size + len(buf)}"
                                         f" of {n} bytes)", within=within) from e
                if chunk:
                    buf += chunk
                if buf and (len(buf) >= GATHER or not chunk):
                    await anyio.to_thread.run_sync(inc.write, buf)
                    buf = bytearray()
                if not chunk:
                    break
            if inc.size != n:
                raise BadBody(f"body: {inc.size} bytes received, its Content-Length says {n}")
            spec = await anyio.to_thread.run_sync(inc.finish)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(inc.abort)
            raise
        return self.answer(201, {"ok": True, "data": spec.key, "bytes": spec.size})

    async def post_write(self, request: web.Request) -> web.Response:
        """The body's bytes into the program's data at ``offset`` (the query's), while it runs."""
        name = check_name(request.match_info["name"])
        raw = request.query.get("offset", "")
        if not _OFFSET.fullmatch(raw):
            raise BadBody(f"query 'offset' {raw[:40]!r}: a byte offset (digits) expected, e.g. ?offset=4096", field="offset")
        within = self.deadlines.http_body
        try:
            with anyio.fail_after(within):
                data = await request.read()
        except TimeoutError as e:
            raise RequestTimeout(f"body not received in {within:g}s", within=within) from e
        if not data:
            raise BadBody("body: the bytes to write expected, got an empty body")
        w = await self.ps.write(name, int(raw), data)
        return self.answer(200, {"ok": True, **w.as_dict()})
