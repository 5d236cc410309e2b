"""The compiler on the CPU: real NVRTC and nvJitLink, the checks, the cache; device info without a GPU."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path

import pytest

from meshd_mps.base.errors import CompileError, ConfigError, HashMismatch, LimitError, ManifestError, NoDriver
from meshd_mps.gpu import compiler
from meshd_mps.gpu.compiler import (
    Compiler,
    Manifest,
    check_hash,
    cuda_to_ptx,
    image_hash,
    max_ptx_version,
    ptx_to_cubin,
    ptx_version,
    reg_cap,
)
from meshd_mps.gpu.device import caps_of, check_sms, query_device, simulated_device
from meshd_mps.protocol import abi

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ["heartbeat", "echo", "spin", "fault"]
INFO = simulated_device()


def example(name: str) -> tuple[bytes, bytes]:
    d = ROOT / "examples" / name
    return (d / f"{name}.cu").read_bytes(), (d / "manifest.json").read_bytes()


@pytest.fixture(scope="module")
def ptxs() -> dict[str, bytes]:
    return {n: cuda_to_ptx(example(n)[0], n) for n in EXAMPLES}


GOOD = {"name": "heartbeat", "backend": "cuda", "warps": 1, "abi": abi.RT_ABI}


# ---- the examples ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", EXAMPLES)
async def test_example_compiles_to_sm90_cubin(name: str, ptxs: dict[str, bytes]) -> None:
    ptx = ptxs[name]
    assert b".entry mesh_main(" in ptx and re.search(rb"\.u32 mesh_rt_abi = 1;", ptx)
    assert not ptx.endswith(b"\0")
    m = Manifest.parse(example(name)[1])
    assert m.name == name and m.threads == 32
    p = await Compiler(INFO).prepare(m, ptx)
    assert p.cubin[:4] == b"\x7fELF"
    assert p.hash == image_hash(ptx, m.param) and p.threads == 32 and p.reg_cap == 248
    assert not p.cached and p.compile_ms > 0 and p.arch == "sm_90"


def test_header_matches_abi_py() -> None:
    text = (ROOT / "examples" / "include" / "mesh_program.h").read_text()
    consts = {k: int(v) for k, v in re.findall(r"#define MESH_(\w+) (\d+)u\b", text)}
    for k in ["CONTROL", "STATE", "HEARTBEAT", "BEAT_TIME", "MAX_GAP", "GAP_RESET", "REQ_HEAD", "RESP_HEAD",
              "RING", "ENTRY_BYTES", "REQ_BASE", "SLOT_BYTES", "SLOTS", "RUN", "HALT", "IDLE", "RUNNING",
              "EXITED", "RT_ABI", "BEAT_EVERY"]:  # fmt: skip
        assert consts[k] == getattr(abi, k), k
    assert abi.RESP_BASE == 1664 and abi.USER_BASE == 3200  # the header's comments
    assert "extern \"C\" __global__ void mesh_main(unsigned long long mailbox, unsigned int slot)" in text


def test_scratch_global_and_threads() -> None:
    src = b"""#include "mesh_program.h"
