"""The shipped example programs (examples/heartbeat, echo, spin, fault, peek) and their images.

The simulated GPU (``--gpu sim``) runs no GPU code: it runs these examples' device code as
Python (workers/sim_kernels.py), so it must know that a cubin *is* one of them.  It knows by the
image in the driver's sense, the cubin a load hands the worker (``cubin_id``: its sha256), never by
the program's name (a user's ``echo_counter`` is not echo) nor by the load's hash of the PTX: the
PTX with a comment added is a new hash but the same cubin, the same code, so it is still the
example; the example's code under a manifest that changes the cubin (warps that change the
register cap) is another image.  The cubins are not written down here: they change with every
NVRTC and nvJitLink release, so they are derived at run time from the example sources this
package ships, compiled as a load compiles them (``cuda_to_ptx`` as ``meshd-mps load
examples/NAME`` does, then the daemon's JIT, ``Compiler.check``'s register cap and
``ptx_to_cubin``), once per process and device kind, which the daemon hands to each simulated
worker on its command line (``--examples``, ``as_arg``), so that a worker started for one load does
not spend it again.  The compile (~3 s of CPU with knn's kernel) is kept in the user's cache
directory (``$XDG_CACHE_HOME/meshd-mps/examples``), named by everything it depends on: the
examples' files, the GPU's kind and the compilers' versions, so that a daemon's next start, or
another daemon's, reads it, and a change to any of them compiles again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from importlib import metadata
from pathlib import Path

from meshd_mps.gpu.compiler import Compiler, Manifest, cuda_to_ptx, ptx_to_cubin
from meshd_mps.gpu.device import DeviceInfo

#: The examples folder of a source checkout (the wheel ships none: then nothing is recognised).
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
#: The examples the simulation runs, by name (each is a kernel of workers/sim_gpu.py).
NAMES = ("heartbeat", "echo", "spin", "fault", "peek", "knn")


def cubin_id(cubin: bytes) -> int:
    """A cubin's identity: the first 8 bytes of its sha256, big-endian (so its 16 hex digits are
    the start of ``sha256sum``'s)."""
    return int.from_bytes(hashlib.sha256(cubin).digest()[:8], "big")


def example_images(info: DeviceInfo) -> dict[int, str]:
    """Cubin id -> example name, for the shipped examples compiled for the GPU ``info``.  An example
    that cannot be read or compiled here (no checkout, no NVRTC or nvJitLink) is left out: the
    simulation then refuses its cubin as it refuses any other, saying which it knows."""
    return _images(dataclasses.replace(info, ordinal=0))  # one compile per kind of GPU, not per GPU


def _cache_key(info: DeviceInfo) -> str:
    """What the examples' cubins depend on, hashed: their files, the GPU's kind, the compilers."""
    h = hashlib.sha256(repr(info).encode())
    for pkg in ("cuda-bindings", "nvidia-cuda-nvrtc", "nvidia-nvjitlink"):
        try:
            h.update(f"{pkg} {metadata.version(pkg)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{pkg} -".encode())
    for path in sorted(p for p in EXAMPLES_DIR.rglob("*") if p.is_file() and p.suffix in (".cu", ".h", ".json")):
        h.update(str(path.relative_to(EXAMPLES_DIR)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:32]


def _cache_dir() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "meshd-mps" / "examples"


def _cached(key: str) -> dict[int, str] | None:
    try:
        return {int(h, 16): n for h, n in json.loads((_cache_dir() / f"{key}.json").read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return None


def _keep(key: str, images: dict[int, str]) -> None:
    """Written whole or not at all (another process may read it meanwhile); a cache that cannot be
    written is no error: the next start compiles again."""
    try:
        d = _cache_dir()
        d.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=".images.")
        with os.fdopen(fd, "w") as f:
            json.dump({f"{h:016x}": n for h, n in images.items()}, f)
        os.replace(tmp, d / f"{key}.json")
    except OSError:
        pass


@functools.cache
def _images(info: DeviceInfo) -> dict[int, str]:
    try:
        key = _cache_key(info)
    except OSError:  # no examples to read: nothing is known, as below
        key = ""
    if key and (got := _cached(key)) is not None:
        return got
    out: dict[int, str] = {}
    jit = Compiler(info)  # no cache: its checks and register cap only, the JIT is ptx_to_cubin as its _build runs it
    for name in NAMES:
        d = EXAMPLES_DIR / name
        try:
            m = Manifest.parse((d / "manifest.json").read_bytes())
            ptx = cuda_to_ptx((d / f"{name}.cu").read_bytes(), name, info.compute, [str(d)])
            _m, _hash, cap = jit.check(m, ptx)
            cubin = ptx_to_cubin(ptx, info.arch, cap)
        except Exception:  # OSError, ManifestError, CompileError, NVRTC or nvJitLink missing: not known here
            continue
        out[cubin_id(cubin)] = name
    if key and len(out) == len(NAMES):  # a partial answer (a compiler missing) is not kept
        _keep(key, out)
    return out


def as_arg(info: DeviceInfo) -> str:
    """The known images as a sim worker's ``--examples``: ``name=cubin id`` (16 hex digits),
    comma-separated (workers/sim_images.py ``parse`` reads it)."""
    return ",".join(f"{n}={h:016x}" for h, n in sorted(example_images(info).items(), key=lambda kv: kv[1]))
