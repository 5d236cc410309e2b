"""The frame codec: round trips, every malformed shape, and a fuzzer on both sides."""

from __future__ import annotations

import contextlib
import os
import socket
import struct

import pytest
from hypothesis import given, settings, strategies as st

from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import Done, FrameError, LaunchReq, Load, Loaded, Op
from workers.main import Channel, Opened, serve


def test_round_trips():
    load = Load(0, 256, 49152, 1 << 20, "echo", b"\x7fELF...", 0x0123456789ABCDEF)
    assert Load.decode(load.encode()) == load
    launch = LaunchReq(3, 7, 12, 132)
    assert LaunchReq.decode(launch.encode()) == launch
    done = Done(0, 9, False, "CUDA_ERROR_ILLEGAL_ADDRESS: boom")
    assert Done.decode(done.encode()) == done
    info = Loaded(1, 40, 8, 0, 16, 0x7F00_0000_1000, 4096)
    ok, payload = frames.split_reply(Op.LOADED, info.encode())
    assert ok and Loaded.decode_ok(payload) == info
    op, body, used = frames.decode(frames.encode(Op.LAUNCH, launch.encode()) + b"tail")
    assert (op, body, used) == (Op.LAUNCH, launch.encode(), 5 + 16)


def test_layout_is_the_documented_one():
    # docs/protocol.md: u32 LE length of op+body, u8 op, body
    assert frames.encode(Op.READY) == b"\x01\x00\x00\x00\x01"
    assert frames.encode(Op.QUIT, b"ab") == b"\x03\x00\x00\x00\x08ab"
    assert LaunchReq(1, 2, 3, 4).encode() == struct.pack("<IIII", 1, 2, 3, 4)
    assert Done(1, 2, True, "x").encode() == struct.pack("<III", 1, 2, 1) + b"x"


@pytest.mark.parametrize(
    "buf, why",
    [
        (b"\x01\x00", "no length"),
        (b"\x00\x00\x00\x00", "length 0"),
        (struct.pack("<I", frames.MAX_FRAME + 1) + b"\x01", "over the"),
        (b"\x05\x00\x00\x00\x01ab", "short frame: length 5, 3 bytes"),
        (b"\x01\x00\x00\x00\x63", "unknown op 99"),
    ],
)
def test_malformed_frames(buf, why):
    with pytest.raises(FrameError, match=why):
        frames.decode(buf)


@pytest.mark.parametrize(
    "fn, body, why",
    [
        (Load.decode, b"\x00" * 27, "shorter than its 28-byte head"),
        (Load.decode, struct.pack("<IIIIQI", 0, 1, 0, 0, 0, 9) + b"abc", "name length 9"),
        (LaunchReq.decode, b"\x00" * 15, "LAUNCH body of 15 bytes, expected 16"),
        (Done.decode, b"\x00" * 11, "DONE body of 11 bytes"),
        (Done.decode, struct.pack("<III", 0, 1, 7), "ok word 7"),
        (lambda b: frames.split_reply(Op.LOADED, b), b"\x01", "no ok word"),
        (lambda b: Loaded.decode_ok(b), b"\x00" * 10, "LOADED body of 14 bytes"),
    ],
)
def test_malformed_bodies(fn, body, why):
    with pytest.raises(FrameError, match=why):
        fn(body)


def test_oversized_encode_is_refused():
    with pytest.raises(FrameError, match="over the"):
        frames.encode(Op.LOAD, bytes(frames.MAX_FRAME))
    with pytest.raises(FrameError, match="program name"):
        Load(0, 1, 0, 0, "x" * 256, b"").encode()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64))
def test_supervisor_decoder_fuzzed(buf):
    """Arbitrary bytes: a frame, or FrameError; never another exception."""
    try:
        op, body, used = frames.decode(buf)
    except FrameError:
        return
    assert 5 <= used <= len(buf) and isinstance(op, Op)
    for dec in (Load.decode, LaunchReq.decode, Done.decode):
        with contextlib.suppress(FrameError):
            dec(body)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64))
def test_worker_reader_fuzzed(buf):
    """The worker's pipe reader on arbitrary bytes: frames, EOF or FrameError."""
    r, w = os.pipe()
    try:
        os.write(w, buf)
        os.close(w)
        w = -1
        ch = Channel(rfd=r, wfd=-1)
        while True:
            try:
                got = ch.read()
            except FrameError:
                break
            if got is None:
                break
            assert isinstance(got[0], Op)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.parametrize("gone", [True, False])
def test_a_ready_from_a_daemon_that_died_opens_no_gpu(gone):
    """A READY the daemon sent just before it died (still buffered, its end closed) opens nothing:
    an MPS client made then would be nobody's.  The same READY from a daemon still there opens the
    held worker's GPU."""
    ours, theirs = socket.socketpair()
    opens: list[int] = []
    try:
        theirs.sendall(frames.encode(Op.READY, b"") + (b"" if gone else frames.encode(Op.QUIT, b"")))
        if gone:
            theirs.close()
        opened = Opened(lambda: (opens.append(1), (None, "no GPU here"))[1], hold=True)
        assert serve(Channel(rfd=ours.fileno(), wfd=ours.fileno()), opened) == (None if gone else 0)
        assert opens == ([] if gone else [1])
    finally:
        ours.close()
        theirs.close()
