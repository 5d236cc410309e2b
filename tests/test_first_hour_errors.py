"""Issue 32, item 4: errors that name the thing that is wrong, in the error itself (its type and
fields), the same from the library and the CLI."""

from __future__ import annotations

import json
import os

import pytest

from meshd_mps.gpu.compiler import cuda_to_ptx
from meshd_mps.protocol import frames
from meshd_mps.protocol.frames import ENTRY_DECL
from meshd_mps.state.program_files import program_body

from .rigs.serve import EXAMPLES, Serve, cli, manifest

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
