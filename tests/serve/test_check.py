"""``meshd-mps check DIR``: a program checked without a GPU, one line per check,
exit 0 only if all pass.  Run in this process (``cli.main``) with a socket nobody serves, so the
target is the default sm_90 with an H200's figures; every failure is a FAIL line naming the check,
a one-line verdict on stderr, and never a traceback."""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from meshd_mps.gpu.compiler import cuda_to_ptx, ptx_to_cubin
from meshd_mps.gpu.cubin import STT_FUNC, Cubin, CubinError
from meshd_mps.serving.cli import main

from ..rigs.programs import program_dir
from ..rigs.serve import EXAMPLES

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tmp():
    d = tempfile.mkdtemp(prefix="mck-")
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def check(capsys, tmp: Path, *args: str) -> tuple[int, list[str], str]:
    rc = main(["check", *args, "--socket", str(tmp / "nobody.sock")])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return rc, out.splitlines(), err


def line(lines: list[str], check: str) -> str:
    return next(ln for ln in lines if ln.split(":")[0].split()[-1] == check)


@pytest.mark.parametrize("name", ["heartbeat", "echo", "spin", "fault"])
def test_each_example_passes(capsys, tmp, name):
    rc, out, err = check(capsys, tmp, str(EXAMPLES / name))
    assert rc == 0, [*out, err]
    assert out[0].startswith("target: sm_90") and "no daemon at" in out[0], out
    checks = [ln for ln in out if ln.startswith(("OK", "FAIL"))]
    assert len(checks) == 8 and all(ln.startswith("OK") for ln in checks), out
    assert "mesh_rt_abi = 1" in line(out, "abi")
    regs = int(line(out, "registers").split("registers: ")[1].split()[0])
    assert 0 < regs <= 248
    assert f"the simulated GPU runs it as {name}" in out[-1], out


def test_a_users_own_program_passes_and_is_told_the_sim_will_not_run_it(capsys, tmp):
    rc, out, _ = check(capsys, tmp, str(program_dir(tmp, "echo_counter")))
    assert rc == 0, out
    assert "the simulated GPU refuses it" in out[-1], out


def test_no_mesh_main(capsys, tmp):
    src = '#include "mesh_program.h"\nMESH_DEFINE_RT_ABI();\nextern "C" __global__ void other(int *p) { *p = 1; }\n'
    rc, out, err = check(capsys, tmp, str(program_dir(tmp, "noentry", src)))
    assert rc == 1
    assert line(out, "entry").startswith("FAIL entry: no kernel mesh_main: define it as extern \"C\" __global__"), out
    assert "the entry check failed" in err, err


def test_no_abi_global(capsys, tmp):
    src = '#include "mesh_program.h"\nMESH_MAIN { }\n'
    rc, out, _ = check(capsys, tmp, str(program_dir(tmp, "noabi", src)))
    assert rc == 1
    assert line(out, "abi").startswith("FAIL abi: no global mesh_rt_abi"), out
    assert "MESH_DEFINE_RT_ABI" in line(out, "abi")


def test_not_ptx(capsys, tmp):
    d = program_dir(tmp, "notptx", "# a README, not PTX\n", file="notptx.ptx")
    rc, out, _ = check(capsys, tmp, str(d))
    assert rc == 1
    assert line(out, "files").startswith(f"FAIL files: {d / 'notptx.ptx'}: not PTX (no .version directive"), out
    # --ptx FILE, as load takes it, the same: the file named.
    rc, out, _ = check(capsys, tmp, "--manifest", str(d / "manifest.json"), "--ptx", str(d / "notptx.ptx"))
    assert rc == 1 and line(out, "files").startswith(f"FAIL files: {d / 'notptx.ptx'}: not PTX"), out


def test_a_missing_directory_and_no_directory(capsys, tmp):
    rc, out, err = check(capsys, tmp, str(tmp / "nothere"))
    assert rc == 1 and line(out, "files") == f"FAIL files: {tmp / 'nothere'}: no such directory", out
    assert err == f"meshd-mps: check: {tmp / 'nothere'}: the files check failed (FAIL above)\n", err
    rc, out, _ = check(capsys, tmp)
    assert rc == 1 and line(out, "files").startswith("FAIL files: a program directory or --manifest FILE is needed")


def test_blocks_that_cannot_all_be_resident(capsys, tmp):
    """What a user sets: the manifest's warps and shared memory, and the launch's nodes.  echo at
    32 warps takes a whole SM's registers a block, so 200 blocks cannot all be resident on 132 SMs;
    nor can 133 blocks of 200000 bytes of shared memory each; 300000 is over a block's limit."""
    echo = (EXAMPLES / "echo" / "echo.cu").read_text()
    wide = program_dir(tmp, "wide", echo, file="wide.cu", warps=32)
    rc, out, _ = check(capsys, tmp, str(wide), "--nodes", "132")
    assert rc == 0, out
    rc, out, _ = check(capsys, tmp, str(wide), "--nodes", "200")
    assert rc == 1
    r = line(out, "resident")
    assert r.startswith("FAIL resident: wide: nodes 200 cannot be resident at once: the GPU holds 132 of its blocks"), r
    assert "by its registers" in r, r
    rc, out, _ = check(capsys, tmp, str(program_dir(tmp, "shared", echo, file="s.cu", smem=200000)), "--nodes", "133")
    assert rc == 1 and "by its shared memory" in line(out, "resident"), out
    rc, out, _ = check(capsys, tmp, str(program_dir(tmp, "over", echo, file="o.cu", smem=300000)))
    assert rc == 1 and line(out, "limits").startswith("FAIL limits: over: 300000 bytes of shared memory per block"), out


