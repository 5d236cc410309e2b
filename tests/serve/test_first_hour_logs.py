"""The daemon's log says each refused load once, at warning, with its reason and
the program's name; nothing at error level for what is no error of the daemon's (a client's bad
input, a call's deadline); and a refused load leaves no "unload failed" behind it."""

from __future__ import annotations

import json
import os

import pytest

from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.serving.client import ClientError
from meshd_mps.state.program_files import program_body

from ..rigs.serve import EXAMPLES, Serve, events, manifest
from ..rigs.waits import poll

NO_ENTRY_CU = b'extern "C" __global__ void other(int *p) { *p = 1; }'


def _post(s: Serve, body: dict) -> tuple[int, dict]:
    st, _h, data = s.client.raw("POST", "/v1/programs", json.dumps(body).encode())
    return st, json.loads(data)


def _refusals(s: Serve, verb: str, program: str) -> list[dict]:
    return [e for e in events(s) if e.get("component") == "meshd" and e.get("program") == program
            and e.get("msg", "").startswith(f"{verb} {program} refused")]


@pytest.mark.parametrize("isolation", ["blink", "mps"])
def test_each_refused_load_is_logged_once_at_warning(tmp, isolation):
    s = Serve(tmp, isolation, os.path.join(tmp, "s.sock"), "--pool", "1")
    try:
        s.wait_ready()
        s.client.load(program_body(str(EXAMPLES / "echo")))
        ptx = cuda_to_ptx(NO_ENTRY_CU, "noentry", "compute_90").decode()
        refused = {
            # name: (body, status, a word of the reason)
            "noentry": ({"manifest": manifest("spin", name="noentry"), "ptx": ptx}, 400, "mesh_main"),
            "badptx": ({"manifest": manifest("spin", name="badptx"), "ptx": "# README\nnot PTX\n"}, 400, "not PTX"),
            "echo": ({"manifest": manifest("echo"), "ptx": ptx}, 409, "already loaded"),
            "huge": ({"manifest": manifest("spin", name="huge"), "ptx": ptx, "nodes": 10 ** 9}, 409,
                     "cannot be resident at once"),
        }
        for name, (body, status, words) in refused.items():
            st, ans = _post(s, body)
            assert st == status and words in ans["error"], (name, st, ans)
        st, _h, data = s.client.raw("PUT", "/v1/programs/echo", json.dumps(
            {"manifest": manifest("echo"), "ptx": ptx, "nodes": 3}).encode())
        assert st == 400, data

        def said() -> dict[str, list[dict]] | None:
            got = {n: _refusals(s, "load", n) for n in refused}
            return got if all(got.values()) else None

        got = poll(said, 10, "every refusal in the log")
        for name, (_body, status, words) in refused.items():
            [line] = got[name]  # once
            assert line["level"] == "warning" and words in line["msg"] and line["code"] == status, line
        [upgrade] = _refusals(s, "upgrade", "echo")
        assert upgrade["level"] == "warning" and upgrade["code"] == 400 and "'nodes'" in upgrade["msg"], upgrade
        # Nothing of it is an error: not the daemon's, and not the worker's (no UNLOAD of a module
        # that a refused LOAD never loaded: "unload failed ... CUDA_ERROR_INVALID_HANDLE").
        errors = [e for e in events(s) if e.get("level") == "error"]
        assert not errors, errors
        assert s.client.call("echo", "still here")["data"] == "still here"
    finally:
        s.kill()


def test_a_call_past_its_timeout_is_no_error_of_the_daemons(serve):
    """A caller's deadline that ran out (504): said at info, since nothing of the daemon's failed,
    and a program that stopped answering is its heartbeat's to report (a stall, a warning)."""
    s = serve("blink")
    s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "heartbeat")))
    with pytest.raises(ClientError) as e:
        s.client.call("heartbeat", "hello", 0.2)
    assert e.value.status == 504, e.value
    said = poll(lambda: [x for x in events(s) if x.get("component") == "meshd" and "no response in" in x.get("msg", "")],
                10, "the timeout in the log")
    assert [x["level"] for x in said] == ["info"], said
    assert not [x for x in events(s) if x.get("level") == "error"]


def test_a_refused_load_leaves_no_unload_behind(serve):
    """Blink mode: a LOAD the driver refused loaded nothing, so nothing is unloaded after it (the
    worker logged "unload failed ... CUDA_ERROR_INVALID_HANDLE" for the module it never had)."""
    s = serve("blink")
    s.wait_ready()
    ptx = cuda_to_ptx(NO_ENTRY_CU, "noentry", "compute_90").decode()
    st, ans = _post(s, {"manifest": manifest("spin", name="noentry"), "ptx": ptx})
    assert st == 400, ans
    s.client.load(program_body(str(EXAMPLES / "echo")))  # the worker has read every frame sent before
    poll(lambda: [e for e in events(s) if e.get("component") == "worker" and e.get("program") == "echo"], 10,
         "the worker's line for echo's load")
    assert not [e for e in events(s) if e.get("msg") == "unload failed"], s.log()


def test_the_level_of_each_refusal_is_decided_by_its_type():
    from meshd_mps.base import errors as E
    from meshd_mps.serving.status import HeadTooLarge, log_level

    assert log_level(E.CallTimeout("echo", 0.5), False) == "info"  # the caller's deadline
    assert log_level(E.Unavailable("meshd-mps is shutting down"), True) == "info"
    assert log_level(E.NoContext("worker 7: no context", pid=7), False) == "error"  # a worker's failure
    assert log_level(E.WorkerError("worker 7 exited", pid=7), True) == "error"
    assert log_level(E.AlreadyLoaded("echo"), True) == "warning"
    assert log_level(E.CapacityError("x", limit="hardware queues", have=8, asked=9), True) == "warning"
    assert log_level(HeadTooLarge("request head of 70000 bytes"), False) == "warning"
    assert log_level(E.NotLoaded("echo"), False) is None  # a client's bad input elsewhere: the debug line only
