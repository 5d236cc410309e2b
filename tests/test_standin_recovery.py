"""The stand-in's server after a fatal GPU error, as the H100's (driver 580, 2026-12-06,
``scripts/mps_recovery_probe.py``, docs/benchmarks.md "Issue 33: where a fault's recovery goes"):
no new client of the device while a torn-down client lives; once the last has exited, the server
recreates its contexts for a time that grows with the clients torn down, and a client connecting
meanwhile waits for it (its context creation blocks) instead of being refused.  Other devices'
clients are taken at once."""

from __future__ import annotations

import time

import pytest

from meshd_mps.mps.standin import StandinRefused, connect_client

from .test_standin import DEADLINE, Standin, root  # noqa: F401 (root: the fixture)

#: Per torn-down client, here (the stand-in's default is scaled down for the CPU suite).
RECOVER_MS = 200


@pytest.fixture
def standin(root, request):  # noqa: F811 (the fixture imported above)
    m = Standin(root, MESHD_MPS_STANDIN_RECOVER_MS=str(getattr(request, "param", RECOVER_MS)))
    m.start()
    yield m
    if m.daemon_pid is not None:
        m.quit()
    m.cleanup()


def test_a_new_client_waits_for_the_devices_recovery_which_grows_with_the_clients_torn_down(standin):
    a, b, c = (standin.client(5000 + i) for i in range(3))
    other = connect_client(str(standin.pipe), 5100, device=1)
    assert a and b and c and other
    standin.sockets.append(other)
    a.sendall(b"FAULT\n")  # a's fatal GPU error tears down a, b and c (device 0), not device 1's
    for s in (a, b, c):
        assert recv_all_line(s) == b"FAULT\n"
    with pytest.raises(StandinRefused, match="handling a fatal GPU error"):
        connect_client(str(standin.pipe), 5200)  # torn clients still live: refused, as on the GPU
    for s in (a, b, c):
        s.close()
    gone = time.monotonic()
    late = connect_client(str(standin.pipe), 5201, timeout=DEADLINE)  # waits, is not refused
    waited = time.monotonic() - gone
    assert late is not None
    standin.sockets.append(late)
    assert waited >= 3 * RECOVER_MS / 1e3 * 0.9, waited  # 3 clients torn down: 3 x RECOVER_MS
    log = (standin.logs / "server.log").read_text()
    assert "Device 0: every client torn down has exited; recreating its contexts (3 clients)" in log


@pytest.mark.parametrize("standin", [10 * DEADLINE * 1e3], indirect=True)  # device 0 recovers for 10 deadlines
def test_another_devices_client_is_taken_during_the_recovery(standin):
    a = standin.client(6000)
    assert a is not None
    a.sendall(b"FAULT\n")
    assert recv_all_line(a) == b"FAULT\n"
    a.close()
    with pytest.raises(TimeoutError):  # device 0 still recovering: its new client waits
        connect_client(str(standin.pipe), 6001, timeout=0.5)
    s = connect_client(str(standin.pipe), 6100, device=1, timeout=DEADLINE)  # not held by device 0's
    assert s is not None
    standin.sockets.append(s)


def recv_all_line(s) -> bytes:
    s.settimeout(DEADLINE)
    line = b""
    while not line.endswith(b"\n"):
        chunk = s.recv(1)
        if not chunk:
            break
        line += chunk
    return line