def test_json_and_arch(capsys, tmp):
    rc, out, _ = check(capsys, tmp, str(EXAMPLES / "echo"), "--arch", "sm_80", "--json")
    ans = json.loads("\n".join(out))
    assert rc == 0 and ans["ok"] is True and ans["target"]["arch"] == "sm_80" and ans["target"]["from"] == "--arch"
    assert [c["check"] for c in ans["checks"]] == ["files", "manifest", "limits", "compile", "entry", "abi", "registers",
                                                   "resident"]
    res = ans["checks"][-1]
    assert res["ok"] and res["nodes"] == 1 and res["per_sm"] >= 1 and res["sms"] == 132 and res["limited_by"], res
    rc, out, _ = check(capsys, tmp, str(tmp / "nothere"), "--json")
    ans = json.loads("\n".join(out))
    assert rc == 1 and ans["ok"] is False and ans["checks"] == [
        {"check": "files", "ok": False, "detail": f"{tmp / 'nothere'}: no such directory"}]
    rc, _, err = check(capsys, tmp, str(EXAMPLES / "echo"), "--arch", "sm9")
    assert rc == 2 and "--arch 'sm9': sm_XY expected" in err


def test_the_cubin_reader():
    """What the driver says of a loaded module, read from the cubin: the register count is the one
    nvJitLink was capped to when the cap binds, and bytes that are no cubin are said to be so."""
    ptx = cuda_to_ptx((EXAMPLES / "echo" / "echo.cu").read_bytes(), "echo")
    free, capped = Cubin(ptx_to_cubin(ptx, "sm_90", 248)), Cubin(ptx_to_cubin(ptx, "sm_90", 24))
    assert free.symbol("mesh_main", STT_FUNC) is not None and free.symbol("mesh_other", STT_FUNC) is None
    assert (free.registers("mesh_main") or 0) > 24 and capped.registers("mesh_main") == 24
    with pytest.raises(CubinError):
        Cubin(b"\x7fELF" + b"\x02\x01" + b"\0" * 10)


def test_check_is_a_listed_command():
    from ..rigs.serve import cli

    r = cli("--help")
    assert r.returncode == 0 and re.search(r"^\s+check\s+check a program without a GPU", r.stdout, re.M), r.stdout
    h = cli("check", "--help")
    assert h.returncode == 0 and "meshd-mps check examples/echo" in h.stdout and "--arch" in h.stdout, h.stdout


def test_the_sim_verdict_is_by_the_cubin(capsys, tmp):
    """``check`` says what the simulated GPU makes of the cubin it compiled: echo's PTX with a
    comment added (a new image hash, the same cubin) runs as echo; echo's code at 32 warps (another
    register cap, another cubin) is refused."""
    d = tmp / "v2"
    d.mkdir()
    (d / "echo.ptx").write_bytes(cuda_to_ptx((EXAMPLES / "echo" / "echo.cu").read_bytes(), "echo") + b"\n// v2\n")
    rc, out, _ = check(capsys, tmp, "--manifest", str(EXAMPLES / "echo" / "manifest.json"), "--ptx", str(d / "echo.ptx"))
    assert rc == 0 and "the simulated GPU runs it as echo" in out[-1], out
    wide = program_dir(tmp, "echo32", (EXAMPLES / "echo" / "echo.cu").read_text(), file="echo32.cu", warps=32)
    rc, out, _ = check(capsys, tmp, str(wide))
    assert rc == 0 and "the simulated GPU refuses it" in out[-1], out


def test_gpu_sim_asks_the_simulated_daemons_socket(capsys, tmp, monkeypatch):
    """``--gpu sim`` names the simulated daemon's default socket, as for every other client command
    (``check`` asked the GPU daemon's whatever it was told)."""
    monkeypatch.delenv("MESHD_MPS_SOCKET", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp))
    for gpu, sock in (("sim", "meshd-mps-sim.sock"), ("cuda", "meshd-mps.sock")):
        rc = main(["check", str(EXAMPLES / "echo"), "--gpu", gpu])
        out, err = capsys.readouterr()
        assert rc == 0, out + err
        assert f"no daemon at {tmp / sock}" in out.splitlines()[0], out


def test_output_cut_short_by_its_reader_is_no_traceback(tmp):
    """``meshd-mps check DIR | head -1``: the reader goes after one line; the rest is dropped
    quietly, as any Unix tool does, with no BrokenPipeError traceback."""
    import subprocess
    import sys

    r = subprocess.run(f"{sys.executable} -m meshd_mps check {EXAMPLES / 'echo'} --socket {tmp / 'nobody.sock'}"
                       " | head -1; echo \"rc=${PIPESTATUS[0]}\"", shell=True, executable="/bin/bash",
                       capture_output=True, text=True, timeout=60)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("target: sm_90") and lines[1] in ("rc=0", "rc=141"), r.stdout
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
