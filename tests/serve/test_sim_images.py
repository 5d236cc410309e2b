"""The simulated GPU knows the shipped examples by their image (the cubin), never by a program's name (issue
32, item 1): a user's own program called ``echo_counter`` is refused with a 400 that says what the
simulation runs and points to ``meshd-mps check``, rather than answering as echo; an example
loaded under a name of its own is still run as itself, and one whose PTX differs only in a
comment too (the same cubin).  One ``--gpu sim`` daemon (blink mode),
driven as a user does: ``meshd-mps load DIR`` and ``call``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile

import pytest

from meshd_mps.gpu.compiler import Compiler, cuda_to_ptx, image_hash, ptx_to_cubin, reg_cap
from meshd_mps.gpu.device import simulated_device
from meshd_mps.gpu.examples import cubin_id, example_images
from meshd_mps.serving.client import ClientError, program_body

from ..rigs.programs import program_dir
from ..rigs.serve import EXAMPLES, Serve, cli

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def daemon():
    d = tempfile.mkdtemp(prefix="msi-")
    s = Serve(d, "blink", os.path.join(d, "s.sock"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.kill()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="msi-p-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_a_users_program_named_like_an_example_is_refused(daemon, tmp):
    """As the issue found it: a counter named ``echo_counter`` loaded and answered as echo.  Now
    the load is refused, as ImageRefused (400), naming the image and what the simulation runs,
    and nothing is left loaded."""
    d = program_dir(tmp, "echo_counter")
    with pytest.raises(ClientError) as e:
        daemon.client.load(program_body(str(d)))
    assert e.value.status == 400, e.value
    text = str(e.value)
    assert "echo_counter" in text and "is not one of the shipped examples" in text, text
    assert "meshd-mps check" in text, text
    h = image_hash(program_body(str(d))["ptx"].encode(), 0)
    assert "recognised by their cubin" in text, text  # what the simulation compares
    # The words a user matches across the surfaces: ``check`` shows the same hash (load's, ps's) and
    # cubin (the simulation's) as the refusal names, each under its one name.
    r = cli("check", str(d), "--json", "--socket", daemon.sock)
    checks = {c["check"]: c for c in json.loads(r.stdout)["checks"]}
    assert checks["limits"]["hash"] == f"{h:016x}", checks
    assert f"(hash {h:016x}, cubin {checks['compile']['cubin']})" in text, (text, checks)
    assert all(p["name"] != "echo_counter" for p in daemon.client.programs())
    # The CLI says it in one line, with no traceback.
    r = cli("load", str(d), "--socket", daemon.sock)
    assert r.returncode != 0 and "meshd-mps check" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_an_example_under_another_name_runs_as_itself(daemon, tmp):
    """examples/echo's source, in a folder of its own and named ``relay``: the same image, so the
    simulation runs it as echo (an echo answers with what it was sent)."""
    d = program_dir(tmp, "relay", (EXAMPLES / "echo" / "echo.cu").read_text(), file="relay.cu")
    try:
        p = daemon.client.load(program_body(str(d)))["program"]
        assert p["hash"] == f"{image_hash(program_body(str(d))['ptx'].encode(), 0):016x}", p
        assert daemon.client.call("relay", "hello")["data"] == "hello"
    finally:
        daemon.client.unload("relay")


def test_the_known_images_are_the_examples_as_load_compiles_them():
    """Derived at run time from the shipped sources (no hash written down): each example's cubin,
    compiled as ``meshd-mps load examples/NAME`` and the daemon's JIT compile it
    (``Compiler.prepare``, the bytes a load sends the worker), is known, under its name."""
    info = simulated_device()
    known = example_images(info)
    for name in ("heartbeat", "echo", "spin", "fault"):
        body = program_body(str(EXAMPLES / name), arch=info.compute)
        cubin = asyncio.run(Compiler(info).prepare(body["manifest"], body["ptx"].encode())).cubin
        assert known.get(cubin_id(cubin)) == name
    # A cubin compiled by another path to the same PTX (no include folder given) is the same image.
    src = (EXAMPLES / "echo" / "echo.cu").read_bytes()
    ptx = cuda_to_ptx(src, "anything", info.compute)
    assert known[cubin_id(ptx_to_cubin(ptx, info.arch, reg_cap(info, 1)))] == "echo"
    assert example_images(simulated_device(1)) is known  # one compile per kind of GPU, not per ordinal


def test_check_compiles_for_the_daemons_gpu(daemon):
    """With a daemon on the socket, ``check`` targets its GPU (the arch ``load`` compiles for)."""
    r = cli("check", str(EXAMPLES / "echo"), "--socket", daemon.sock)
    assert r.returncode == 0, r.stdout + r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("target: sm_90, simulated NVIDIA H200") and "the daemon's GPU" in first, first


# ---- by the cubin, not the PTX's hash: echo's PTX with a comment added (a new hash, the same code,
# the same cubin: what the fleet's rolling upgrade loads) runs as echo; echo's code under a manifest
# that changes the cubin (32 warps: another register cap) is refused.


def test_echo_with_a_comment_added_runs_as_echo(daemon):
    echo = program_body(str(EXAMPLES / "echo"))
    v2 = {**echo, "ptx": echo["ptx"] + "\n// v2\n"}
    try:
        old = daemon.client.load(echo)["program"]
        daemon.client.unload("echo")
        new = daemon.client.load(v2)["program"]
        assert new["hash"] != old["hash"], (old, new)  # another image to the daemon and the user
        assert daemon.client.call("echo", "hello")["data"] == "hello"
        assert daemon.client.call("echo", "again")["data"] == "again"
    finally:
        daemon.client.unload("echo")


def test_a_users_counter_is_still_refused(daemon, tmp):
    d = program_dir(tmp, "counter")
    with pytest.raises(ClientError) as e:
        daemon.client.load(program_body(str(d)))
    assert e.value.status == 400 and "is not one of the shipped examples" in str(e.value), e.value
    assert all(p["name"] != "counter" for p in daemon.client.programs())


def test_echos_code_under_a_manifest_that_changes_the_cubin_is_refused(daemon, tmp):
    d = program_dir(tmp, "echo32", (EXAMPLES / "echo" / "echo.cu").read_text(), file="echo32.cu", warps=32)
    with pytest.raises(ClientError) as e:
        daemon.client.load(program_body(str(d)))
    assert e.value.status == 400 and "is not one of the shipped examples" in str(e.value), e.value
    assert all(p["name"] != "echo32" for p in daemon.client.programs())


def test_a_load_that_is_refused_halts_nothing(daemon, tmp):
    """In blink mode a module load halts every running program (one context): every refusal the
    cubin itself says (none of the shipped examples, no ``mesh_main``, another program ABI) comes
    before that, so a refused load blinks nobody and the running heartbeat beats on."""
    daemon.client.load(program_body(str(EXAMPLES / "heartbeat")))
    try:
        before = daemon.client.status()["blinks"]
        no_entry = '#include "mesh_program.h"\nMESH_DEFINE_RT_ABI();\nextern "C" __global__ void other(int *p) { *p = 1; }\n'
        other_abi = '#include "mesh_program.h"\n__device__ unsigned int mesh_rt_abi = 7;\nMESH_MAIN { }\n'
        for d, why in ((program_dir(tmp, "echo_counter"), "is not one of the shipped examples"),
                       (program_dir(tmp, "noentry", no_entry), "no `extern \"C\" __global__ void mesh_main"),
                       (program_dir(tmp, "abi7", other_abi), "mesh_rt_abi is 7, this meshd-mps runs program ABI 1")):
            with pytest.raises(ClientError) as e:
                daemon.client.load(program_body(str(d)))
            assert e.value.status == 400 and why in str(e.value), e.value
        st = daemon.client.status()
        assert st["blinks"] == before, st  # nothing halted for the refused loads
        assert [p["state"] for p in daemon.client.programs() if p["name"] == "heartbeat"] == ["running"]
    finally:
        daemon.client.unload("heartbeat")
