"""Errors that name the thing that is wrong, in the error itself (its type and
fields), the same from the library and the CLI."""

from __future__ import annotations

import json
import os

import pytest

from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import ENTRY_DECL
from meshd_mps.state.program_files import program_body

from ..rigs.serve import EXAMPLES, Serve, cli, manifest

NO_ENTRY_CU = b'__global__ void mesh_main(unsigned long long mailbox, unsigned int slot) {}'  # no extern "C"


# ---- d. a program without mesh_main ----------------------------------------------------------


@pytest.mark.parametrize("isolation", ["blink", "mps"])
def test_a_program_without_its_entry_is_told_what_to_declare(tmp, isolation):
    """The simulated GPU fails as the GPU does, and the worker says which failure it is (LOADED's ok
    word NO_ENTRY): the daemon names the entry to declare, not cuModuleGetFunction's NOT_FOUND."""
    d = os.path.join(tmp, "mine")
    os.mkdir(d)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump({"name": "mine", "backend": "cuda", "warps": 1, "abi": 1}, f)
    with open(os.path.join(d, "mine.cu"), "wb") as f:
        f.write(NO_ENTRY_CU)
    sock = os.path.join(tmp, "s.sock")
    s = Serve(tmp, isolation, sock, "--pool", "1")
    try:
        s.wait_ready()
        r = cli("load", d, "--socket", sock)
        assert r.returncode == 1, r
        said = r.stderr.strip()
        assert said.startswith(f"meshd-mps: load mine: no `{ENTRY_DECL}` in the program"), said
        assert 'extern "C"' in said and "mangled" in said, said
        st, _h, data = s.client.raw("POST", "/v1/programs", json.dumps(
            {"manifest": manifest("spin", name="mine"), "ptx": cuda_to_ptx(NO_ENTRY_CU, "mine", "compute_90").decode()}
        ).encode())
        ans = json.loads(data)
        assert st == 400 and ans["error"].startswith("load mine: no `extern"), ans
        assert ans["driver"].startswith("cuModuleGetFunction(mesh_main): CUDA_ERROR_NOT_FOUND"), ans
    finally:
        s.kill()


def test_the_ok_word_says_no_entry():
    assert frames.split_reply(frames.Op.LOADED, frames.error_reply("x", word=frames.NO_ENTRY)) == (frames.NO_ENTRY, b"x")
    with pytest.raises(frames.FrameError):
        frames.split_reply(frames.Op.LAUNCHED, frames.error_reply("x", word=frames.NO_ENTRY))


# ---- e. "already loaded" before any compile ---------------------------------------------------


def test_already_loaded_is_said_before_compiling(serve, tmp):
    """A program whose name is loaded and whose CUDA C does not compile: "already loaded", so the
    name was checked first (the client asks the daemon before it compiles; the daemon checks the
    name before it compiles PTX)."""
    s = serve("blink")
    s.wait_ready()
    s.client.load(program_body(str(EXAMPLES / "echo")))
    d = os.path.join(tmp, "again")
    os.mkdir(d)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(manifest("echo"), f)
    with open(os.path.join(d, "echo.cu"), "w") as f:
        f.write("this is not CUDA C\n")
    r = cli("load", d, "--socket", s.sock)
    assert r.returncode == 1 and r.stderr.strip() == "meshd-mps: program 'echo' is already loaded (upgrade it instead)", r
    st, _h, data = s.client.raw("POST", "/v1/programs", json.dumps({"manifest": manifest("echo"), "ptx": "not PTX"}).encode())
    assert st == 409 and json.loads(data)["program"] == "echo", data


# ---- f. a state dir that is not ours to take ------------------------------------------------------


def test_a_held_state_dir_names_the_daemon_that_holds_it(tmp):
    from meshd_mps.serving.status import status_of
    from meshd_mps.state.statedir import StateDirHeld
    from meshd_mps.state.store import Store

    state = os.path.join(tmp, "state")
    os.mkdir(state, 0o700)
    with Store(state, socket="/run/x/meshd-mps.sock"), pytest.raises(StateDirHeld) as e:
        Store(state)
    assert (e.value.pid, e.value.socket) == (os.getpid(), "/run/x/meshd-mps.sock") and status_of(e.value) == 400
    said = str(e.value)
    assert f"another meshd-mps (pid {os.getpid()}, serving on /run/x/meshd-mps.sock) holds it" in said, said
    assert "stop that daemon" in said and "0700" not in said and "--" not in said, said


def test_a_state_dir_others_may_write_is_told_the_chmod(tmp):
    state = os.path.join(tmp, "state")
    os.mkdir(state, 0o700)
    os.chmod(state, 0o770)
    r = cli("serve", "--gpu", "sim", "--socket", os.path.join(tmp, "s.sock"), "--state-dir", state)
    assert r.returncode == 1 and r.stderr.strip().endswith(f"chmod 0700 {os.path.realpath(state)}"), r.stderr


# ---- g. MPS isolation on the simulated GPU without the stand-in on PATH ---------------------------


def test_sim_mps_without_the_standin_says_where_it_is(tmp):
    import shutil
    import subprocess
    import sys

    from meshd_mps.standin import BIN_DIR

    from ..rigs.serve import REPO, env

    e = env()
    e["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), "/usr/bin", "/bin"])
    if shutil.which("nvidia-cuda-mps-control", path=e["PATH"]):
        pytest.skip("NVIDIA's MPS control binary is on this PATH")
    r = subprocess.run([sys.executable, "-m", "meshd_mps", "serve", "--gpu", "sim", "--isolation", "mps", "--socket",
                        os.path.join(tmp, "s.sock"), "--state-dir", os.path.join(tmp, "state")],
                       capture_output=True, text=True, env=e, cwd=REPO, timeout=60)
    assert r.returncode == 1, r
    assert f"stand-in daemon, in {BIN_DIR}: put that directory first on PATH" in r.stderr, r.stderr
    assert "install the NVIDIA" not in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- h. the library's errors: the hint in the error, no CLI flags in its words ------------------


async def test_no_driver_says_how_to_try_without_one_from_the_library(standin_on_path):
    from meshd_mps.backend import Backend
    from meshd_mps.base.errors import NoDriver
    from meshd_mps.gpu.device import query_device

    try:
        query_device()
    except NoDriver:
        pass
    else:
        pytest.skip("this machine has an NVIDIA driver")
    with pytest.raises(NoDriver) as e:
        await Backend.open()
    assert str(e.value).startswith("no NVIDIA driver: ") and str(e.value).endswith('use the simulated one: gpu="sim"')


async def test_library_errors_name_no_cli_flags(standin_on_path):
    from meshd_mps.backend import Backend
    from meshd_mps.base.errors import ConfigError, MeshError

    for kw in ({"isolation": "x"}, {"gpu": "x"}, {"pool": -1}):
        with pytest.raises(ConfigError) as e:
            await Backend.open(**kw)
        assert "--" not in str(e.value), e.value
    async with Backend.open(isolation="blink", gpu="sim") as b:
        for call in (lambda: b.device_or_first(5), lambda: b.native_env()):
            with pytest.raises(MeshError) as e:
                call()
            assert "--" not in str(e.value) and ("devices 0" in str(e.value) or "isolation is blink" in str(e.value))