MESH_DEFINE_RT_ABI();
MESH_DEFINE_SCRATCH();
MESH_MAIN { if (mesh_scratch) ((unsigned *)mesh_scratch)[threadIdx.x] = slot; }
"""
    ptx = cuda_to_ptx(src, "scratchy")
    assert re.search(rb"\.u64 mesh_scratch", ptx)
    assert ptx_to_cubin(ptx, "sm_90", 64)[:4] == b"\x7fELF"


# ---- errors ----------------------------------------------------------------------------------


def test_bad_ptx_is_a_jit_error_with_its_log_lines() -> None:
    ptx = b".version 8.0\n.target sm_90\n.address_size 64\n.visible .entry mesh_main() { garbage; }\n"
    with pytest.raises(CompileError) as e:
        ptx_to_cubin(ptx, "sm_90", 64)
    msg = str(e.value)
    assert msg.startswith("jit: ") and " | " in msg and "\n" not in msg, msg


def test_ptx_newer_than_nvjitlink_says_so(ptxs: dict[str, bytes]) -> None:
    ptx = re.sub(rb"\.version \d+\.\d+", b".version 99.0", ptxs["heartbeat"])
    assert ptx_version(ptx) == (99, 0)
    with pytest.raises(CompileError, match=r"^jit: .*newer"):
        ptx_to_cubin(ptx, "sm_90", 64)
    assert max_ptx_version((13, 0)) == (9, 0) and max_ptx_version((13, 5)) == (9, 5)
    assert max_ptx_version((12, 6)) == (8, 5) and max_ptx_version((99, 0)) is None


def test_bad_cuda_c_is_an_nvrtc_error() -> None:
    with pytest.raises(CompileError, match=r"^nvrtc: broken: .*error"):
        cuda_to_ptx(b'#include "mesh_program.h"\nMESH_MAIN { undeclared = 1; }\n', "broken")


async def test_hash_mismatch(ptxs: dict[str, bytes]) -> None:
    ptx = ptxs["heartbeat"]
    h = image_hash(ptx, 0)
    with pytest.raises(HashMismatch) as e:
        await Compiler(INFO).prepare(GOOD, ptx, hash=h ^ 1)
    assert str(e.value) == f"heartbeat: PTX hash {h:016x}, expected {h ^ 1:016x}"
    assert (await Compiler(INFO).prepare(GOOD, ptx, hash=h)).hash == h
    check_hash("x", "PTX", 5, None)  # no expectation, no check


def test_image_hash_definition() -> None:
    ptx, param = b"// some ptx\n", 0x0102030405060708
    d = hashlib.blake2b(ptx + param.to_bytes(8, "little"), digest_size=8).digest()
    assert image_hash(ptx, param) == int.from_bytes(d, "little")
    assert image_hash(ptx, 0) != image_hash(ptx, 1)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"name": ""}, "name"),
        ({"name": "x" * 65}, "name"),
        ({"name": ".hidden"}, "name"),
        ({"name": "a/b"}, "name"),
        ({"name": 7}, "name"),
        ({"backend": "hip"}, "backend"),
        ({"backend": None}, "backend"),
        ({"warps": 0}, "warps"),
        ({"warps": 33}, "warps"),
        ({"warps": "1"}, "warps"),
        ({"warps": True}, "warps"),
        ({"warps": 1.0}, "warps"),
        ({"param": -1}, "param"),
        ({"param": 1 << 64}, "param"),
        ({"param": "0x10"}, "param"),
        ({"smem": -1}, "smem"),
        ({"smem": 1 << 32}, "smem"),
        ({"scratch": -4}, "scratch"),
        ({"scratch": 1 << 32}, "scratch"),
        ({"scratch": [1]}, "scratch"),
        ({"abi": abi.RT_ABI + 1}, "abi"),
        ({"abi": "1"}, "abi"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_manifest_field_errors(change: dict, field: str) -> None:
    with pytest.raises(ManifestError, match=f"'{field}'"):
        Manifest.parse(json.dumps({**GOOD, **change}))


@pytest.mark.parametrize("missing", ["name", "backend", "warps", "abi"])
def test_manifest_required_fields(missing: str) -> None:
    d = dict(GOOD)
    del d[missing]
    with pytest.raises(ManifestError, match=f"'{missing}' is missing"):
        Manifest.parse(d)


def test_manifest_not_json_or_not_object() -> None:
    with pytest.raises(ManifestError, match="not JSON"):
        Manifest.parse(b"{nope")
    with pytest.raises(ManifestError, match="object"):
        Manifest.parse("[1, 2]")


def test_manifest_defaults_and_round_trip() -> None:
    m = Manifest.parse({**GOOD, "name": "a-b_c.9", "warps": 32, "param": (1 << 64) - 1, "smem": 1024, "scratch": 4096})
    assert (m.threads, m.param, m.smem, m.scratch) == (1024, (1 << 64) - 1, 1024, 4096)
    assert Manifest.parse(m.to_json()) == m
    d = Manifest.parse(GOOD)
    assert (d.param, d.smem, d.scratch) == (0, 0, 0)


async def test_smem_over_the_device_limit(ptxs: dict[str, bytes]) -> None:
    m = {**GOOD, "smem": INFO.max_shared + 1}
    with pytest.raises(LimitError) as e:
        await Compiler(INFO).prepare(m, ptxs["heartbeat"])
    assert "heartbeat" in str(e.value) and str(INFO.max_shared + 1) in str(e.value) and str(INFO.max_shared) in str(e.value)
    assert (await Compiler(INFO).prepare({**GOOD, "smem": INFO.max_shared}, ptxs["heartbeat"])).cubin


async def test_threads_over_the_device_limit(ptxs: dict[str, bytes]) -> None:
    small = dataclasses.replace(INFO, max_threads=512)
    with pytest.raises(LimitError) as e:
        await Compiler(small).prepare({**GOOD, "warps": 17}, ptxs["heartbeat"])
    assert "heartbeat" in str(e.value) and "544" in str(e.value) and "512" in str(e.value)
    await Compiler(small).prepare({**GOOD, "warps": 16}, ptxs["heartbeat"])


@pytest.mark.parametrize("warps, cap", [(1, 248), (3, 248), (8, 248), (10, 200), (16, 128), (24, 80), (32, 64)])
def test_reg_cap(warps: int, cap: int) -> None:
    got = reg_cap(INFO, warps)
    assert got == cap and got % 8 == 0 and got * warps * 32 <= INFO.regs_per_block


def test_reg_cap_is_applied(ptxs: dict[str, bytes]) -> None:
    # A register-hungry kernel compiled with a low cap spills to local memory: nvJitLink got the cap.
    src = b"""#include "mesh_program.h"
