"""From a program's manifest and PTX to a cubin for this GPU (the seed's c_prepare), with a cache.

The steps, in order, each a pure function here:

1. ``Manifest.parse``: the manifest JSON, every field checked (ManifestError names the field).
2. ``image_hash``: the image's identity, and ``check_hash`` against what the caller expects.
3. ``check_limits``: threads and shared memory against the device (LimitError).
4. ``reg_cap``: the register cap nvJitLink compiles to.
5. ``ptx_to_cubin``: nvJitLink, PTX -> cubin for ``sm_XY`` (CompileError "jit: ...").

``Compiler.prepare`` runs them off the event loop and keeps the cubins it made,
keyed by (image hash, arch, reg cap), in memory and optionally on disk.
``cuda_to_ptx`` is the NVRTC step before all this, for CUDA C sources
(examples/, tests); meshd itself takes PTX.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import struct
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import anyio.to_thread

from meshd_mps.base.errors import CompileError, HashMismatch, LimitError, ManifestError
from meshd_mps.base.names import check_name
from meshd_mps.base.strictjson import parse_json
from meshd_mps.gpu.device import DeviceInfo
from meshd_mps.protocol import abi
from meshd_mps.protocol.payloads import MAX_PAYLOAD, Layout

#: The device-side header's folder, passed to NVRTC with -I (a source checkout only).
INCLUDE_DIR = Path(__file__).resolve().parents[2] / "examples" / "include"

U32_MAX = (1 << 32) - 1
U64_MAX = (1 << 64) - 1


# ---- the manifest ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """A program's manifest.json: what meshd needs to know to compile and launch it."""

    name: str
    backend: str
    warps: int
    abi: int
    param: int = 0
    smem: int = 0
    scratch: int = 0
    # The program's data (docs/program-abi.md, "Data"): a file beside the manifest, which the client
    # that reads the directory sends with the load, and the device memory it needs if more than the file.
    data: str = ""
    data_bytes: int = 0
    #: The most bytes a request and a response may have (0: not declared, a ring entry's 188);
    #: beyond 188 they travel through the program's payload region (protocol/payloads.py).
    max_request: int = 0
    max_response: int = 0

    @property
    def threads(self) -> int:
        return self.warps * 32

    @property
    def layout(self) -> Layout:
        """Its payload region's layout (size 0: it has none)."""
        return Layout(self.max_request, self.max_response)

    @classmethod
    def parse(cls, data: bytes | str | Mapping[str, Any]) -> Manifest:
        """From JSON text or an already decoded object; ManifestError names the bad field."""
        if isinstance(data, (bytes, bytearray, str)):
            try:
                obj = parse_json(data)  # bounded depth: never a RecursionError
            except ValueError as e:
                raise ManifestError(f"manifest: not JSON: {e}") from e
        else:
            obj = data
        if not isinstance(obj, Mapping):
            raise ManifestError(f"manifest: a JSON object expected, got {type(obj).__name__}")
        known = {f.name for f in fields(cls)}
        for k in obj:
            if k not in known:
                raise ManifestError(f"manifest: unknown field {str(k)[:80]!r}")
        for k in ("name", "backend", "warps", "abi"):
            if k not in obj:
                raise ManifestError(f"manifest: field {k!r} is missing")

        name = obj["name"]
        check_name(name, "manifest: field 'name'")
        backend = obj["backend"]
        if not isinstance(backend, str):
            raise ManifestError(f"manifest: field 'backend' must be a string, got {_tname(backend)}")
        if backend != "cuda":
            raise ManifestError(f"manifest: field 'backend' {backend!r}: this meshd-mps runs only \"cuda\"")
        warps = _int(obj, "warps", 1, 32, None)
        ver = _int(obj, "abi", 0, U32_MAX, None)
        if ver != abi.RT_ABI:
            raise ManifestError(f"manifest: field 'abi' {ver}: this meshd-mps speaks program ABI {abi.RT_ABI}")
        return cls(
            name=name,
            backend=backend,
            warps=warps,
            abi=ver,
            param=_int(obj, "param", 0, U64_MAX, 0),
            smem=_int(obj, "smem", 0, U32_MAX, 0),
            scratch=_int(obj, "scratch", 0, U32_MAX, 0),
            data=_data_file(obj),
            data_bytes=_int(obj, "data_bytes", 0, U64_MAX, 0),
            max_request=_int(obj, "max_request", 0, MAX_PAYLOAD, 0),
            max_response=_int(obj, "max_response", 0, MAX_PAYLOAD, 0),
        )

    def as_dict(self) -> dict[str, Any]:
        """Its fields as a manifest says them (a record's): the payload sizes only where declared,
        so that a daemon older than them reads the record of a program that declares none."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in OPTIONAL or getattr(self, f.name)}

    def to_json(self) -> str:
        return json.dumps(self.as_dict())


#: Manifest fields written by ``to_json`` only where they are not 0 (newer than some readers).
OPTIONAL = ("max_request", "max_response")


def _data_file(obj: Mapping[str, Any]) -> str:
    """The manifest's ``data``: a file's name beside the manifest ("" for none)."""
    v = obj.get("data", "")
    if not isinstance(v, str):
        raise ManifestError(f"manifest: field 'data' must be a string (a file beside the manifest), got {_tname(v)}")
    if v and ("/" in v or v in (".", "..") or "\0" in v):
        raise ManifestError(f"manifest: field 'data' {v[:80]!r}: the name of a file beside the manifest, without '/'")
    return v


def _tname(v: Any) -> str:
    return "null" if v is None else type(v).__name__


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int, default: int | None) -> int:
    if key not in obj:
        assert default is not None
        return default
    v = obj[key]
    if isinstance(v, bool) or not isinstance(v, int):
        raise ManifestError(f"manifest: field {key!r} must be an integer, got {_tname(v)}")
    if not lo <= v <= hi:
        raise ManifestError(f"manifest: field {key!r} {v} is out of range {lo}..{hi}")
    return v


# ---- hash, limits, register cap ----------------------------------------------------------


def image_hash(ptx: bytes, param: int) -> int:
    """The image's identity: BLAKE2b with an 8-byte digest over the PTX bytes followed by
    ``param`` as a u64 little-endian, the digest read as a little-endian u64.

    So one PTX with two params is two images; a client computes the same value
    with ``int.from_bytes(hashlib.blake2b(ptx + param.to_bytes(8, "little"),
    digest_size=8).digest(), "little")``.
    """
    h = hashlib.blake2b(digest_size=8)
    h.update(ptx)
    h.update(struct.pack("<Q", param & U64_MAX))
    return int.from_bytes(h.digest(), "little")


def check_hash(name: str, what: str, got: int, hash: int | None) -> None:
    """HashMismatch when the caller required another image (``hash``, the word of every surface for
    the image a load requires; None: any)."""
    if hash is not None and got != hash:
        raise HashMismatch(f"{name}: {what} hash {got:016x}, expected {hash:016x}")


def check_limits(info: DeviceInfo, m: Manifest) -> None:
    """LimitError for a block the device cannot run."""
    if m.threads > info.max_threads:
        raise LimitError(
            f"{m.name}: {m.threads} threads per block ({m.warps} warps), the device allows {info.max_threads}"
        )
    if m.smem > info.max_shared:
        raise LimitError(
            f"{m.name}: {m.smem} bytes of shared memory per block, the device allows {info.max_shared} (opt-in)"
        )


def reg_cap(info: DeviceInfo, warps: int) -> int:
    """Registers per thread nvJitLink may use: ``min(255, regs_per_block // threads)``
    rounded down to a multiple of 8.

    Why: a resident program is one launch that must start whole, so one block
    of it must always fit the SM's register file.  Registers are handed out per
    warp in units of 256 (8 a thread), so a per-thread count that is a multiple
    of 8 and at most regs_per_block / threads makes a block of ``threads`` fit;
    255 is the ISA's most.  With 65536 registers: 1 warp -> 248, 32 warps -> 64.
    """
    threads = warps * 32
    return max(8, min(255, info.regs_per_block // threads) // 8 * 8)


# ---- NVRTC and nvJitLink -----------------------------------------------------------------


def _cstr(b: bytes | bytearray) -> str:
    return bytes(b).split(b"\0", 1)[0].decode("utf-8", "replace")


def _lines(log: str) -> str:
    return " | ".join(line.rstrip() for line in log.strip().splitlines() if line.strip())


def cuda_to_ptx(source: bytes, name: str, arch: str = "compute_90", include: list[str] | None = None) -> bytes:
    """NVRTC: CUDA C -> PTX for the virtual ``arch``; -I examples/include (mesh_program.h) and
    ``include``.  The PTX comes back without its trailing NUL.  CompileError with NVRTC's log."""
    from cuda.bindings import nvrtc

    def ck(r: Any, call: str) -> Any:
        err, *vals = r if isinstance(r, tuple) else (r,)
        if int(err) != 0:
            raise CompileError(f"nvrtc {call}: {err.name if hasattr(err, 'name') else err}")
        return vals[0] if len(vals) == 1 else tuple(vals)

    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17"]
    for d in [*(include or []), *([str(INCLUDE_DIR)] if INCLUDE_DIR.is_dir() else [])]:
        opts.append(f"--include-path={d}".encode())
    prog = ck(nvrtc.nvrtcCreateProgram(source, f"{name}.cu".encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        res = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        err = res[0] if isinstance(res, tuple) else res
        if int(err) != 0:
            n = ck(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
            buf = b" " * n
            ck(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
            raise CompileError(f"nvrtc: {name}: {_lines(_cstr(buf)) or err.name}")
        n = ck(nvrtc.nvrtcGetPTXSize(prog), "nvrtcGetPTXSize")
        buf = b" " * n
        ck(nvrtc.nvrtcGetPTX(prog, buf), "nvrtcGetPTX")
        return bytes(buf).split(b"\0", 1)[0]
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


_PTX_VERSION = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.M)


def ptx_version(ptx: bytes) -> tuple[int, int] | None:
    """The PTX ISA version of its ``.version`` directive."""
    m = _PTX_VERSION.search(ptx[:4096])
    return (int(m[1]), int(m[2])) if m else None


def max_ptx_version(toolkit: tuple[int, int]) -> tuple[int, int] | None:
    """The newest PTX ISA a CUDA ``toolkit`` (major, minor) release's nvJitLink reads
    (None where this table does not know the release)."""
    major, minor = toolkit
    if major == 13:
        return (9, minor)  # 13.0 -> 9.0 ... 13.5 -> 9.5
    table = {(12, 0): (8, 0), (12, 1): (8, 1), (12, 2): (8, 2), (12, 3): (8, 3), (12, 4): (8, 4),
             (12, 5): (8, 5), (12, 6): (8, 5), (12, 8): (8, 7), (12, 9): (8, 8)}  # fmt: skip
    return table.get((major, minor))


def nvjitlink_version() -> tuple[int, int]:
    from cuda.bindings import nvjitlink

    v = nvjitlink.version()
    return int(v[0]), int(v[1])


def _check_ptx_version(ptx: bytes) -> None:
    have = ptx_version(ptx)
    if have is None:
        return
    try:
        tk = nvjitlink_version()
    except Exception:
        return
    top = max_ptx_version(tk)
    if top is not None and have > top:
        raise CompileError(
            f"jit: PTX .version {have[0]}.{have[1]} is newer than this nvJitLink {tk[0]}.{tk[1]} reads "
            f"(at most {top[0]}.{top[1]}): the PTX comes from a newer NVRTC/nvcc; compile it with CUDA "
            f"{tk[0]}.{tk[1]} or older, or install a nvidia-nvjitlink as new as that compiler"
        )


#: The name nvJitLink is given for the one input (it appears in its error log).
PTX_INPUT = "program.ptx"


def ptx_to_cubin(ptx: bytes, arch: str, reg_cap: int) -> bytes:
    """nvJitLink: PTX -> cubin for ``arch`` (``sm_90``) with ``-maxrregcount=reg_cap``.

    CompileError("jit: " + the error log's lines joined with " | ") on failure,
    as the seed; a PTX newer than this nvJitLink is refused up front, saying so.
    """
    from cuda.bindings import nvjitlink

    _check_ptx_version(ptx)
    data = ptx if ptx.endswith(b"\0") else ptx + b"\0"
    opts = [f"-arch={arch}", f"-maxrregcount={reg_cap}"]
    try:
        h = nvjitlink.create(len(opts), opts)
    except nvjitlink.nvJitLinkError as e:
        raise CompileError(f"jit: nvJitLinkCreate({' '.join(opts)}): {e}") from e
    try:
        try:
            nvjitlink.add_data(h, nvjitlink.InputType.PTX, data, len(data), PTX_INPUT)
            nvjitlink.complete(h)
        except nvjitlink.nvJitLinkError as e:
            log = ""
            try:
                n = nvjitlink.get_error_log_size(h)
                buf = bytearray(n)
                nvjitlink.get_error_log(h, buf)
                log = _cstr(buf)
            except Exception:
                pass
            log = log.replace(f"NVJITLINK_INPUT_PTX{PTX_INPUT}", "NVJITLINK_INPUT_PTX")  # its log runs the name on
            why = _lines(log) or str(e)
            if "does not match type NVJITLINK_INPUT_PTX" in log:
                why = f"not PTX text (the file given as PTX is something else; nvJitLink: {why})"
            if "Unsupported .version" in log:
                why += " | (PTX from a newer NVRTC/nvcc than this nvJitLink)"
            raise CompileError(f"jit: {why}") from e
        n = nvjitlink.get_linked_cubin_size(h)
        out = bytearray(n)
        nvjitlink.get_linked_cubin(h, out)
        return bytes(out)
    finally:
        nvjitlink.destroy(h)


# ---- prepare, with the cache -------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    manifest: Manifest
    hash: int
    cubin: bytes
    compile_ms: float  # the JIT's time; a cache hit's lookup time
    cached: bool
    reg_cap: int
    threads: int
    arch: str = ""


class Compiler:
    """The checks and the JIT for one device, with a cubin cache.

    The cache key is (image hash, arch, reg cap): the hash covers the PTX and
    param, and arch and reg cap are all nvJitLink is given besides.  On disk
    (``cache_dir``) a cubin is ``<hash>-<arch>-r<cap>.cubin``, written to a
    temporary file and renamed, so a reader never sees half of one.
    """

    def __init__(self, info: DeviceInfo, cache_dir: str | os.PathLike[str] | None = None):
        self.info = info
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self._mem: dict[tuple[int, str, int], bytes] = {}
        self._mem_lock = threading.Lock()
        self._inflight: dict[tuple[int, str, int], list[Any]] = {}  # [lock, users]
        self.jit_count = 0  # JITs actually run (tests: a cache hit runs none)

    def _path(self, key: tuple[int, str, int]) -> Path | None:
        if self.cache_dir is None:
            return None
        h, arch, cap = key
        return self.cache_dir / f"{h:016x}-{arch}-r{cap}.cubin"

    def check(
        self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, hash: int | None = None
    ) -> tuple[Manifest, int, int]:
        """The checks without the JIT: (manifest, hash, reg cap)."""
        m = manifest if isinstance(manifest, Manifest) else Manifest.parse(manifest)
        h = image_hash(ptx, m.param)
        check_hash(m.name, "PTX", h, hash)
        check_limits(self.info, m)
        return m, h, reg_cap(self.info, m.warps)

    def _lookup_disk(self, key: tuple[int, str, int]) -> bytes | None:
        p = self._path(key)
        if p is None:
            return None
        try:
            data = p.read_bytes()
        except OSError:
            return None
        return data if data[:4] == b"\x7fELF" else None  # a stray file is recompiled over

    def _store_disk(self, key: tuple[int, str, int], cubin: bytes) -> None:
        p = self._path(key)
        if p is None:
            return
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=".cubin")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(cubin)
                os.replace(tmp, p)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError:
            pass  # the cache is an optimisation: a read-only or full disk only costs a JIT

    def _build(self, ptx: bytes, key: tuple[int, str, int]) -> tuple[bytes, bool, float]:
        t0 = time.perf_counter()
        got = self._lookup_disk(key)
        if got is not None:
            return got, True, (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        cubin = ptx_to_cubin(ptx, key[1], key[2])
        ms = (time.perf_counter() - t0) * 1e3
        with self._mem_lock:
            self.jit_count += 1
        self._store_disk(key, cubin)
        return cubin, False, ms

    async def prepare(
        self, manifest: Manifest | bytes | str | Mapping[str, Any], ptx: bytes, hash: int | None = None
    ) -> Prepared:
        """Check and compile one image (the seed's c_prepare); a second prepare of the same
        image for the same arch and cap comes from the cache (``cached`` True)."""
        m, h, cap = self.check(manifest, ptx, hash)
        key = (h, self.info.arch, cap)
        entry = self._inflight.get(key)
        if entry is None:
            entry = self._inflight[key] = [asyncio.Lock(), 0]
        entry[1] += 1
        try:
            async with entry[0]:  # two prepares of one image run one JIT
                t0 = time.perf_counter()
                with self._mem_lock:
                    hit = self._mem.get(key)
                if hit is not None:
                    cubin, cached, ms = hit, True, (time.perf_counter() - t0) * 1e3
                else:
                    cubin, cached, ms = await anyio.to_thread.run_sync(self._build, ptx, key)
                    with self._mem_lock:
                        self._mem[key] = cubin
        finally:
            entry[1] -= 1
            if entry[1] == 0:
                del self._inflight[key]
        return Prepared(
            manifest=m, hash=h, cubin=cubin, compile_ms=ms, cached=cached, reg_cap=cap, threads=m.threads,
            arch=self.info.arch,
        )
