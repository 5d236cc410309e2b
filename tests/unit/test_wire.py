"""FrameReader (meshd_mps/supervision/wire.py): frames cut out of the bytes as they arrive, however
the reads split them, handed on in order; a bad frame ends the reading there.  Fed by hand: what a
transport would call, with no process and no pipe."""

from __future__ import annotations

import pytest

from meshd_mps.base.errors import FrameError
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Op
from meshd_mps.supervision.wire import FrameReader

READY = frames.encode(Op.READY, frames.ready_reply(42))
DONE = frames.encode(Op.DONE, frames.Done(0, 1, True).encode())


def attached() -> tuple[FrameReader, list[tuple[Op, bytes]]]:
    r, got = FrameReader(), []
    r.attach(lambda op, body: got.append((op, body)))
    return r, got


async def test_frames_split_and_joined_across_reads():
    r, got = attached()
    stream = READY + DONE + READY
    for i in range(0, len(stream), 3):  # three bytes a read: every header and body split
        r.data_received(stream[i : i + 3])
    r.data_received(DONE + READY)  # two whole frames in one read
    assert [op for op, _ in got] == [Op.READY, Op.DONE, Op.READY, Op.DONE, Op.READY]
    assert got[0][1] == READY[5:] and got[1][1] == DONE[5:]
    assert not r.ended.is_set()
    r.connection_lost(None)
    assert r.ended.is_set() and r.why is None


async def test_frames_before_attach_are_kept_for_first_then_the_sink():
    r = FrameReader()
    r.data_received(READY + DONE)
    assert await r.first() == (Op.READY, READY[5:])
    got: list[Op] = []
    r.attach(lambda op, body: got.append(op))
    assert got == [Op.DONE]


async def test_a_bad_frame_ends_the_reading_and_what_follows_is_dropped():
    r, got = attached()
    r.data_received(READY + b"\x00\x00\x00\x00" + DONE)  # length 0: no op byte
    r.data_received(DONE)
    assert [op for op, _ in got] == [Op.READY]
    assert r.ended.is_set() and isinstance(r.why, FrameError) and "length 0" in str(r.why)
    r.connection_lost(None)
    assert isinstance(r.why, FrameError)  # the first end stands


async def test_a_sink_that_refuses_a_frame_ends_the_reading():
    r, got = FrameReader(), []

    def sink(op: Op, body: bytes) -> None:
        got.append(op)
        raise FrameError(f"unsolicited reply {op.name}")

    r.attach(sink)
    r.data_received(READY + DONE)
    assert got == [Op.READY] and str(r.why) == "unsolicited reply READY"


@pytest.mark.parametrize(("tail", "said"), [
    (b"\x05\x00", "stdout closed inside a frame header (2 bytes)"),
    (DONE[:-3], f"stdout closed inside a frame ({len(DONE) - 7} of {len(DONE) - 4} bytes)"),
])
async def test_eof_inside_a_frame(tail, said):
    r, got = attached()
    r.data_received(READY + tail)
    r.connection_lost(None)
    assert len(got) == 1 and str(r.why) == said


async def test_first_at_eof_says_the_stream_ended():
    r = FrameReader()
    r.connection_lost(None)
    with pytest.raises(EOFError):
        await r.first()
