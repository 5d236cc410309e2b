"""A worker's frames off its pipe or socket, as they arrive: the read side is an asyncio protocol.

With a ``StreamReader`` every frame cost a reader task two ``readexactly`` and a wake-up before
its future was even resolved; with 32 workers asking at once the loop spent ~35 us of CPU per ask
(docs/benchmarks.md, row b).  ``FrameReader.data_received`` runs in the loop's read callback:
it cuts every whole frame of the read out of its buffer and hands each to its sink at once, so a
reply or a DONE resolves its future without waking any task but the one awaiting it.

A socket carries both directions on one transport, whose protocol this is: ``SocketWriter`` is its
write side, flow-controlled through ``pause_writing`` here.  A pipe's write side stays a
``StreamWriter`` on the worker's stdin.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

from meshd_mps.base.errors import FrameError
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Op

_HEADER = frames.HEADER.unpack_from
Sink = Callable[[Op, bytes], None]


class FrameReader(asyncio.Protocol):
    """Frames before ``attach`` (a socket's HELLO) are kept for ``first()``; from ``attach`` on,
    each goes to the sink as it is read.  A FrameError (raised by the parse or by the sink) ends
    the reading there: the rest of the stream is dropped.  The end sets ``ended``, with ``why``:
    None at a clean EOF, else the FrameError or the transport's error."""

    def __init__(self) -> None:
        self.transport: asyncio.BaseTransport | None = None
        self._buf = bytearray()
        self._sink: Sink | None = None
        self._early: deque[tuple[Op, bytes]] = deque()
        self._arrived: asyncio.Event = asyncio.Event()  # a frame was kept, or the end came
        self.ended = asyncio.Event()
        self.why: BaseException | None = None  # once ended: None (EOF) or the error
        self._writable: asyncio.Future[None] | None = None  # set while the transport's writes are paused

    # ---- asyncio.Protocol --------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.ended.is_set():
            return
        buf = self._buf
        if buf:  # the rest of a frame: parsed once it is whole (a long one is not copied at each read)
            buf += data
            if len(buf) < 4:
                return
            (n,) = _HEADER(buf, 0)
            if 0 < n <= frames.MAX_FRAME and len(buf) < 4 + n:
                return
            data = bytes(buf)
            buf.clear()
        at, size = 0, len(data)
        try:
            while size - at >= 4:  # frames.HEADER.size
                (n,) = _HEADER(data, at)
                if not 0 < n <= frames.MAX_FRAME:
                    frames.check_length(n)
                end = at + 4 + n
                if end > size:
                    break
                op = frames.check_op(data[at + 4])
                body = data[at + 5 : end]
                at = end
                if self._sink is not None:
                    self._sink(op, body)
                else:
                    self._early.append((op, body))
                    self._arrived.set()
        except FrameError as e:
            self._end(e)
            return
        if at < size:
            buf += data[at:]

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost says the rest

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None and self._buf:
            n = len(self._buf)
            if n < frames.HEADER.size:
                exc = FrameError(f"stdout closed inside a frame header ({n} bytes)")
            else:
                (length,) = frames.HEADER.unpack_from(self._buf)
                exc = FrameError(f"stdout closed inside a frame ({n - frames.HEADER.size} of {length} bytes)")
        self._end(exc)
        if self._writable is not None and not self._writable.done():
            self._writable.set_exception(ConnectionResetError("connection lost"))

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    # ---- ours ----------------------------------------------------------------------------------
    def attach(self, sink: Sink) -> None:
        """From now on every frame goes to ``sink`` (those kept so far first)."""
        self._sink = sink
        while self._early and not self.ended.is_set():
            op, body = self._early.popleft()
            try:
                sink(op, body)
            except FrameError as e:
                self._end(e)

    async def first(self) -> tuple[Op, bytes]:
        """The first frame (before ``attach``); EOFError if the stream ends first."""
        while not self._early:
            if self.ended.is_set():
                raise EOFError("the stream ended before its first frame") from self.why
            self._arrived.clear()
            await self._arrived.wait()
        return self._early.popleft()

    async def drained(self) -> None:
        """Returns once the transport takes writes again (at once unless paused)."""
        if self._writable is not None:
            await asyncio.shield(self._writable)

    def _end(self, why: BaseException | None) -> None:
        if self.ended.is_set():
            return
        self.why = why
        self._buf.clear()
        self.ended.set()
        self._arrived.set()


class SocketWriter:
    """A socket's write side, with what WorkerProc uses of a pipe's StreamWriter."""

    def __init__(self, transport: asyncio.WriteTransport, reader: FrameReader):
        self.transport = transport
        self._reader = reader

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        if self.transport.is_closing():
            raise ConnectionResetError("connection lost")
        await self._reader.drained()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def close(self) -> None:
        self.transport.close()

    def get_extra_info(self, name: str) -> object:
        return self.transport.get_extra_info(name)