MESH_DEFINE_RT_ABI();
MESH_MAIN {
  volatile unsigned *p = (volatile unsigned *)mailbox;
  unsigned v[64];
  for (int i = 0; i < 64; i++) v[i] = p[i * 7 + slot];
  for (int r = 0; r < 8; r++) for (int i = 0; i < 64; i++) v[i] = v[i] * v[(i + 13) & 63] + r;
  for (int i = 0; i < 64; i++) p[i] = v[i];
}
"""
    ptx = cuda_to_ptx(src, "hungry")
    assert len(ptx_to_cubin(ptx, "sm_90", 16)) != len(ptx_to_cubin(ptx, "sm_90", 248))


# ---- the cache -------------------------------------------------------------------------------


async def test_cache_hit_skips_the_jit(ptxs: dict[str, bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = Compiler(INFO, cache_dir=tmp_path)
    first = await c.prepare(GOOD, ptxs["heartbeat"])
    assert not first.cached and c.jit_count == 1
    files = list(tmp_path.glob("*.cubin"))
    assert [f.name for f in files] == [f"{first.hash:016x}-sm_90-r248.cubin"]
    assert files[0].read_bytes() == first.cubin

    def no_jit(*a: object) -> bytes:
        raise AssertionError("the JIT ran on a cache hit")

    monkeypatch.setattr(compiler, "ptx_to_cubin", no_jit)
    again = await c.prepare(GOOD, ptxs["heartbeat"])  # memory
    assert again.cached and again.cubin == first.cubin and c.jit_count == 1
    other = Compiler(INFO, cache_dir=tmp_path)  # disk
    disk = await other.prepare(GOOD, ptxs["heartbeat"])
    assert disk.cached and disk.cubin == first.cubin and other.jit_count == 0
    # Another cap is another key: the JIT would run (and here refuses).
    with pytest.raises(AssertionError, match="JIT ran"):
        await other.prepare({**GOOD, "warps": 32}, ptxs["heartbeat"])
    assert not list(tmp_path.glob(".tmp-*"))


async def test_concurrent_prepares_run_one_jit(ptxs: dict[str, bytes]) -> None:
    import asyncio

    c = Compiler(INFO)
    a, b = await asyncio.gather(c.prepare(GOOD, ptxs["echo"]), c.prepare(GOOD, ptxs["echo"]))
    assert c.jit_count == 1 and {a.cached, b.cached} == {False, True} and a.cubin == b.cubin


async def test_a_stray_cache_file_is_recompiled(ptxs: dict[str, bytes], tmp_path: Path) -> None:
    h = image_hash(ptxs["spin"], 0)
    (tmp_path / f"{h:016x}-sm_90-r248.cubin").write_bytes(b"junk")
    c = Compiler(INFO, cache_dir=tmp_path)
    p = await c.prepare(GOOD, ptxs["spin"])
    assert not p.cached and c.jit_count == 1 and p.cubin[:4] == b"\x7fELF"


# ---- device info -----------------------------------------------------------------------------


def test_query_device_without_a_driver() -> None:
    try:
        info = query_device()
    except NoDriver as e:
        assert str(e).startswith("no NVIDIA driver: ")
        assert "\n" not in str(e)
        return
    pytest.skip(f"a driver is present here ({info.name}): nothing to refuse")


def test_simulated_device_and_caps() -> None:
    assert (INFO.arch, INFO.compute, INFO.sms_total, INFO.max_shared) == ("sm_90", "compute_90", 132, 232448)
    c = caps_of(INFO, 0)
    assert (c.backend, c.sms, c.green, c.arch, c.max_threads) == ("cuda", 132, False, "sm_90", 1024)
    c = caps_of(INFO, 16)
    assert (c.sms, c.green, c.sms_total) == (16, True, 132)
    with pytest.raises(ConfigError) as e:
        check_sms(INFO, 133)
    assert str(e.value) == "sms 133: the device has 132"
    with pytest.raises(ConfigError):
        caps_of(INFO, -1)
